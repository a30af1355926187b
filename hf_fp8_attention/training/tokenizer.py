"""A small byte-level BPE tokenizer trained on the corpus with ``tokenizers``, cached on disk.

Training takes seconds on the default corpus; the result is cached under
``$HF_FP8_ATTENTION_CACHE`` (default ``~/.cache/hf_fp8_attention``) keyed by the corpus fingerprint
and vocabulary size, and returned as a ``PreTrainedTokenizerFast`` so Trainer, collators and
``save_pretrained`` treat it like any Hub tokenizer.
"""
from __future__ import annotations

import hashlib
import os
from pathlib import Path

from .errors import UsageError

# What AutoTokenizer.from_pretrained can load a tokenizer from (any one suffices).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
SPECIAL_TOKENS = {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>", "unk_token": "<unk>"}


def cache_dir() -> Path:
    """Where trained tokenizers (and other derived artefacts) are cached."""
    root = os.environ.get("HF_FP8_ATTENTION_CACHE") or Path.home() / ".cache" / "hf_fp8_attention"
    return Path(root)


def _wrap(tok_file: Path):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_file=str(tok_file), **SPECIAL_TOKENS)


def train_tokenizer(dataset, vocab_size: int = 8192, *, show_progress: bool = True):
    """Train (or load from cache) a byte-level BPE on ``dataset['text']``.

    Args:
        dataset: a ``datasets.Dataset`` with a ``text`` column.
        vocab_size: the BPE vocabulary size including the four special tokens.
    Returns:
        A ``PreTrainedTokenizerFast`` with ``<s>``, ``</s>``, ``<pad>``, ``<unk>``.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if vocab_size < 300:
        raise UsageError(f"--vocab-size {vocab_size} is too small for a byte-level BPE (needs >= 300)")
    fingerprint = getattr(dataset, "_fingerprint", None) or str(len(dataset))
    key = hashlib.sha256(f"{fingerprint}|{len(dataset)}|{vocab_size}|bytebpe-v1".encode()).hexdigest()[:16]
    path = cache_dir() / "tokenizers" / key / "tokenizer.json"
    if path.exists():
        return _wrap(path)
    tok = Tokenizer(models.BPE(unk_token=SPECIAL_TOKENS["unk_token"]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS.values()),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=show_progress,
    )

    def batches(size: int = 256):
        for start in range(0, len(dataset), size):
            yield dataset[start:start + size]["text"]

    tok.train_from_iterator(batches(), trainer=trainer, length=len(dataset))
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tok.save(str(tmp))
    os.replace(tmp, path)  # atomic: concurrent runs never read a half-written file
    return _wrap(path)


def load_tokenizer(model_path: str):
    """The tokenizer saved beside a local checkpoint; a clear error if there is none."""
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(model_path, local_files_only=True)
    except (OSError, ValueError) as err:
        path = Path(model_path).expanduser()
        if not any((path / name).exists() for name in TOKENIZER_FILES):
            reason = (f"it holds none of {', '.join(TOKENIZER_FILES)}; save the model's tokenizer there "
                      "(tokenizer.save_pretrained(DIR))")
        else:  # Transformers' message spans several lines: keep all of it, on one line
            reason = f"its tokenizer files could not be loaded: {' '.join(str(err).split())}"
        raise UsageError(f"--model {model_path}: no usable tokenizer in the checkpoint directory; {reason}") from None
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token  # decoder-only checkpoints often ship without one; labels mask padding
    return tok
