"""The zero-row-sum residual of an FP8 recipe's backward, measured on a model's real attention.

One batch goes through the model with a thin wrapper around SDPA (registered as an extra
``attn_implementation``) that records each layer's post-RoPE q, k, v and, through a tensor hook,
the real upstream gradient dO of the attention output. ``hf_fp8_attention.diagnostics.diagnose``
then replays the recipe's backward on exactly those tensors and reports, per query row,
|Σ_j dS_ij| / Σ_j P_ij |dP_ij| — 0 for an exact softmax gradient, ~1e-8 (fp32 rounding) for the
delta-matched backward, and the size of the stale-delta error otherwise.
"""
from __future__ import annotations

import contextlib

import torch

_CAPTURE = "hf_fp8_capture_sdpa"
_records: dict[int, dict] = {}


def _capture_attention(module, query, key, value, attention_mask, **kwargs):
    """SDPA, plus a record of q/k/v ``(B, H, S, D)`` and of dO (filled in during backward)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    out, weights = sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    rec = {"q": query.detach(), "k": key.detach(), "v": value.detach(), "scale": kwargs.get("scaling"),
           "window": kwargs.get("sliding_window")}
    if out.requires_grad:
        # out is (B, S, H, D); its gradient is dO in the same layout.
        out.register_hook(lambda g: rec.__setitem__("dout", g.detach().transpose(1, 2)))
    _records[len(_records)] = rec
    return out, weights


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    if _CAPTURE not in AttentionInterface._global_mapping:
        AttentionInterface.register(_CAPTURE, _capture_attention)
        ALL_MASK_ATTENTION_FUNCTIONS.register(_CAPTURE, sdpa_mask)


@contextlib.contextmanager
def _capturing(model):
    _register()
    previous = model.config._attn_implementation
    model.set_attn_implementation(_CAPTURE)
    _records.clear()
    try:
        yield _records
    finally:
        model.set_attn_implementation(previous)


def row_sum_residuals(model, input_ids: torch.Tensor, recipe: str, *, max_layers: int | None = None) -> dict:
    """Replay ``recipe``'s backward on the attention inputs/gradients of one batch of ``model``.

    Args:
        model: a causal LM using AttentionInterface (any attn_implementation; restored afterwards).
        input_ids: ``(B, S)`` int64 without padding (every row a full causal sequence).
        recipe: a name in ``hf_fp8_attention.RECIPES`` (e.g. ``"fp8_delta"``, ``"fp8_stale"``).
        max_layers: diagnose only the first ``max_layers`` layers (cost control at large sizes).
    Returns:
        ``{"median": float, "per_layer_median": [float], "per_layer_key_shift": [float],
        "rel_err": {name: float}}`` where ``median`` is over all query rows of all diagnosed layers,
        ``per_layer_key_shift`` is each layer's key-shift residual ‖Σ_j dK_j‖ / ‖Σ_j |dK_j|‖, and
        ``rel_err`` averages the recipe's out/dq/dk/dv relative errors vs fp64 attention over the layers.
    """
    from hf_fp8_attention import RECIPES
    from hf_fp8_attention.diagnostics import diagnose

    config = RECIPES[recipe]
    was_training = model.training
    model.eval()  # no dropout: the captured tensors are what the attention saw
    with _capturing(model) as records:
        out = model(input_ids=input_ids, labels=input_ids)
        out.loss.backward()
    model.zero_grad(set_to_none=True)
    model.train(was_training)
    layers = [records[i] for i in sorted(records)][:max_layers]
    all_rows, per_layer, key_shift, rel = [], [], [], {}
    for rec in layers:
        if "dout" not in rec:
            raise RuntimeError("attention output received no gradient; cannot measure the residual")
        report = diagnose(rec["q"], rec["k"], rec["v"], rec["dout"].to(rec["q"].dtype), config=config,
                          causal=True, scale=rec["scale"], window=rec["window"])
        rows = report.row_sum_residual.detach().double().cpu()
        all_rows.append(rows)
        per_layer.append(float(report.median_row_sum_residual))
        key_shift.append(float(report.key_shift_residual))
        for key, value in report.rel_err.items():
            rel[key] = rel.get(key, 0.0) + float(value) / len(layers)
    rows = torch.cat(all_rows)
    return {"median": float(rows.median()), "per_layer_median": per_layer, "per_layer_key_shift": key_shift,
            "rel_err": rel, "rows": rows}
