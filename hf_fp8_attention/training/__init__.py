"""Shared helpers for the examples, the ``demo`` command and the notebooks.

Offline by construction: the default corpus is the Python standard library's sources, the
tokenizer is trained on it with ``tokenizers`` and cached, models are built from small configs or
loaded from a local directory. Needs the ``train`` extra (datasets, matplotlib, tqdm, ...).
"""
from .corpus import load_corpus, package_source_files, package_versions, stdlib_source_files
from .data import chunk_documents, group_texts, make_collator, split_train_eval
from .errors import UsageError, main_with_usage_errors
from .models import (ATTN_CHOICES, FP8_ATTNS, SUPPORTED_MODEL_TYPES, build_model, check_attn, check_seq_len,
                     head_dim_of, load_config, tiny_config)
from .plotting import plot_loss_curves
from .tokenizer import cache_dir, load_tokenizer, train_tokenizer

__all__ = [
    "ATTN_CHOICES", "FP8_ATTNS", "SUPPORTED_MODEL_TYPES", "UsageError", "build_model", "cache_dir", "check_attn",
    "check_seq_len", "chunk_documents", "group_texts", "head_dim_of", "load_config", "load_corpus",
    "load_tokenizer", "main_with_usage_errors", "make_collator", "package_source_files", "package_versions",
    "plot_loss_curves", "split_train_eval", "stdlib_source_files", "tiny_config", "train_tokenizer",
]
