"""Each decoder family's FP8 error: logits and whole-model gradient of a tiny model (2 layers) with
each recipe against the same weights under float64 ``sdpa``, on the CPU (emulation).

    python benchmarks/family_errors.py [--recipes fp8_delta fp8_delta_fast] [--json PATH]

Families are built from their configs (``AutoConfig.for_model``, no download; an entry of
``FAMILIES`` may name its ``model_type``) at hidden 128, 2 query heads / 1 kv head, head_dim 64
(Phi: 80). A family the installed Transformers lacks, or that
the package rejects, is listed with the reason. Relative errors ‖x − x_ref‖ / ‖x_ref‖; gradients
over all parameters at once; median and max over ``--seeds`` initialisations.

``noise``: the logits error when every attention call returns exact attention plus Gaussian noise
of the relative size fp8_delta's output error has in that call; ``op``: that size (the attention
op's own output error, median over calls, layers and seeds). Where it matches fp8_delta's own
logits error, the family amplifies any attention error of that size: its FP8 error is not a
matter of the recipe.
"""
from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from hf_fp8_attention import register_fp8_attention  # noqa: E402
from hf_fp8_attention.exact import exact_attention  # noqa: E402
from hf_fp8_attention.integration import transformers_backend  # noqa: E402
from hf_fp8_attention.masking import MaskSpec  # noqa: E402
from recipe_errors import rel  # noqa: E402

VOCAB = 128
COMMON = dict(hidden_size=128, num_attention_heads=2, num_key_value_heads=1, head_dim=64, num_hidden_layers=2,
              intermediate_size=256, vocab_size=VOCAB, pad_token_id=0, bos_token_id=2, eos_token_id=1)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, num_local_experts=4)
MOE_FAMILIES = ("qwen2_moe", "qwen3_moe", "mixtral")
FAMILIES = {
    "llama": {}, "mistral": {"sliding_window": 16}, "qwen2": {}, "qwen3": {}, "qwen2_moe": MOE, "qwen3_moe": MOE,
    "mixtral": MOE, "phi3": {}, "phi": {"head_dim": None, "hidden_size": 160}, "olmo2": {}, "olmo3": {},
    "granite": {}, "smollm3": {}, "cohere2": {"sliding_window": 16}, "exaone4": {"sliding_window": 16},
    "gemma3_text": {"sliding_window": 16},
}


def build(family: str, impl: str, seed: int):
    from transformers import AutoConfig, AutoModelForCausalLM

    kwargs = {**COMMON, **FAMILIES[family]}
    kwargs = {k: v for k, v in kwargs.items() if v is not None}
    config = AutoConfig.for_model(kwargs.pop("model_type", family), **kwargs)
    torch.manual_seed(seed)
    # Eager experts for the MoE families: the grouped-mm kernels have no float64 reference.
    extra = {"experts_implementation": "eager"} if family in MOE_FAMILIES else {}
    return AutoModelForCausalLM.from_config(config, attn_implementation=impl, dtype=torch.float32, **extra)


def run(model, x):
    model.zero_grad()
    out = model(x, labels=x)
    out.loss.backward()
    grads = torch.cat([p.grad.detach().double().flatten() for p in model.parameters() if p.grad is not None])
    return out.logits.detach().double(), grads


def exact_attention_like(q, k, v, out, **call):
    """Exact attention (float64) on the op's inputs ``(B, H, S, D)`` (the seam's dense causal calls,
    with its window, soft-cap and sinks), plus Gaussian noise of the relative size ``out`` differs from it by, in
    ``out``'s dtype; and that size."""
    mask = MaskSpec(causal=True, window=call.get("window"))
    exact = exact_attention(q, k, v, scale=call.get("scale"), mask=mask, softcap=call.get("softcap"),
                            sinks=call.get("sinks"))
    diff = (out.double() - exact).norm()
    noise = torch.randn(exact.shape, generator=torch.Generator().manual_seed(q.shape[2]), dtype=torch.float64)
    return (exact + noise * (diff / noise.norm())).to(out.dtype), float(diff / exact.norm())


def noise_logits_error(family: str, seed: int, x) -> tuple[float, list[float]]:
    """The ``noise`` column (module docstring) for one seed, and fp8_delta's output error in each
    attention call (the ``op`` column)."""
    op = transformers_backend.fp8_attention
    op_errors = []

    def noisy(q, k, v, **call):
        out = op(q, k, v, **call)
        if call.get("cu_seqlens_q") is not None or not call.get("causal", True):
            raise ValueError("the noise probe handles dense causal calls only")
        with torch.no_grad():
            noisy_out, err = exact_attention_like(q, k, v, out, **call)
        op_errors.append(err)
        return noisy_out

    base = build(family, "sdpa", seed)
    with torch.no_grad():
        ref = copy.deepcopy(base).double()(x).logits
    model = build(family, "fp8_delta", seed)
    model.load_state_dict(base.state_dict())
    transformers_backend.fp8_attention = noisy
    try:
        with torch.no_grad():
            logits = model(x).logits.double()
    finally:
        transformers_backend.fp8_attention = op
    return rel(logits, ref), op_errors


def family_errors(family: str, recipes, seeds) -> dict:
    x = torch.randint(3, VOCAB, (2, 64), generator=torch.Generator().manual_seed(1))
    per = {r: {"logits": [], "grads": []} for r in recipes}
    for seed in seeds:
        base = build(family, "sdpa", seed)
        ref = copy.deepcopy(base).double()
        ref_logits, ref_grads = run(ref, x)
        for r in recipes:
            model = build(family, r, seed)
            model.load_state_dict(base.state_dict())
            logits, grads = run(model, x)
            per[r]["logits"].append(rel(logits, ref_logits))
            per[r]["grads"].append(rel(grads, ref_grads))
    result = {r: {k: (statistics.median(v), max(v)) for k, v in d.items()} for r, d in per.items()}
    probes = [noise_logits_error(family, seed, x) for seed in seeds]
    noise = [p[0] for p in probes]
    op = [e for p in probes for e in p[1]]
    result["noise"] = {"logits": (statistics.median(noise), max(noise)), "op": (statistics.median(op), max(op))}
    return result


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--recipes", nargs="+", default=["fp8_delta", "fp8_delta_fast", "fp8_delta_tile", "fp8_stale"])
    p.add_argument("--families", nargs="+", default=list(FAMILIES))
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--json", type=Path)
    a = p.parse_args(argv)
    for r in a.recipes:  # fp8_delta / fp8_stale are registered on import; the others by name here
        register_fp8_attention(r, r)
    results = {}
    print("logits / gradient relative error vs float64 sdpa, median (max) over seeds")
    print(f"{'family':<12} " + " ".join(f"{r:>26}" for r in a.recipes) + f" {'noise (logits)':>15} {'op':>7}")
    for family in a.families:
        try:
            res = family_errors(family, a.recipes, range(a.seeds))
        except Exception as e:  # a family this Transformers lacks or the package rejects: say why
            results[family] = {"error": f"{type(e).__name__}: {e}"[:200]}
            print(f"{family:<12} not run: {results[family]['error']}", flush=True)
            continue
        results[family] = res
        cells = [f"{100 * res[r]['logits'][0]:5.2f}% / {100 * res[r]['grads'][0]:5.2f}% ({100 * res[r]['grads'][1]:5.2f}%)"
                 for r in a.recipes]
        print(f"{family:<12} " + " ".join(f"{c:>26}" for c in cells)
              + f" {100 * res['noise']['logits'][0]:14.2f}% {100 * res['noise']['op'][0]:6.2f}%", flush=True)
    if a.json:
        a.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
