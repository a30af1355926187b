"""Tokenizing a text corpus into training examples, and the batch collators.

Two layouts:
  * ``chunk_documents``: each document (plus EOS) split into pieces of at most ``seq_len`` tokens.
    Batched either padded (``DataCollatorForLanguageModeling``) or packed without padding
    (``DataCollatorWithFlattening``: one row, ``position_ids`` restarting per document, so the
    attention sees each document separately — the varlen path).
  * ``group_texts``: the classic pretraining layout — documents concatenated with EOS and cut into
    fixed ``seq_len`` blocks (no padding, every token trains).
"""
from __future__ import annotations

from .errors import UsageError

MIN_CHUNK = 8  # shorter tails teach nothing and only add padding


def _tokenize(dataset, tokenizer, num_proc: int | None = None):
    eos = tokenizer.eos_token_id

    def tok(batch):
        ids = tokenizer(batch["text"], add_special_tokens=False)["input_ids"]
        return {"input_ids": [x + [eos] for x in ids]}

    return dataset.map(tok, batched=True, remove_columns=dataset.column_names, num_proc=num_proc,
                       desc="tokenizing")


def chunk_documents(dataset, tokenizer, seq_len: int):
    """Per-document chunks of <= ``seq_len`` token ids (column ``input_ids``)."""

    def split(batch):
        out = []
        for ids in batch["input_ids"]:
            out.extend(ids[i:i + seq_len] for i in range(0, len(ids), seq_len) if len(ids[i:i + seq_len]) >= MIN_CHUNK)
        return {"input_ids": out}

    ds = _tokenize(dataset, tokenizer).map(split, batched=True, desc="chunking")
    return _nonempty(ds, seq_len)


def group_texts(dataset, tokenizer, seq_len: int):
    """Fixed blocks of exactly ``seq_len`` tokens from the concatenated corpus (column ``input_ids``)."""

    def group(batch):
        flat = [t for ids in batch["input_ids"] for t in ids]
        n = len(flat) // seq_len * seq_len
        return {"input_ids": [flat[i:i + seq_len] for i in range(0, n, seq_len)]}

    # Large map batches so that short documents still fill blocks; the remainder of each batch is dropped.
    ds = _tokenize(dataset, tokenizer).map(group, batched=True, batch_size=2000, desc="packing")
    return _nonempty(ds, seq_len)


def _nonempty(ds, seq_len: int):
    if len(ds) == 0:
        raise UsageError(f"the dataset yields no training example of length {seq_len} "
                         f"(too little text; lower --seq-len or add data)")
    return ds


def split_train_eval(ds, eval_fraction: float = 0.05, seed: int = 0, min_eval: int = 2, max_eval: int = 1024):
    """A (train, eval) split: ``eval_fraction`` of the examples, clamped to ``[min_eval, max_eval]``."""
    if len(ds) < min_eval + 1:
        raise UsageError(f"the dataset has only {len(ds)} example(s); need at least {min_eval + 1}")
    n_eval = max(min_eval, min(max_eval, int(len(ds) * eval_fraction)))
    parts = ds.train_test_split(test_size=n_eval, seed=seed, shuffle=True)
    return parts["train"], parts["test"]


def make_collator(tokenizer, packed: bool):
    """``DataCollatorWithFlattening`` (packed, no padding) or a causal-LM padding collator."""
    from transformers import DataCollatorForLanguageModeling, DataCollatorWithFlattening

    if packed:
        return DataCollatorWithFlattening(return_position_ids=True)
    return DataCollatorForLanguageModeling(tokenizer=tokenizer, mlm=False)
