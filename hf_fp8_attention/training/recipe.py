"""What every example shares: its common flags, their defaults, data/model preparation, the summary.

Each example declares two default settings — ``gpu`` (the real run) and ``tiny`` (finishes on a
CPU in seconds) — and any flag the user passes overrides them. ``--tiny`` forces the tiny setting;
without a CUDA GPU it is chosen automatically.
"""
from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from .errors import UsageError, created_output_dirs
from .models import ATTN_CHOICES, SUPPORTED_MODEL_TYPES, check_attn, check_seq_len, head_dim_of, load_config, tiny_config

_POSITIVE_INTS = ("seq_len", "batch_size", "max_steps", "vocab_size", "grad_accum", "corpus_bytes")


def add_common_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Flags shared by all examples (defaults ``None`` = take the example's gpu/tiny default)."""
    g = parser.add_argument_group("model and data")
    g.add_argument("--model", help="local checkpoint directory (config.json + weights + tokenizer); "
                                   "default: a small model built from a config")
    g.add_argument("--family", choices=SUPPORTED_MODEL_TYPES, default="llama", help="family of the built model")
    g.add_argument("--size", choices=("tiny", "small"), help="size of the built model")
    g.add_argument("--data", help="text/JSON/CSV/Parquet file(s), a save_to_disk dataset, or packages:NAME,... "
                                  "(installed packages' Python sources); default: the Python standard library's "
                                  "sources")
    g.add_argument("--text-column", default="text")
    g.add_argument("--corpus-bytes", type=int, help="cap on the size of the default or packages: corpus")
    g.add_argument("--vocab-size", type=int, help="BPE vocabulary of the trained tokenizer (built models)")
    t = parser.add_argument_group("training")
    t.add_argument("--attn", choices=ATTN_CHOICES, default="fp8_delta", help="attention implementation")
    t.add_argument("--seq-len", type=int)
    t.add_argument("--batch-size", type=int)
    t.add_argument("--grad-accum", type=int, default=1)
    t.add_argument("--max-steps", type=int)
    t.add_argument("--lr", type=float)
    t.add_argument("--warmup-steps", type=int)
    t.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=None,
                   help="bf16 mixed precision (default: on where the GPU supports it)")
    t.add_argument("--gradient-checkpointing", action=argparse.BooleanOptionalAction, default=None)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--output-dir", default=None, help="checkpoints, loss PNG and summary.json")
    t.add_argument("--tiny", action="store_true", help="tiny CPU-sized defaults even on a GPU")
    t.add_argument("--no-progress", action="store_true", help="no progress bars (logs only)")
    return parser


def resolve_defaults(args: argparse.Namespace, *, gpu: dict, tiny: dict) -> argparse.Namespace:
    """Fill flags left at ``None`` from the ``gpu`` or ``tiny`` defaults and validate them."""
    import torch

    use_tiny = args.tiny or not torch.cuda.is_available()
    args.setting = "tiny" if use_tiny else "gpu"
    for key, value in (tiny if use_tiny else gpu).items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    for key in _POSITIVE_INTS:
        value = getattr(args, key, None)
        if value is not None and value < 1:
            raise UsageError(f"--{key.replace('_', '-')} must be a positive integer, got {value}")
    if args.lr is not None and not (math.isfinite(args.lr) and args.lr > 0):
        raise UsageError(f"--lr must be a positive number, got {args.lr}")
    if args.bf16 is None:
        args.bf16 = torch.cuda.is_available() and torch.cuda.is_bf16_supported() and not use_tiny
    # --bf16 without a GPU runs bf16 autocast on the CPU (the FP8 attention casts q/k/v to the
    # autocast dtype as sdpa does); it is slower than fp32 there, hence off by default.
    return args


def prepare(args: argparse.Namespace, *, max_position_embeddings: int | None = None, rope_parameters=None,
            check_len: bool = True):
    """Corpus, tokenizer and model config for ``args`` (model weights are built/loaded by the caller).

    With ``args.gguf_file`` (a GGUF file, see :mod:`.pretrained`) config and tokenizer come from it.
    Returns ``(corpus, tokenizer, config)``; raises :class:`UsageError` on bad paths, unsupported
    models, empty data, or a ``--seq-len`` the model cannot take.
    """
    from .corpus import load_corpus
    from .tokenizer import load_tokenizer, train_tokenizer

    check_attn(args.attn)
    gguf_file = getattr(args, "gguf_file", None)  # only the examples that offer --gguf-file have it
    if gguf_file is not None:
        from .pretrained import load_gguf_config, load_gguf_tokenizer

        if args.model is not None:
            raise UsageError("--model and --gguf-file both given; pass one of them")
        config = load_gguf_config(gguf_file)
        tokenizer = load_gguf_tokenizer(gguf_file)
    if args.model is not None:
        config = load_config(args.model)
        tokenizer = load_tokenizer(args.model)
    # load_corpus caps only the standard-library and packages corpora, never the user's files
    corpus = load_corpus(args.data, text_column=args.text_column, max_bytes=args.corpus_bytes)
    if args.model is None and gguf_file is None:
        tokenizer = train_tokenizer(corpus, args.vocab_size, show_progress=not args.no_progress)
        config = tiny_config(args.family, args.size, vocab_size=len(tokenizer),
                             max_position_embeddings=max_position_embeddings or args.seq_len,
                             tokenizer=tokenizer, rope_parameters=rope_parameters)
    check_attn(args.attn, head_dim_of(config))
    if check_len:
        check_seq_len(config, args.seq_len)
    return corpus, tokenizer, config


def output_dir(args: argparse.Namespace, example: str) -> Path:
    """``--output-dir`` or ``outputs/<example>/<attn>``, created; removed again if the run fails
    before writing anything there (see :func:`.errors.remove_empty_output_dirs`)."""
    path = Path(args.output_dir or Path("outputs") / example / args.attn)
    created = [p for p in (path, *path.parents) if not p.exists()]
    path.mkdir(parents=True, exist_ok=True)
    created_output_dirs.extend(created)  # deepest first
    return path


def checkpointing_args(enabled: bool) -> dict:
    """TrainingArguments' activation-checkpointing fields under the name this Transformers uses.

    Recent v5 releases renamed ``gradient_checkpointing(_kwargs)`` to ``activation_checkpointing(_kwargs)``
    and warn (FutureWarning) whenever the old names are passed, even as False.
    """
    import dataclasses

    from transformers import TrainingArguments

    names = {f.name for f in dataclasses.fields(TrainingArguments)}
    prefix = "activation" if "activation_checkpointing" in names else "gradient"
    # Non-reentrant: works with frozen inputs (LoRA).
    return {f"{prefix}_checkpointing": bool(enabled), f"{prefix}_checkpointing_kwargs": {"use_reentrant": False}}


def write_summary(out_dir: Path, summary: dict, lines: list[str]) -> None:
    """Write ``summary.json`` and print a concise human summary (the last lines of every example)."""
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
    print("\n=== summary ===")
    for line in lines:
        print(line)
    print(f"summary.json: {out_dir / 'summary.json'}")


def quiet_datasets(args: argparse.Namespace) -> None:
    """Silence datasets' per-map progress bars with ``--no-progress`` (they drown the training log)."""
    if args.no_progress:
        import datasets

        datasets.disable_progress_bars()


def loss_trend(losses: list[float]) -> tuple[float, float]:
    """Mean of the first and last quarter of a loss curve (what 'the loss went down' compares)."""
    n = max(1, len(losses) // 4)
    return sum(losses[:n]) / n, sum(losses[-n:]) / n
