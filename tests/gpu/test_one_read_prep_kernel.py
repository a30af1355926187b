"""The one-read preparation launch (``kernels/one_read_prep.py``) against the two launches it replaces
(the statistics, then the copies), on the GPU: there a sequence's programs run concurrently and wait
for each other's fold, which the interpreter, running programs one after another, cannot do.

Per recipe, shape (dense, packed with empty sequences, one sequence of as many chunks as the limit
allows) and step (the forward's K and V with the backward's statistics; the backward's Q and dO):
every statistic, code and scale is the two launches' bit for bit (the copies' values depend on the
statistics and the element alone, and the statistics are the same partials folded in the same
order), on repeated calls too (a partial or a statistic read before it was written would change
from call to call); and through the whole op, outputs and gradients are the same bits either way.
"""
import pytest
import torch

pytestmark = pytest.mark.gpu

pytest.importorskip("triton")
orp = pytest.importorskip("hf_fp8_attention.kernels.one_read_prep")
from hf_fp8_attention.config import RECIPES  # noqa: E402
from hf_fp8_attention.functional import fp8_attention  # noqa: E402
from hf_fp8_attention.kernels import operands  # noqa: E402
from hf_fp8_attention.kernels.sequence_stats import CHUNK  # noqa: E402

ONE_READ_RECIPES = ("fp8_delta", "fp8_delta_fast", "fp8_stale", "fp8_delta_token", "fp8_delta_pow2")
# name -> (batch, heads, tokens, head dim, cu_seqlens or None)
SHAPES = {
    "dense_d128_8k": (2, 4, 8192, 128, None),
    "dense_d64_4k": (1, 3, 4096, 64, None),
    "dense_d96_ragged": (2, 2, 3000, 96, None),
    "packed_d128_empty": (1, 4, 6000, 128, [0, 0, 1, 257, 257, 3000, 6000, 6000]),
}
REPEATS = 5


def _inputs(b, h, s, d, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    # A channel mean far from zero (what K-smoothing removes) and outliers in a few channels.
    x = torch.randn(b, h, s, d, device="cuda", generator=gen) * torch.logspace(-1, 1, d, device="cuda") + 2
    y = torch.randn(b, h, s, d, device="cuda", generator=gen) * 3
    return x.bfloat16(), y.bfloat16()


def _steps(config):
    """(copies, also, block) of the forward's K/V step and the backward's Q/dO step."""
    kv = (operands.copies_for("k", config, row=True, col=False), operands.copies_for("v", config, row=False, col=True))
    qdo = (operands.backward_q_copies(config), operands.copies_for("do", config, row=True, col=True))
    return {"fwd_kv": (kv, operands.backward_kv_copies(config), config.block_k),
            "bwd_qdo": (qdo, None, config.block_q)}


def _flat(obj):
    if isinstance(obj, torch.Tensor):
        return [obj.clone()]
    if isinstance(obj, (tuple, list)):
        return [t for o in obj for t in _flat(o)]
    return []


def _bits(x):
    return x.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[x.element_size()])


def _run(xs, copies, also, block, cu, max_len, one_read, monkeypatch):
    monkeypatch.setattr(orp, "ONE_READ", one_read)
    out = operands.stats_then_copies(xs, copies, block=block, cu_seqlens=cu, max_seqlen=max_len, also=also)
    torch.cuda.synchronize()
    return _flat(out)


@pytest.mark.parametrize("step", ["fwd_kv", "bwd_qdo"])
@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("recipe", ONE_READ_RECIPES)
def test_one_read_launch_is_the_two_launches(recipe, shape, step, monkeypatch):
    config = RECIPES[recipe]
    copies, also, block = _steps(config)[step]
    b, h, s, d, cu = SHAPES[shape]
    xs = _inputs(b, h, s, d, seed=7)
    cu = None if cu is None else torch.tensor(cu, dtype=torch.int32, device="cuda")
    max_len = s if cu is None else int((cu[1:] - cu[:-1]).max())
    needs = operands.operand_needs(copies, also)
    monkeypatch.setattr(orp, "ONE_READ", True)
    assert orp.one_read_reason(xs, needs, block, max_len) is None, "the one-read launch does not run here"
    want = _run(xs, copies, also, block, cu, max_len, False, monkeypatch)
    calls = []
    real = orp.one_read_operands
    monkeypatch.setattr(orp, "one_read_operands", lambda *a, **k: calls.append(1) or real(*a, **k))
    got = _run(xs, copies, also, block, cu, max_len, True, monkeypatch)
    assert calls, "stats_then_copies took the two launches"
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.shape == w.shape and g.dtype == w.dtype, f"output {i}: {g.shape} {g.dtype} against {w.shape} {w.dtype}"
        same = _bits(g) == _bits(w)
        assert same.all(), f"output {i} ({tuple(w.shape)}): {int((~same).sum())} elements differ"
    for _ in range(REPEATS):
        again = _run(xs, copies, also, block, cu, max_len, True, monkeypatch)
        assert all(torch.equal(_bits(a), _bits(g)) for a, g in zip(again, got)), "changed between calls"


def test_longest_one_read_sequence(monkeypatch):
    """One sequence of exactly as many chunks as the GPU has SMs: every SM's programs wait on it."""
    from hf_fp8_attention.kernels.tiles import sm_count
    config = RECIPES["fp8_delta"]
    copies, also, block = _steps(config)["fwd_kv"]
    s = CHUNK * sm_count(torch.cuda.current_device())
    xs = _inputs(1, 2, s, 128, seed=3)
    needs = operands.operand_needs(copies, also)
    monkeypatch.setattr(orp, "ONE_READ", True)
    assert orp.one_read_reason(xs, needs, block, s) is None
    assert orp.one_read_reason(xs, needs, block, s + 1) is not None
    want = _run(xs, copies, also, block, None, s, False, monkeypatch)
    got = _run(xs, copies, also, block, None, s, True, monkeypatch)
    assert all(torch.equal(_bits(g), _bits(w)) for g, w in zip(got, want))


@pytest.mark.parametrize("recipe", ["fp8_delta", "fp8_delta_fast"])
@pytest.mark.parametrize("causal", [True, False])
def test_op_bits_with_and_without_one_read(recipe, causal, monkeypatch):
    gen = torch.Generator(device="cuda").manual_seed(11)
    q, k, v, do = (torch.randn(2, 4, 4096, 128, device="cuda", generator=gen).bfloat16() for _ in range(4))
    config = RECIPES[recipe]
    results = []
    for one_read in (False, True):
        monkeypatch.setattr(orp, "ONE_READ", one_read)
        qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
        out = fp8_attention(qq, kk, vv, causal=causal, config=config)
        out.backward(do)
        results.append([out.detach(), qq.grad, kk.grad, vv.grad])
    for name, a, b in zip(("out", "dq", "dk", "dv"), *results):
        assert torch.equal(_bits(a), _bits(b)), f"{name} differs with the one-read launch"
