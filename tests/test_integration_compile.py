"""torch.compile and meta-device tensors through the "fp8_delta" backend (CPU: the emulation).

Under ``torch.compile`` the attention backend must not read tensor values on the host (a graph
break each time, 17 in an 8-layer Llama before this was fixed): a plain batch and a padded batch
compile with ``fullgraph=True``. How packed batches compile:

- ``cu_seq_lens_q/k`` kwargs (``DataCollatorWithFlattening(return_flash_attn_kwargs=True)``, the
  Transformers flash-attention kwargs): no host read, ``fullgraph=True`` works;
- packing expressed only by ``position_ids`` restarting needs the host to detect it; under
  compile it is not detected (one warning) and the batch is treated as unpacked.

Meta tensors (shape inference, ``torch.device("meta")`` model init) give a meta output of the
right shape and dtype, as sdpa does.
"""
from __future__ import annotations

import logging

import pytest
import torch
from transformers import AutoModelForCausalLM, DataCollatorWithFlattening, LlamaConfig
from transformers.testing_utils import CaptureLogger
from transformers.utils import logging as hf_logging

import hf_fp8_attention
from hf_fp8_attention.integration import transformers_backend

VOCAB = 128


def _config(**overrides):
    kw = dict(hidden_size=64, num_attention_heads=1, num_key_value_heads=1, head_dim=64, num_hidden_layers=2,
              intermediate_size=128, vocab_size=VOCAB, pad_token_id=0, attention_dropout=0.0)
    kw.update(overrides)
    return LlamaConfig(**kw)


def _model(impl="fp8_delta", seed=0):
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(_config(), attn_implementation=impl)


def _ids(b, s, seed=1):
    return torch.randint(3, VOCAB, (b, s), generator=torch.Generator().manual_seed(seed))


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _loss_and_grads(model, ids, **kwargs):
    model.zero_grad()
    out = model(ids, labels=ids.masked_fill(kwargs["attention_mask"] == 0, -100) if "attention_mask" in kwargs else ids,
                **kwargs)
    out.loss.backward()
    return out.logits.detach(), [p.grad.detach().clone() for p in model.parameters() if p.grad is not None]


# ---------------------------------------------------------------------------------------------
# meta tensors
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fp8_attention_on_meta_tensors(dtype):
    q = torch.empty(2, 4, 24, 64, device="meta", dtype=dtype, requires_grad=True)
    k = torch.empty(2, 2, 24, 64, device="meta", dtype=dtype, requires_grad=True)
    out = hf_fp8_attention.fp8_attention(q, k, k, causal=True)
    assert (out.device.type, out.shape, out.dtype) == ("meta", q.shape, dtype)
    out.sum().backward()
    assert q.grad.shape == q.shape and k.grad.shape == k.shape


@pytest.mark.parametrize("with_mask", [False, True])
def test_meta_device_llama_forward(with_mask):
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(_config(), attn_implementation="fp8_delta")
    ids = torch.randint(0, VOCAB, (2, 16), device="meta")
    kwargs = {"attention_mask": torch.ones(2, 16, dtype=torch.long, device="meta")} if with_mask else {}
    logits = model(ids, **kwargs).logits
    assert (logits.device.type, tuple(logits.shape)) == ("meta", (2, 16, VOCAB))


# ---------------------------------------------------------------------------------------------
# torch.compile
# ---------------------------------------------------------------------------------------------


@pytest.fixture(autouse=True)
def _reset_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_plain_batch_has_no_graph_break():
    model = _model()
    explanation = torch._dynamo.explain(model)(_ids(2, 24))
    assert explanation.graph_break_count == 0, explanation.break_reasons


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_plain_batch_compiles_fullgraph_forward_and_backward(backend):
    model = _model()
    ids = _ids(2, 24)
    want_logits, want_grads = _loss_and_grads(model, ids)
    compiled = torch.compile(model, fullgraph=True, backend=backend)
    got_logits, got_grads = _loss_and_grads(compiled, ids)
    assert _rel(got_logits, want_logits) < 1e-4
    assert all(_rel(g, w) < 1e-3 for g, w in zip(got_grads, want_grads))


@pytest.mark.parametrize("side", ["left", "right"])
def test_padded_batch_compiles_fullgraph_forward_and_backward(side):
    model = _model()
    ids = _ids(3, 24)
    lengths = [24, 17, 9]
    mask = torch.zeros(3, 24, dtype=torch.long)
    for row, n in enumerate(lengths):
        if side == "right":
            mask[row, :n] = 1
        else:
            mask[row, 24 - n:] = 1
    want_logits, want_grads = _loss_and_grads(model, ids, attention_mask=mask)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    got_logits, got_grads = _loss_and_grads(compiled, ids, attention_mask=mask)
    valid = mask.bool()
    # Same FP8 computation as the eager varlen path (tiles restart at every sequence start).
    assert _rel(got_logits[valid], want_logits[valid]) < 1e-4
    assert all(_rel(g, w) < 1e-3 for g, w in zip(got_grads, want_grads))


def test_fully_padded_row_compiles():
    model = _model()
    ids = _ids(2, 16)
    mask = torch.ones(2, 16, dtype=torch.long)
    mask[1] = 0
    compiled = torch.compile(model, fullgraph=True, backend="eager")
    with torch.no_grad():
        logits = compiled(ids, attention_mask=mask).logits
        want = model(ids, attention_mask=mask).logits
    assert torch.isfinite(logits).all()
    assert _rel(logits[0], want[0]) < 1e-4


def test_packed_batch_with_flash_kwargs_compiles_fullgraph():
    # cu_seq_lens_q/k given (DataCollatorWithFlattening(return_flash_attn_kwargs=True)): no host read.
    model = _model()
    seqs = [_ids(1, n, seed=n)[0] for n in (11, 7, 14)]
    batch = DataCollatorWithFlattening(return_flash_attn_kwargs=True)([{"input_ids": s.tolist()} for s in seqs])
    extra = {k: batch[k] for k in ("position_ids", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")}
    compiled = torch.compile(model, fullgraph=True, backend="eager")
    with torch.no_grad():
        packed = compiled(batch["input_ids"], **extra).logits
        start = 0
        for s in seqs:
            assert _rel(packed[0, start:start + len(s)], model(s[None]).logits[0]) < 1e-4
            start += len(s)


def test_packed_by_position_ids_only_warns_under_compile():
    # Detecting packing from position_ids alone reads them on the host: under torch.compile that is
    # not done (the batch is treated as one sequence per row) and one warning says so.
    model = _model()
    position_ids = torch.cat([torch.arange(10), torch.arange(14)])[None]
    compiled = torch.compile(model, fullgraph=True, backend="eager")
    logger = hf_logging.get_logger(transformers_backend.__name__)
    hf_logging.set_verbosity_warning()
    transformers_backend._WARNED.clear()
    with CaptureLogger(logger) as cl, torch.no_grad():
        compiled(_ids(1, 24), position_ids=position_ids)
    assert "cu_seq_lens_q" in cl.out and "torch.compile" in cl.out
