"""Each recipe's error against float64 attention on real activations of a pretrained model.

Reads a fixture of captured attention inputs (``{"layers": {L: {"q", "k", "v", "do"}}}``, q/do
``(Hq, S, D)``, k/v ``(Hkv, S, D)``, causal; see ``tests/data/README.md``), rescales dO to amax 1
(quantization is scale-invariant; absolute errors are not), and prints, per layer and recipe, the
relative errors ‖x − x_ref‖ / ‖x_ref‖ of O, dQ, dK and dV over all heads at once, and the matched
zero-row-sum residual (median over rows of |Σ_j dS_ij| / Σ_j P_ij |dP_ij|).

    python benchmarks/recipe_errors.py                       # tests/data slice, CPU emulation
    python benchmarks/recipe_errors.py --fixture F --tokens 2048 --recipes fp8_delta fp8_delta_fast
    python benchmarks/recipe_errors.py --backend triton      # the kernels (CUDA)
    python benchmarks/recipe_errors.py --recipes fp8_delta --set kv_scales=head   # a variant
    python benchmarks/recipe_errors.py --backend triton --recipes fp8_delta cudnn_fp8   # beside cuDNN's FP8
    python benchmarks/recipe_errors.py --backend triton --promote-accumulation 32   # FP32-promoted MMAs

``cudnn_fp8`` (``--backend triton`` only) is cuDNN's own FP8 attention (``cudnn_fp8_sdpa.py``: one
scale per tensor, FP8 outputs on Hopper, dP's scale calibrated by one fwd+bwd first); its residual
is not observable (n/a). Where cuDNN builds no FP8 graph for the fixture's shape (on Hopper, cuDNN 9.19
builds head_dim 128 only; SmolLM2's is 64), its row says so, once, and the recipes' rows go on.

``--json PATH`` writes the numbers.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hf_fp8_attention import RECIPES, FP8AttentionConfig, fp8_attention  # noqa: E402
from hf_fp8_attention.diagnostics import row_sum_residual  # noqa: E402
from hf_fp8_attention.exact import exact_attention_grads  # noqa: E402
from hf_fp8_attention.masking import MaskSpec  # noqa: E402
from hf_fp8_attention.reference import emulated_backward, emulated_forward  # noqa: E402
import cudnn_fp8_sdpa  # noqa: E402  (beside this script; imports cudnn only when called)
from cudnn_fp8_sdpa import CudnnFp8Refused  # noqa: E402
from fp8_accumulation import add_accumulation_option, apply_accumulation_option  # noqa: E402

CUDNN_FP8 = "cudnn_fp8"

DEFAULT_FIXTURE = ROOT / "tests" / "data" / "smollm2_attention_s1024.pt"
DEFAULT_RECIPES = ("fp8_delta", "fp8_stale", "fp8_delta_fast", "fp8_stale_fast", "fp8_delta_tile", "fp8_stale_tile")
SCALE = 0.125  # SmolLM2: head_dim 64
BACKEND_DEVICE = {"emulation": "cpu", "triton": "cuda"}


def load_layers(path: Path, tokens: int) -> dict[int, tuple[torch.Tensor, ...]]:
    """``{layer: (q, k, v, do)}`` as fp32 ``(1, H, tokens, D)``, dO rescaled to amax 1."""
    data = torch.load(path)
    layers = {}
    for layer, t in data["layers"].items():
        q, k, v, do = (t[name][None, :, :tokens].float() for name in ("q", "k", "v", "do"))
        layers[int(layer)] = (q, k, v, do / do.abs().max())
    return layers


def rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    return float((x.detach().double() - ref).norm() / ref.norm())


def emulate(q, k, v, do, config: FP8AttentionConfig):
    """One causal fwd+bwd of the emulation at the fixture's scale: ``(out, (dq, dk, dv), internals)``,
    ``internals`` the backward's :class:`~hf_fp8_attention.reference.BackwardInternals` (P, dP, D, dS)."""
    mask = MaskSpec(causal=True)
    out, lse = emulated_forward(q, k, v, scale=SCALE, mask=mask, config=config)
    grads, (internals,) = emulated_backward(q, k, v, out, lse, do, scale=SCALE, mask=mask, config=config,
                                            return_internals=True)
    return out, grads, internals


def recipe_errors(q, k, v, do, config: FP8AttentionConfig, exact) -> dict[str, float]:
    """Relative errors of one recipe (emulation, or the kernels for CUDA inputs) against ``exact``
    ``(out, dq, dk, dv)``, and the emulation's median zero-row-sum residual."""
    if q.is_cuda:
        qg, kg, vg = (t.clone().requires_grad_(True) for t in (q, k, v))
        out = fp8_attention(qg, kg, vg, causal=True, scale=SCALE, config=config)
        out.backward(do)
        grads = (qg.grad, kg.grad, vg.grad)
        residual = float("nan")
    else:
        out, grads, internals = emulate(q, k, v, do, config)
        residual = float(row_sum_residual([internals]).median())
    names = ("O", "dQ", "dK", "dV")
    errors = {n: rel(x, r) for n, x, r in zip(names, (out, *grads), exact)}
    errors["residual"] = residual
    return errors


def cudnn_fp8_errors(q, k, v, do, exact) -> dict[str, float]:
    """The errors of cuDNN's own FP8 attention (CUDA inputs) against ``exact``, as :func:`recipe_errors`;
    raises :class:`CudnnFp8Refused` where cuDNN builds no graph for the shape, RuntimeError where it cannot
    run here."""
    attention = cudnn_fp8_sdpa.CudnnFp8Attention(q, k, v, True, do, scale=SCALE)
    try:
        got = attention.outputs()
    finally:
        attention.close()
    errors = {n: rel(got[key], r) for n, key, r in zip(("O", "dQ", "dK", "dV"), ("o", "dq", "dk", "dv"), exact)}
    errors["residual"] = float("nan")
    return errors


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--fixture", type=Path, default=DEFAULT_FIXTURE)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--recipes", nargs="+", default=list(DEFAULT_RECIPES),
                        help=f"recipe names, and {CUDNN_FP8} (cuDNN's FP8 attention; --backend triton only)")
    parser.add_argument("--backend", choices=("emulation", "triton"), default="emulation")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--set", nargs="+", default=[], metavar="FIELD=VALUE",
                        help="override config fields of every recipe, e.g. kv_scales=head")
    add_accumulation_option(parser)
    args = parser.parse_args(argv)
    unknown = [name for name in args.recipes if name not in RECIPES and name != CUDNN_FP8]
    if unknown:
        parser.error(f"unknown recipes {unknown}; choose from {', '.join(RECIPES)} or {CUDNN_FP8}")
    if CUDNN_FP8 in args.recipes and args.backend != "triton":
        parser.error(f"{CUDNN_FP8} runs cuDNN's kernels: it needs --backend triton (a CUDA GPU)")
    if args.promote_accumulation is not None and args.backend != "triton":
        parser.error("--promote-accumulation sets how the kernels compile: it needs --backend triton")
    accumulation = apply_accumulation_option(parser, args)
    overrides = dict(item.split("=", 1) for item in args.set)
    for key, value in overrides.items():  # booleans and integers (block_k=256) arrive as text
        if value in ("True", "False"):
            overrides[key] = value == "True"
        elif value.isdigit():
            overrides[key] = int(value)
    device = BACKEND_DEVICE[args.backend]
    results, refused = {}, None
    if overrides:
        print(f"every recipe with {overrides}")
    if accumulation:
        print(f"kernels compiled with {accumulation}")
    print(f"{'layer':>5} {'recipe':<16} {'O':>7} {'dQ':>7} {'dK':>7} {'dV':>7} {'residual':>9}")
    for layer, tensors in load_layers(args.fixture, args.tokens).items():
        exact = exact_attention_grads(*tensors[:3], tensors[3], scale=SCALE, mask=MaskSpec(causal=True))
        tensors = tuple(t.to(device) for t in tensors)
        exact = tuple(t.to(device) for t in exact)
        for name in args.recipes:
            if name == CUDNN_FP8:
                if refused is not None:  # every layer has the fixture's one shape
                    continue
                try:
                    err = cudnn_fp8_errors(*tensors, exact)
                except CudnnFp8Refused as why:
                    refused = results[CUDNN_FP8] = {"refused": str(why)}
                    print(f"{layer:>5} {name:<16} refused, every layer: {why}", flush=True)
                    continue
            else:
                config = RECIPES[name].replace(backend=args.backend, **overrides)
                err = recipe_errors(*tensors, config, exact)
            results[f"{layer}/{name}"] = err
            print(f"{layer:>5} {name:<16} " + " ".join(f"{100 * err[n]:6.2f}%" for n in ("O", "dQ", "dK", "dV"))
                  + f" {err['residual']:9.1e}", flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
