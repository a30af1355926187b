"""The Transformers backends "fp8_delta" / "fp8_stale" on tiny models built from configs (no hub).

Two kinds of comparison, with the tolerances stated once below:

- Against "sdpa" run in float64 (the exact model): the FP8 error budget. E4M3 keeps 3 mantissa
  bits, so one rounding has relative error at most 2^-4; the emulation's attention output is ~4%
  off exact on random inputs (one rounding of each operand, averaged). The attention output is one
  residual branch among several, so the logits of a model inherit at most that level: budget 2^-4
  for the relative (Frobenius) logits error. Gradients pass through two FP8 stages in series (the
  forward's operands and the backward's dO/dS operands), so 2 × 2^-4 = 2^-3 for the relative error
  of the parameter gradients. Measured with these seeds (fp8_delta): logits 2.3–3.4%, all-gradient
  2.7–5.5%, worst single tensor 6–9%. A wrong mask is far outside: removing Mistral's window moves
  the logits by ~40%.
- Same FP8 computation on differently laid-out batches (padded vs unpadded, packed vs separate,
  cached decode vs full recompute): the quantization tiles restart at every sequence start, so
  these agree up to fp32 summation order in the surrounding model (~1e-7), which can at most flip
  the FP8 rounding of an operand sitting on a rounding boundary. TIGHT = 1e-4 relative is 1000×
  below the FP8 budget yet far above fp32 noise: any leak between sequences or lost padding fails it.
"""
from __future__ import annotations

import copy
import logging

import pytest
import torch
from transformers import (
    AttentionInterface,
    AutoConfig,
    AutoModelForCausalLM,
    DataCollatorWithFlattening,
    LlamaConfig,
    MistralConfig,
    PhiConfig,
    Qwen2Config,
    Qwen3Config,
)
from transformers.masking_utils import create_causal_mask
from transformers.testing_utils import CaptureLogger
from transformers.utils import logging as hf_logging

import hf_fp8_attention
from hf_fp8_attention import FP8AttentionConfig, register_fp8_attention, registered_fp8_config
from hf_fp8_attention.integration import transformers_backend

FP8_LOGITS_BUDGET = 2**-4  # relative logits error vs the float64 sdpa model (see module docstring)
FP8_GRAD_BUDGET = 2**-3  # relative parameter-gradient error vs the float64 sdpa model
TIGHT = 1e-4  # same FP8 computation, different batch layout (see module docstring)

VOCAB = 128
_COMMON = dict(
    hidden_size=128,
    num_attention_heads=2,
    num_key_value_heads=1,  # GQA: 2 query heads share 1 kv head
    head_dim=64,
    num_hidden_layers=2,
    intermediate_size=256,
    vocab_size=VOCAB,
    pad_token_id=0,
    eos_token_id=1,
    bos_token_id=2,
)
CONFIGS = {
    "llama": lambda: LlamaConfig(**_COMMON),
    "qwen2": lambda: Qwen2Config(**_COMMON),  # q/k/v projections with bias
    "qwen3": lambda: Qwen3Config(**_COMMON),  # q/k RMSNorm
    "mistral": lambda: MistralConfig(**_COMMON, sliding_window=16),  # window shorter than the sequences
}


def tiny_model(family: str = "llama", impl: str = "fp8_delta", seed: int = 0, dtype=torch.float32, **overrides):
    """A 2-layer, head_dim-64 causal LM of ``family``, initialised from ``seed``."""
    config = CONFIGS[family]()
    for key, value in overrides.items():
        setattr(config, key, value)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, attn_implementation=impl, dtype=dtype)


def same_weights(model, impl: str, dtype=torch.float32):
    """A copy of ``model`` running ``impl`` (the config is copied: from_config mutates it)."""
    other = AutoModelForCausalLM.from_config(copy.deepcopy(model.config), attn_implementation=impl, dtype=dtype)
    other.load_state_dict(model.state_dict())
    return other.to(dtype)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def tokens(*shape, seed=1):
    return torch.randint(3, VOCAB, shape, generator=torch.Generator().manual_seed(seed))


def logits_and_grads(model, input_ids, **kwargs):
    model.zero_grad()
    out = model(input_ids, labels=input_ids, **kwargs)
    out.loss.backward()
    grads = {n: p.grad.detach().double().clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.logits.detach(), grads


# ---------------------------------------------------------------------------------------------
# Numerics against sdpa
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_logits_and_gradients_close_to_sdpa(family):
    model = tiny_model(family, "sdpa")
    x = tokens(2, 40)
    exact_logits, exact_grads = logits_and_grads(same_weights(model, "sdpa", torch.float64), x)
    names = sorted(exact_grads)
    results = {}
    for impl in ("fp8_delta", "fp8_stale"):
        logits, grads = logits_and_grads(same_weights(model, impl), x)
        assert set(grads) == set(exact_grads), "every parameter must receive a gradient"
        flat = torch.cat([grads[n].flatten() for n in names])
        flat_exact = torch.cat([exact_grads[n].flatten() for n in names])
        assert rel(logits, exact_logits) < FP8_LOGITS_BUDGET
        assert rel(flat, flat_exact) < FP8_GRAD_BUDGET
        results[impl] = (logits, grads)
    # The product: every single gradient tensor within budget (the stale delta is the ablation, its
    # systematic error may exceed it on individual tensors, which is the point of the comparison).
    worst = max(rel(results["fp8_delta"][1][n], exact_grads[n]) for n in names)
    assert worst < FP8_GRAD_BUDGET
    # Same forward recipe: identical logits; different delta: the backward differs.
    assert torch.equal(results["fp8_delta"][0], results["fp8_stale"][0])
    assert any(not torch.equal(results["fp8_delta"][1][n], results["fp8_stale"][1][n]) for n in names)


def test_bf16_model_close_to_sdpa():
    """bf16 weights and activations (the usual training dtype): the FP8 error adds to bf16's own."""
    model = tiny_model("llama", "sdpa")
    x = tokens(2, 40)
    exact_logits, exact_grads = logits_and_grads(same_weights(model, "sdpa", torch.float64), x)
    bf16_logits, _ = logits_and_grads(same_weights(model, "sdpa", torch.bfloat16), x)
    fp8_logits, fp8_grads = logits_and_grads(same_weights(model, "fp8_delta", torch.bfloat16), x)
    assert fp8_logits.dtype == torch.bfloat16 and torch.isfinite(fp8_logits).all()
    assert rel(fp8_logits, exact_logits) < FP8_LOGITS_BUDGET + rel(bf16_logits, exact_logits)
    assert all(torch.isfinite(g).all() for g in fp8_grads.values())


def test_fp32_model_under_bf16_autocast_trains():
    """Mixed precision as Trainer/Accelerate run it (fp32 weights, bf16 autocast): RoPE leaves q/k
    in fp32 and v in bf16; the backend must take them like sdpa does, forward and backward."""
    model = tiny_model("llama", "fp8_delta")
    x = tokens(2, 40)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(x, labels=x).loss
    loss.backward()
    assert torch.isfinite(loss)
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters() if p.requires_grad)


def test_import_registers_attention_and_mask_functions():
    """Both registries: a name without a mask function would get attention_mask=None (padding lost)."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    for name in ("fp8_delta", "fp8_stale"):
        assert name in AttentionInterface()
        assert ALL_MASK_ATTENTION_FUNCTIONS[name] is transformers_backend.fp8_padding_mask
        assert registered_fp8_config(name) == hf_fp8_attention.RECIPES[name]


def test_mistral_window_is_applied():
    """The window reaches the kernel: FP8 is close to windowed sdpa, far from sdpa without window."""
    model = tiny_model("mistral", "fp8_delta")
    x = tokens(1, 40)
    with torch.no_grad():
        fp8 = model(x).logits
        windowed = same_weights(model, "sdpa", torch.float64)(x).logits
        no_window = same_weights(model, "sdpa", torch.float64)
        no_window.config.sliding_window = None
        for layer in no_window.model.layers:
            layer.self_attn.sliding_window = None
        unwindowed = no_window(x).logits
    assert rel(fp8, windowed) < FP8_LOGITS_BUDGET
    assert rel(unwindowed, windowed) > 4 * FP8_LOGITS_BUDGET


# ---------------------------------------------------------------------------------------------
# Padding, packing, GQA
# ---------------------------------------------------------------------------------------------


def _padded_batch(lengths, total, side, seed=3):
    ids = torch.zeros(len(lengths), total, dtype=torch.long)
    mask = torch.zeros(len(lengths), total, dtype=torch.long)
    rows = []
    for r, n in enumerate(lengths):
        row = tokens(n, seed=seed + r)
        rows.append(row)
        sl = slice(0, n) if side == "right" else slice(total - n, total)
        ids[r, sl], mask[r, sl] = row, 1
    return ids, mask, rows


@pytest.mark.parametrize("family", ["llama", "mistral"])
@pytest.mark.parametrize("side", ["right", "left"])
def test_padded_batch_equals_unpadded_runs(family, side):
    model = tiny_model(family)
    lengths = [40, 29, 21]
    ids, mask, rows = _padded_batch(lengths, 40, side)
    # Positions as in the separate runs (what generate() passes for left padding): RoPE is relative,
    # so shifted positions change the exact result only by rounding, but FP8 rounds the rotated q/k.
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
    n_targets = sum(n - 1 for n in lengths)

    def loss_of(logits, row):  # next-token loss of one sequence's valid logits, summed over the batch mean
        return torch.nn.functional.cross_entropy(logits[:-1], row[1:], reduction="sum") / n_targets

    model.zero_grad()
    logits = model(ids, attention_mask=mask, position_ids=position_ids).logits
    sum(loss_of(logits[r, mask[r].bool()], row) for r, row in enumerate(rows)).backward()
    padded_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    for r, row in enumerate(rows):
        single = model(row[None]).logits[0]
        loss_of(single, row).backward()  # gradients accumulate over the separate runs
        assert rel(logits[r, mask[r].bool()], single) < TIGHT
    for n, p in model.named_parameters():
        assert rel(padded_grads[n], p.grad) < TIGHT, n
    assert torch.isfinite(logits).all()
    assert torch.isfinite(padded_grads["model.embed_tokens.weight"]).all()


def test_mask_plan_and_length_checks_once_per_forward(monkeypatch):
    # Planning the varlen batch and checking its cu_seqlens read the device (syncs): every layer of
    # a forward gets the same mask and position tensors, so both run once per forward.
    from hf_fp8_attention import functional

    plans, checks = [], []
    real_plan, real_read = transformers_backend._mask_plan, functional._read_cu_seqlens
    monkeypatch.setattr(transformers_backend, "_mask_plan", lambda *a: plans.append(1) or real_plan(*a))
    monkeypatch.setattr(functional, "_read_cu_seqlens", lambda *a: checks.append(1) or real_read(*a))
    model = tiny_model("llama", num_hidden_layers=3)
    ids, mask, _ = _padded_batch([40, 29, 21], 40, "right")
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
    model(ids, attention_mask=mask, position_ids=position_ids).logits.sum().backward()
    assert (len(plans), len(checks)) == (1, 1)
    model(ids, attention_mask=mask.clone(), position_ids=position_ids)  # a new mask: planned again
    assert (len(plans), len(checks)) == (2, 2)


def test_padded_batch_under_inference_mode():
    # Inference tensors have no version counter: the mask plan is not cached for them, and the
    # result equals the no_grad one.
    model = tiny_model("llama")
    ids, mask, _ = _padded_batch([40, 29, 21], 40, "left")
    with torch.no_grad():
        want = model(ids, attention_mask=mask).logits
    with torch.inference_mode():
        got = model(ids, attention_mask=mask).logits
    assert torch.equal(got, want)


def test_fully_masked_rows_have_no_nan():
    model = tiny_model("mistral")
    ids, mask, _ = _padded_batch([40, 0, 7], 40, "left")
    labels = ids.masked_fill(mask == 0, -100)
    out = model(ids, attention_mask=mask, labels=labels)
    out.loss.backward()
    assert torch.isfinite(out.logits).all()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    # A batch that is padding only: still finite (attention outputs zeros there).
    with torch.no_grad():
        assert torch.isfinite(model(ids, attention_mask=torch.zeros_like(mask)).logits).all()


@pytest.mark.parametrize("flash_kwargs", [False, True])
@pytest.mark.parametrize("use_cache", [False, True])
def test_packed_sequences_equal_separate_runs(flash_kwargs, use_cache):
    """DataCollatorWithFlattening batches: position_ids restart, or cu_seq_lens_q/k kwargs arrive.

    With sdpa, use_cache=True makes packed sequences leak into each other; here they never do.
    """
    model = tiny_model("mistral")
    seqs = [tokens(n, seed=10 + n) for n in (23, 17, 30)]
    collator = DataCollatorWithFlattening(return_flash_attn_kwargs=flash_kwargs)
    batch = collator([{"input_ids": s.tolist()} for s in seqs])
    extra = {}
    if flash_kwargs:
        extra = {k: batch[k] for k in ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")}
    with torch.no_grad():
        packed = model(batch["input_ids"], position_ids=batch["position_ids"], use_cache=use_cache, **extra).logits
        start = 0
        for s in seqs:
            single = model(s[None]).logits
            assert rel(packed[0, start : start + len(s)], single[0]) < TIGHT
            start += len(s)


@pytest.mark.parametrize("padded", [False, True])
def test_packed_rows_in_a_larger_batch(padded):
    """Packing detected per row from position_ids (batch > 1), also together with padding.

    (sdpa ignores position_ids once a padding mask is given and lets such sequences see each other.)
    """
    model = tiny_model("llama")
    a, b, c, d = (tokens(n, seed=20 + n) for n in (10, 14, 16, 8))
    ids = torch.stack([torch.cat([a, b]), torch.cat([c, d])])
    pos = torch.stack([torch.cat([torch.arange(10), torch.arange(14)]), torch.cat([torch.arange(16), torch.arange(8)])])
    pieces = [(0, 0, a), (0, 10, b), (1, 0, c), (1, 16, d)]
    mask = None
    if padded:  # row 1 holds c and 8 padding tokens instead of d
        mask = torch.ones_like(ids)
        mask[1, 16:] = 0
        ids[1, 16:], pos[1, 16:] = 0, 0
        pieces = pieces[:3]
    with torch.no_grad():
        packed = model(ids, position_ids=pos, attention_mask=mask).logits
        for row, start, s in pieces:
            assert rel(packed[row, start : start + len(s)], model(s[None]).logits[0]) < TIGHT


def test_gqa_kv_heads_are_not_repeated(monkeypatch):
    seen = []
    real = transformers_backend.fp8_attention

    def spy(q, k, v, **kwargs):
        seen.append((q.shape[1], k.shape[1], v.shape[1], kwargs["config"]))
        return real(q, k, v, **kwargs)

    monkeypatch.setattr(transformers_backend, "fp8_attention", spy)
    model = tiny_model("llama")
    ids, mask, _ = _padded_batch([20, 12], 20, "right")
    with torch.no_grad():
        model(ids[:1])  # dense path
        model(ids, attention_mask=mask)  # varlen path
    assert len(seen) == 4  # 2 layers x 2 calls
    assert all(hq == 2 and hk == hv == 1 for hq, hk, hv, _ in seen)
    assert all(cfg == hf_fp8_attention.RECIPES["fp8_delta"] for *_, cfg in seen)


# ---------------------------------------------------------------------------------------------
# Generation with the KV cache
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", ["llama", "mistral"])
def test_cached_decode_equals_recompute(family):
    """Decode runs the FP8 forward with q_len=1 against the cached keys, diagonal aligned to the end.

    Each step is compared with a cache-free forward of the sequence so far. One layer, because the
    recipe scales V per channel over each key tile, masked future keys included: in a deeper model
    the cached keys/values of layer >= 2 were computed before the later tokens existed, while a
    recompute's were not, and they differ at the FP8 level (~1% in logits). (A causality leak of
    the block-scaled V through its scale, reported to the lead; 2-layer decoding is checked against
    sdpa in test_greedy_tokens_match_sdpa_where_fp8_cannot_flip_them.) With one layer the keys and
    tiles are identical, so the comparison is TIGHT. Mistral's 12 + 14 tokens exceed its window of
    16: the sliding-window cache is exercised (compared with a recompute over the last 16 tokens).
    """
    model = tiny_model(family, num_hidden_layers=1)
    prompt = tokens(1, 12)
    out = model.generate(
        prompt, max_new_tokens=14, do_sample=False, output_logits=True, return_dict_in_generate=True, eos_token_id=None
    )
    # Keys a decode step attends over: all so far, or with a sliding window the last `window` (the
    # sliding cache keeps no more; older keys would only enter the recompute's V-tile scales).
    keep = getattr(model.config, "sliding_window", None) or 10**9
    with torch.no_grad():
        for step, step_logits in enumerate(out.logits):
            end = prompt.shape[1] + step
            start = max(0, end - keep)
            recomputed = model(
                out.sequences[:, start:end], position_ids=torch.arange(start, end)[None], use_cache=False
            ).logits[:, -1]
            assert rel(step_logits, recomputed) < TIGHT, step


def test_left_padded_generate_equals_single_prompts():
    model = tiny_model("mistral")
    ids, mask, rows = _padded_batch([12, 7, 9], 12, "left", seed=30)
    kwargs = dict(max_new_tokens=10, do_sample=False, eos_token_id=None, output_logits=True, return_dict_in_generate=True)
    batch = model.generate(ids, attention_mask=mask, **kwargs)
    for r, row in enumerate(rows):
        single = model.generate(row[None], **kwargs)
        assert torch.equal(batch.sequences[r, 12:], single.sequences[0, len(row) :])
        assert rel(torch.stack(batch.logits, 1)[r], torch.stack(single.logits, 1)[0]) < TIGHT


def _trained_on_a_cycle(steps=40):
    """A tiny Llama trained (sdpa, ~1 s) to continue a period-11 token cycle with a repeated token,
    so its next-token choices have large margins and depend on context (attention)."""
    model = tiny_model("llama", "sdpa")
    g = torch.Generator().manual_seed(5)
    cycle = torch.randint(3, VOCAB, (11,), generator=g)
    cycle[3] = cycle[7] = cycle[0]  # the token after cycle[0] depends on what came before it
    stream = cycle.repeat(6)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(steps):
        batch = torch.stack([stream[o : o + 24] for o in torch.randint(0, 11, (4,), generator=g)])
        loss = model(batch, labels=batch).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model, stream


def test_greedy_tokens_match_sdpa_where_fp8_cannot_flip_them():
    sdpa_model, stream = _trained_on_a_cycle()
    fp8_model = same_weights(sdpa_model, "fp8_delta")
    prompt = torch.stack([stream[0:10], stream[4:14]])
    kwargs = dict(max_new_tokens=12, do_sample=False, eos_token_id=None)
    ref = sdpa_model.generate(prompt, **kwargs)
    with torch.no_grad():
        sdpa_logits = sdpa_model(ref, use_cache=False).logits[:, 9:-1]
        fp8_logits = fp8_model(ref, use_cache=False).logits[:, 9:-1]
    top2 = sdpa_logits.topk(2, dim=-1).values
    margin = (top2[..., 0] - top2[..., 1]).min()
    # Precondition (fixed seeds): the FP8 deviation is below half the smallest top-1 margin along
    # sdpa's trajectory, so no greedy choice can flip (measured: margin ~3.7, deviation ~0.05).
    assert (fp8_logits - sdpa_logits).abs().max() < margin / 2
    assert torch.equal(fp8_model.generate(prompt, **kwargs), ref)


# ---------------------------------------------------------------------------------------------
# Selecting the backend and its recipe
# ---------------------------------------------------------------------------------------------


def test_set_attn_implementation_switches_to_fp8():
    model = tiny_model("qwen3", "sdpa")
    x = tokens(1, 24)
    with torch.no_grad():
        before = model(x).logits
        model.set_attn_implementation("fp8_delta")
        assert model.config._attn_implementation == "fp8_delta"
        after = model(x).logits
        fp8_built = same_weights(model, "fp8_delta")(x).logits
    assert torch.equal(after, fp8_built)
    assert not torch.equal(after, before)


def test_register_custom_recipe(monkeypatch):
    config = FP8AttentionConfig(pow2_scales=True, block_k=64)
    assert register_fp8_attention("fp8_test_pow2", config) == "fp8_test_pow2"
    assert registered_fp8_config("fp8_test_pow2") == config
    seen = []
    real = transformers_backend.fp8_attention
    monkeypatch.setattr(transformers_backend, "fp8_attention", lambda *a, **k: seen.append(k["config"]) or real(*a, **k))
    with torch.no_grad():
        tiny_model("llama", "fp8_test_pow2")(tokens(1, 8))
    assert seen and all(c == config for c in seen)
    for bad in ("my_flash_fp8", "sdpa", "", "org/kernel"):
        with pytest.raises(ValueError):
            register_fp8_attention(bad, config)
    with pytest.raises(TypeError):
        register_fp8_attention("fp8_bad", {"pow2_scales": True})
    with pytest.raises(KeyError, match="fp8_delta"):
        registered_fp8_config("no_such_backend")


# ---------------------------------------------------------------------------------------------
# Unsupported requests fail clearly
# ---------------------------------------------------------------------------------------------


def test_dropout_is_rejected():
    model = tiny_model("llama", attention_dropout=0.1)
    model.train()
    with pytest.raises(NotImplementedError, match="dropout"):
        model(tokens(1, 8))
    model.eval()  # no dropout at inference: runs
    with torch.no_grad():
        model(tokens(1, 8))


@pytest.mark.parametrize("kwargs", [{"softcap": 2.0}, {"s_aux": torch.tensor([0.5, -1.0])}], ids=["softcap", "s_aux"])
def test_softcap_and_sinks_are_passed_to_the_op(kwargs):
    """Gemma 2's ``softcap`` and GPT-OSS's ``s_aux`` reach fp8_attention (the families themselves:
    test_integration_softcap_sinks); a bad value gets the op's error."""
    model = tiny_model("llama")
    attn = AttentionInterface()["fp8_delta"]
    q = torch.randn(1, 2, 8, 64)
    kv = torch.randn(1, 1, 8, 64)
    out, _ = attn(model.model.layers[0].self_attn, q, kv, kv, None, **kwargs)
    want = hf_fp8_attention.fp8_attention(q, kv, kv, causal=True, softcap=kwargs.get("softcap"),
                                          sinks=kwargs.get("s_aux"))
    assert torch.equal(out, want.transpose(1, 2))
    assert not torch.equal(out, hf_fp8_attention.fp8_attention(q, kv, kv, causal=True).transpose(1, 2))
    bad = {"softcap": -1.0} if "softcap" in kwargs else {"s_aux": torch.zeros(3)}
    with pytest.raises(ValueError, match="softcap|sinks"):
        attn(model.model.layers[0].self_attn, q, kv, kv, None, **bad)


def test_chunked_attention_is_rejected():
    model = tiny_model("llama")
    module = model.model.layers[0].self_attn
    module.config.attention_chunk_size = 4
    q, kv = torch.randn(1, 2, 8, 64), torch.randn(1, 1, 8, 64)
    with pytest.raises(NotImplementedError, match="chunk"):
        AttentionInterface()["fp8_delta"](module, q, kv, kv, None)


def test_custom_4d_mask_is_rejected():
    model = tiny_model("llama")
    mask4d = torch.zeros(1, 1, 8, 8)
    with pytest.raises(ValueError, match="4-D attention mask"):
        model(tokens(1, 8), attention_mask=mask4d)


def test_custom_mask_functions_are_rejected():
    model = tiny_model("llama")
    embeds = torch.zeros(1, 8, 128)
    bidirectional_prefix = lambda b, h, q, kv: kv < 3  # noqa: E731 (a prefix-LM overlay)
    with pytest.raises(NotImplementedError, match="custom attention mask"):
        create_causal_mask(model.config, embeds, torch.ones(1, 8, dtype=torch.long), None, or_mask_function=bidirectional_prefix)


def test_unsupported_head_dim_is_rejected():
    model = tiny_model("llama", head_dim=48, hidden_size=96)
    with pytest.raises(ValueError, match="head_dim 48"):
        model(tokens(1, 8))


def test_head_dim_80_phi_close_to_sdpa():
    """Phi-2-class models: head_dim 80 (hidden 160 over 2 heads), partial rotary embeddings."""
    config = PhiConfig(hidden_size=160, num_attention_heads=2, num_key_value_heads=1, num_hidden_layers=2,
                       intermediate_size=256, vocab_size=VOCAB, pad_token_id=0)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32)
    x = tokens(2, 40)
    exact_logits, exact_grads = logits_and_grads(same_weights(model, "sdpa", torch.float64), x)
    logits, grads = logits_and_grads(same_weights(model, "fp8_delta"), x)
    names = sorted(exact_grads)
    assert set(grads) == set(exact_grads)
    assert rel(logits, exact_logits) < FP8_LOGITS_BUDGET
    assert rel(torch.cat([grads[n].flatten() for n in names]),
               torch.cat([exact_grads[n].flatten() for n in names])) < FP8_GRAD_BUDGET


def tiny_gemma(family: str, impl: str, seed: int = 0):
    """A 2-layer Gemma 2 / Gemma 3 (``gemma2`` / ``gemma3_text``) at head_dim 256, as the 270M and 1B
    models (wider than the hidden size here), with the softmax scale 1/sqrt(query_pre_attn_scalar)
    and a sliding-window layer beside a global one. Soft-capping off (attn_logit_softcapping /
    final_logit_softcapping None): the backend rejects it."""
    config = AutoConfig.for_model(family, **{**_COMMON, "head_dim": 256}, sliding_window=16, query_pre_attn_scalar=256,
                                  attn_logit_softcapping=None, final_logit_softcapping=None,
                                  layer_types=["sliding_attention", "full_attention"])
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, attn_implementation=impl, dtype=torch.float32)


# Gemma 2 has no sdpa path in Transformers (its soft-capping): float64 eager attention is its exact model.
GEMMA_EXACT = {"gemma2": "eager", "gemma3_text": "sdpa"}


@pytest.mark.parametrize("family", sorted(GEMMA_EXACT))
def test_head_dim_256_gemma_close_to_sdpa(family):
    """Gemma 2 / Gemma 3 at head_dim 256 (:func:`tiny_gemma`) within the FP8 budgets. Measured
    (seeds 0-2): Gemma 2 logits 4.0-4.4%, gradients 4.8-5.4%; Gemma 3 logits 5.4-5.9%, gradients
    7.1-8.7% (Gemma 3 amplifies any attention error: docs/design.md, "Errors by model family")."""
    exact_impl = GEMMA_EXACT[family]
    model = tiny_gemma(family, exact_impl)
    x = tokens(2, 40)  # longer than the window
    exact_logits, exact_grads = logits_and_grads(same_weights(model, exact_impl, torch.float64), x)
    logits, grads = logits_and_grads(same_weights(model, "fp8_delta"), x)
    names = sorted(exact_grads)
    assert set(grads) == set(exact_grads)
    assert rel(logits, exact_logits) < FP8_LOGITS_BUDGET
    assert rel(torch.cat([grads[n].flatten() for n in names]),
               torch.cat([exact_grads[n].flatten() for n in names])) < FP8_GRAD_BUDGET


def test_output_attentions_warns_once_and_returns_no_weights():
    model = tiny_model("llama")
    x = tokens(1, 8)
    logger = hf_logging.get_logger(transformers_backend.__name__)
    with torch.no_grad(), CaptureLogger(logger) as cap:
        out = model(x, output_attentions=True)
        model(x, output_attentions=True)
        plain = model(x).logits
    assert cap.out.count("does not compute attention weights") == 1
    assert not out.attentions or all(a is None for a in out.attentions)
    assert torch.equal(out.logits, plain)


def test_ambiguous_mask_requests_are_rejected():
    model = tiny_model("mistral")
    module = model.model.layers[0].self_attn
    attn = AttentionInterface()["fp8_delta"]
    q, kv = torch.randn(2, 2, 8, 64), torch.randn(2, 1, 8, 64)
    holes = torch.tensor([[1, 1, 0, 1, 1, 1, 1, 1], [1] * 8], dtype=torch.bool)
    # A hole inside a sequence with a sliding window: the window would count positions differently.
    with pytest.raises(NotImplementedError, match="holes"):
        attn(module, q, kv, kv, holes, sliding_window=4)
    attn(module, q, kv, kv, holes)  # without a window the hole is plain padding: fine
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    with pytest.raises(ValueError, match="cu_seq_lens"):
        attn(module, q[:1], kv[:1], kv[:1], holes[:1], cu_seq_lens_q=cu, cu_seq_lens_k=cu)
    with pytest.raises(ValueError, match="both"):
        attn(module, q[:1], kv[:1], kv[:1], None, cu_seq_lens_q=cu)
    # Restarting positions while decoding against a longer cache: packing cannot be located.
    with pytest.raises(ValueError, match="restart"):
        attn(module, q[:, :, :4], kv, kv, None, position_ids=torch.tensor([[5, 6, 0, 1]] * 2))
    with pytest.raises(ValueError, match="float"):
        attn(module, q, kv, kv, torch.zeros(2, 8))
