"""Soft-capping (Gemma 2) and attention sinks (GPT-OSS) through the "fp8_delta" backend, on tiny
models built from configs (no hub), CPU emulation.

The budgets and batch-layout tolerance are test_integration_models' (its module docstring
justifies them): the FP8 logits / gradient budgets against the float64 model, TIGHT for the same
FP8 computation on another batch layout. The reference is "eager" in float64: neither family
supports sdpa (Gemma 2: sdpa has no soft-cap; GPT-OSS: no sinks).

How the tiny models are made to exercise the features:
- Gemma 2: at initialisation its attention logits are ~0.03, far below any cap, so a dropped cap
  would pass unnoticed. Its q/k projections are scaled by 4 each (logits x16, with
  query_pre_attn_scalar 64) and the cap set to 1: the cap then moves the logits by ~30%, 5x the
  budget. Its FP8 logits error (4.1-4.9% over seeds 0-2) equals that of exact attention plus
  noise of the FP8 op's size (4.5-4.9%: the family amplifies attention errors, as Gemma 3 does in
  docs/design.md), and is 3.5-4.5% with the cap at 50 (no effect): the cap adds no error.
- GPT-OSS: the sinks are set to 1 (a real share of every row's mass; the initial ones are ~0):
  removing them moves the logits by 25-27%, 4x the budget. Two experts, both active for every
  token: with top-2 of 4 a perturbation of the attention output flips routing choices, and exact
  attention plus noise of the op's size already gives 9-13% logits error (8-11% for FP8); with
  every expert active there is no discrete choice and FP8 gives 2.1-2.2% (seeds 0-2). A single
  head's sink gradient is a signed sum over its rows and is not held to the budget alone (2-12%
  measured; the op-level test bounds it against its terms' size); the whole-model gradient is.
"""
from __future__ import annotations

import copy

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

from hf_fp8_attention.integration import transformers_backend
from test_integration_models import (
    FP8_GRAD_BUDGET,
    FP8_LOGITS_BUDGET,
    TIGHT,
    VOCAB,
    _padded_batch,
    logits_and_grads,
    rel,
    tokens,
)

COMMON = dict(hidden_size=128, num_attention_heads=2, num_key_value_heads=1, head_dim=64, num_hidden_layers=2,
              intermediate_size=256, vocab_size=VOCAB, pad_token_id=0, eos_token_id=1, bos_token_id=2)
FAMILIES = {
    "gemma2": dict(sliding_window=16, attn_logit_softcapping=1.0, query_pre_attn_scalar=64),
    "gpt_oss": dict(sliding_window=16, num_local_experts=2, num_experts_per_tok=2),
}
QK_SCALE = {"gemma2": 4.0, "gpt_oss": 1.0}  # the q/k projections' factor (module docstring)


def _config(family: str, **overrides):
    if family not in CONFIG_MAPPING:
        pytest.skip(f"the installed Transformers has no {family!r} model")
    return AutoConfig.for_model(family, **{**COMMON, **FAMILIES[family], **overrides})


def _from_config(config, impl: str, dtype=torch.float32):
    extra = {"experts_implementation": "eager"} if config.model_type == "gpt_oss" else {}
    return AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation=impl, dtype=dtype, **extra)


def family_model(family: str, impl: str = "fp8_delta", seed: int = 0, **overrides):
    """A 2-layer tiny model of ``family`` whose logit modifier matters (module docstring)."""
    torch.manual_seed(seed)
    model = _from_config(_config(family, **overrides), impl)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(QK_SCALE[family])
            layer.self_attn.k_proj.weight.mul_(QK_SCALE[family])
            if family == "gpt_oss":
                layer.self_attn.sinks.fill_(1.0)  # a sink that takes a real share, not the ~0 of the init
    return model


def with_impl(model, impl: str, dtype=torch.float32, **overrides):
    """``model``'s weights under ``impl`` (and config ``overrides``)."""
    config = copy.deepcopy(model.config)
    for key, value in overrides.items():
        setattr(config, key, value)
    other = _from_config(config, impl, dtype)
    other.load_state_dict(model.state_dict())
    return other.to(dtype)


def _without_feature(model, family):
    """The same weights, in float64 eager, with the family's logit modifier removed."""
    if family == "gemma2":
        return with_impl(model, "eager", torch.float64, attn_logit_softcapping=None)
    plain = with_impl(model, "eager", torch.float64)
    with torch.no_grad():
        for layer in plain.model.layers:
            layer.self_attn.sinks.fill_(float("-inf"))  # a sink no row can put mass on
    return plain


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_logits_and_gradients_close_to_eager(family, monkeypatch):
    model = family_model(family)
    x = tokens(2, 40)
    exact_logits, exact_grads = logits_and_grads(with_impl(model, "eager", torch.float64), x)
    seen = []
    real = transformers_backend.fp8_attention
    monkeypatch.setattr(transformers_backend, "fp8_attention",
                        lambda *a, **kw: seen.append((kw["softcap"], kw["sinks"])) or real(*a, **kw))
    logits, grads = logits_and_grads(model, x)
    # The seam hands the modifier over: Gemma 2's cap as a float, GPT-OSS's sinks parameter itself.
    for (softcap, sinks), layer in zip(seen, model.model.layers):
        if family == "gemma2":
            assert softcap == 1.0 and sinks is None
        else:
            assert softcap is None and sinks is layer.self_attn.sinks
    assert set(grads) == set(exact_grads), "every parameter (the sinks too) must receive a gradient"
    names = sorted(exact_grads)
    flat = torch.cat([grads[n].flatten() for n in names])
    flat_exact = torch.cat([exact_grads[n].flatten() for n in names])
    assert rel(logits, exact_logits) < FP8_LOGITS_BUDGET
    assert rel(flat, flat_exact) < FP8_GRAD_BUDGET
    # The modifier matters at this size: without it the model is far outside the budget.
    plain_logits, _ = logits_and_grads(_without_feature(model, family), x)
    assert rel(plain_logits, exact_logits) > 3 * FP8_LOGITS_BUDGET


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_padded_batch_equals_unpadded_runs(family, monkeypatch):
    """Left padding (the varlen path): each attention call of the padded batch gives every row the
    output and the gradients (q, k, v and the sinks') of that row's tokens run alone through the
    same call, within TIGHT: the same FP8 computation on the same inputs. (Compared at the model's
    logits instead, a row's inputs to the second layer differ by fp32 rounding between the two
    batch layouts, the projections running on other shapes, and a code sitting on a rounding
    boundary may flip: with the default recipe one P code of one query of Gemma 2 moved its logits
    by 4e-4.)"""
    model = family_model(family)
    lengths = [40, 29, 21]
    ids, mask, rows = _padded_batch(lengths, 40, "left")
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
    calls = []
    real = transformers_backend.fp8_attention_forward

    def spy(module, query, key, value, attention_mask, *args, **kwargs):
        calls.append((module, query.detach(), key.detach(), value.detach(), attention_mask, args, kwargs))
        return real(module, query, key, value, attention_mask, *args, **kwargs)

    monkeypatch.setattr(transformers_backend, "fp8_attention_forward", spy)
    logits = model(ids, attention_mask=mask, position_ids=position_ids).logits
    assert torch.isfinite(logits).all()
    assert len(calls) == len(model.model.layers)
    gen = torch.Generator().manual_seed(0)
    for module, query, key, value, attention_mask, args, kwargs in calls:
        sinks = kwargs.get("s_aux")
        q, k, v = (t.clone().requires_grad_(True) for t in (query, key, value))
        leaves = (q, k, v) + ((sinks,) if sinks is not None else ())
        out = real(module, q, k, v, attention_mask, *args, **kwargs)[0]
        dout = torch.randn(out.shape, generator=gen)
        padded = (out, *torch.autograd.grad(out, leaves, dout))
        sinks_grad = torch.zeros_like(sinks) if sinks is not None else None
        for r, n in enumerate(lengths):
            valid = slice(40 - n, 40)
            alone = [t[r:r + 1, :, valid].clone().requires_grad_(True) for t in (query, key, value)]
            one = real(module, *alone, None, *args, **{**kwargs, "position_ids": position_ids[r:r + 1, valid]})[0]
            grads = torch.autograd.grad(one, (*alone, *leaves[3:]), dout[r:r + 1, valid])
            assert rel(padded[0][r:r + 1, valid], one) < TIGHT
            for name, g, ref in zip(("dq", "dk", "dv"), padded[1:4], grads[:3]):
                assert rel(g[r:r + 1, :, valid], ref) < TIGHT, name
            if sinks is not None:
                sinks_grad += grads[3]
        if sinks is not None:
            assert rel(padded[4], sinks_grad) < TIGHT, "dsinks"


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_left_padded_generate_equals_single_prompts(family):
    """KV-cache decoding (q_len 1 against the cache, through the varlen path with padding)."""
    model = family_model(family)
    model.eval()
    ids, mask, rows = _padded_batch([12, 7, 9], 12, "left", seed=30)
    kwargs = dict(max_new_tokens=8, do_sample=False, eos_token_id=None, output_logits=True,
                  return_dict_in_generate=True)
    batch = model.generate(ids, attention_mask=mask, **kwargs)
    for r, row in enumerate(rows):
        single = model.generate(row[None], **kwargs)
        assert torch.equal(batch.sequences[r, 12:], single.sequences[0, len(row):])
        assert rel(torch.stack(batch.logits, 1)[r], torch.stack(single.logits, 1)[0]) < TIGHT


def test_gemma3_soft_cap_reaches_the_op_if_its_attention_passes_it(monkeypatch):
    """Gemma 3's config has attn_logit_softcapping; run the model only where its attention passes
    the cap on (Transformers 5.24's does not: the field is unused there), with head_dim 64."""
    config = _config_gemma3()
    seen = []
    real = transformers_backend.fp8_attention
    monkeypatch.setattr(transformers_backend, "fp8_attention",
                        lambda *a, **kw: seen.append(kw["softcap"]) or real(*a, **kw))
    torch.manual_seed(0)
    model = _from_config(config, "fp8_delta")
    x = tokens(1, 24)
    with torch.no_grad():
        logits = model(x).logits
    if all(softcap is None for softcap in seen):
        pytest.skip("this Transformers' Gemma 3 attention does not pass attn_logit_softcapping to the backend")
    assert all(softcap == 1.0 for softcap in seen)
    with torch.no_grad():
        exact = with_impl(model, "eager", torch.float64)(x).logits
    assert rel(logits, exact) < FP8_LOGITS_BUDGET


def _config_gemma3():
    if "gemma3_text" not in CONFIG_MAPPING:
        pytest.skip("the installed Transformers has no 'gemma3_text' model")
    return AutoConfig.for_model("gemma3_text", **COMMON, sliding_window=16, attn_logit_softcapping=1.0)
