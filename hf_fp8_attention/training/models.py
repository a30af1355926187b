"""Small model configs per family, loading local checkpoints, and the checks that go with them.

Every model here is a decoder-only causal LM whose attention goes through Transformers'
``AttentionInterface``, so ``attn_implementation="fp8_delta"`` (registered by
``import hf_fp8_attention``) swaps the attention core and nothing else.
"""
from __future__ import annotations

import json
from pathlib import Path

from .errors import UsageError

ATTN_CHOICES = ("fp8_delta", "fp8_stale", "sdpa")
FP8_ATTNS = ("fp8_delta", "fp8_stale")
# Families whose attention is dispatched through AttentionInterface and that the tests build.
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")

# Sizes: "tiny" finishes on CPU in seconds; "small" is the GPU default (~29M params with an 8k vocab).
_SIZES = {
    "tiny": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=1, head_dim=64),
    "small": dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
                  num_key_value_heads=4, head_dim=64),
}


def tiny_config(family: str = "llama", size: str = "tiny", *, vocab_size: int, max_position_embeddings: int,
                tokenizer=None, rope_parameters: dict | None = None):
    """A fresh config of ``family`` at ``size`` (head_dim 64, GQA with 2 query heads per kv head)."""
    from transformers import AutoConfig

    if family not in SUPPORTED_MODEL_TYPES:
        raise UsageError(f"--family {family!r} is not supported; choose one of {', '.join(SUPPORTED_MODEL_TYPES)}")
    if size not in _SIZES:
        raise UsageError(f"--size {size!r} is not one of {', '.join(_SIZES)}")
    kwargs = dict(_SIZES[size], vocab_size=vocab_size, max_position_embeddings=max_position_embeddings,
                  tie_word_embeddings=True)
    if tokenizer is not None:
        kwargs.update(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                      pad_token_id=tokenizer.pad_token_id)
    if rope_parameters is not None:
        kwargs["rope_parameters"] = rope_parameters
    return AutoConfig.for_model(family, **kwargs)


def check_attn(attn: str, head_dim: int | None = None) -> None:
    """Raise a one-line error if ``attn`` is unknown, unregistered, or cannot take ``head_dim``."""
    import hf_fp8_attention  # noqa: F401  (registers fp8_delta / fp8_stale with Transformers)
    from transformers import AttentionInterface

    if attn not in ATTN_CHOICES:
        raise UsageError(f"--attn {attn!r} is not one of {', '.join(ATTN_CHOICES)}")
    if attn in FP8_ATTNS:
        if attn not in AttentionInterface._global_mapping:
            raise UsageError(f"--attn {attn}: this build of hf_fp8_attention does not register {attn!r} "
                             "with Transformers (hf_fp8_attention.integration is missing)")
        if head_dim is not None and head_dim not in hf_fp8_attention.SUPPORTED_HEAD_DIMS:
            raise UsageError(f"--attn {attn}: the model's head_dim {head_dim} is not supported "
                             f"(supported: {hf_fp8_attention.SUPPORTED_HEAD_DIMS}); use --attn sdpa")
        import torch

        if torch.cuda.is_available():  # the examples train on the GPU when there is one
            from hf_fp8_attention.ops import select_backend

            try:
                select_backend(torch.device("cuda"), hf_fp8_attention.registered_fp8_config(attn))
            except RuntimeError as err:
                raise UsageError(f"--attn {attn}: {err}") from None


def head_dim_of(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def load_config(model_path: str):
    """The config of a local checkpoint directory, checked: exists, has config.json, supported family."""
    from transformers import AutoConfig

    path = Path(model_path).expanduser()
    if not path.is_dir():
        raise UsageError(f"--model {model_path}: no such directory (pass a local checkpoint directory; "
                         "models are never downloaded)")
    cfg_file = path / "config.json"
    if not cfg_file.exists():
        raise UsageError(f"--model {model_path}: no config.json in this directory")
    model_type = json.loads(cfg_file.read_text()).get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UsageError(f"--model {model_path}: model type {model_type!r} is not supported "
                         f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})")
    return AutoConfig.from_pretrained(str(path), local_files_only=True)


def build_model(config, attn: str, *, model_path: str | None = None, gguf_file: str | None = None, dtype=None,
                seed: int = 0):
    """A causal LM with ``attn_implementation=attn``: from ``config`` (fresh weights, seeded), a local
    checkpoint ``model_path``, or a GGUF file ``gguf_file`` (a plain model: :mod:`.pretrained`)."""
    import torch
    from transformers import AutoModelForCausalLM

    check_attn(attn, head_dim_of(config))
    if attn in FP8_ATTNS and getattr(config, "attention_dropout", 0.0):
        raise UsageError(f"--attn {attn}: the model has attention_dropout={config.attention_dropout}, which FP8 "
                         "attention does not implement; set it to 0.0 in config.json or use --attn sdpa")
    if gguf_file is not None:
        from .pretrained import load_gguf_model

        model = load_gguf_model(gguf_file, attn, dtype=dtype)
        model.train()
        return model
    if model_path is not None:
        return AutoModelForCausalLM.from_pretrained(model_path, config=config, attn_implementation=attn,
                                                    local_files_only=True, dtype=dtype)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attn)
    return model.to(dtype) if dtype is not None else model


def check_seq_len(config, seq_len: int, *, flag: str = "--seq-len") -> None:
    """A one-line error if the model cannot take ``seq_len`` positions."""
    if seq_len < 2:
        raise UsageError(f"{flag} {seq_len}: must be at least 2 tokens")
    limit = getattr(config, "max_position_embeddings", None)
    if limit is not None and seq_len > limit:
        raise UsageError(f"{flag} {seq_len} exceeds the model's max_position_embeddings ({limit}); "
                         "use a shorter length or extend the context (examples/context_extension.py)")


def enable_checkpointing(model) -> None:
    """Non-reentrant activation checkpointing (works with frozen inputs, e.g. LoRA), on any v5 release."""
    ckpt_kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):  # the newer name (later v5 releases)
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=ckpt_kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=ckpt_kwargs)
