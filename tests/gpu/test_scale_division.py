"""``divide_by_scale`` (x / scale before the fp8 cast, for row scales) against IEEE division, on the GPU.

For row scales (the forward's Q, the quantization kernel's row-wise copy) the kernels form x / scale
with FMAs from a per-block reciprocal of the scale's mantissa, after an exact power-of-two prescale,
instead of ``div.rn.f32`` (see
:func:`hf_fp8_attention.kernels.quantize.divide_by_scale`). Their codes must stay those of PyTorch's
``x / scale`` cast to fp8, so the quotients must be the correctly rounded ones wherever a code can
tell: bit for bit for |x / scale| >= 2^-64, and below that a zero of the quotient's sign (every fp8
format casts such a quotient to that zero; E5M2's smallest code is 2^-16).

Pairs: every finite bf16 value and random fp32 values over 250 binades, against scales over the
whole range the kernels can form (amax / FMT_MAX floored at 2^-126, up to fp32's max / 448):
scales formed from random amax, random fp32 scales, scales with an all-ones mantissa (where
reciprocal-based division is hardest), powers of two, the range's edges, and +inf / NaN. Only
pairs in the kernels' domain count: |x / scale| <= 57344 (E5M2's FMT_MAX; E4M3's is smaller), as x
always lies within its block's amax.
"""
from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")
from hf_fp8_attention.config import FP8Format  # noqa: E402
from hf_fp8_attention.kernels.quantize import divide_by_scale, quantize_operand  # noqa: E402
from hf_fp8_attention.quant import quantize  # noqa: E402

pytestmark = pytest.mark.gpu

ROWS = 16  # scales per program
COLS = 1024  # x values per program
TINY = 2.0**-64  # below this the quotient may come out as a signed zero (see the module docstring)


@triton.jit
def _divide_kernel(x_ptr, s_ptr, q_ptr, ref_ptr, NX, ROWS: tl.constexpr, COLS: tl.constexpr):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.program_id(1) * COLS + tl.arange(0, COLS)
    scale = tl.load(s_ptr + rows)[:, None]
    x = tl.broadcast_to(tl.load(x_ptr + cols, mask=cols < NX, other=1.0)[None, :], (ROWS, COLS))
    out = rows[:, None].to(tl.int64) * NX + cols[None, :]
    ok = (cols < NX)[None, :]
    tl.store(q_ptr + out, divide_by_scale(x, scale, False), mask=ok)
    tl.store(ref_ptr + out, tl.math.div_rn(x, scale), mask=ok)


def _f32(bits: torch.Tensor) -> torch.Tensor:
    return bits.to(torch.int32).view(torch.float32)


def _x_values(gen) -> torch.Tensor:
    every_bf16 = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
    every_bf16 = every_bf16[torch.isfinite(every_bf16)]
    mant = torch.randint(0, 1 << 23, (1 << 16,), generator=gen, dtype=torch.int64)
    expo = torch.randint(0, 250, (1 << 16,), generator=gen, dtype=torch.int64)  # subnormals included
    sign = torch.randint(0, 2, (1 << 16,), generator=gen, dtype=torch.int64) << 31
    random_f32 = _f32(sign | (expo << 23) | mant)
    return torch.cat([every_bf16, random_f32])


def _scales(gen) -> torch.Tensor:
    amax = torch.randn(512, generator=gen, dtype=torch.float64).abs() * torch.logspace(-44, 38, 512, dtype=torch.float64)
    amax = amax.clamp(max=3.0e38).float()
    floor = torch.tensor(2.0**-126)
    from_e4m3 = torch.maximum(amax / 448.0, floor)
    from_e5m2 = torch.maximum(amax / 57344.0, floor)
    from_bf16 = torch.maximum(amax.bfloat16().float().clamp(max=3.0e38) / 448.0, floor)
    mant = torch.randint(0, 1 << 23, (512,), generator=gen, dtype=torch.int64)
    expo = torch.randint(1, 247, (512,), generator=gen, dtype=torch.int64)
    random_f32 = _f32((expo << 23) | mant)
    all_ones = _f32((torch.arange(1, 247, 2, dtype=torch.int64) << 23) | ((1 << 23) - 1))
    powers = 2.0 ** torch.arange(-126, 119, 3, dtype=torch.float32)
    edges = torch.tensor([2.0**-126, float(torch.tensor(2.0**-126).nextafter(torch.tensor(1.0))), 1.0,
                          float(torch.tensor(1.0).nextafter(torch.tensor(2.0))), 3.4028235e38 / 448.0])
    non_finite = torch.tensor([float("inf"), float("nan")])
    s = torch.cat([from_e4m3, from_e5m2, from_bf16, random_f32, all_ones, powers, edges, non_finite])
    return torch.cat([s, s[: (-s.numel()) % ROWS]])


def test_divide_by_scale_equals_ieee_division():
    gen = torch.Generator().manual_seed(0)
    x = _x_values(gen).cuda()
    scales = _scales(gen).cuda()
    q = torch.empty(scales.numel(), x.numel(), device="cuda")
    ref = torch.empty_like(q)
    _divide_kernel[(scales.numel() // ROWS, triton.cdiv(x.numel(), COLS))](x, scales, q, ref, x.numel(),
                                                                            ROWS=ROWS, COLS=COLS)
    # div_rn itself against PyTorch's division on the CPU (IEEE), on every 37th scale.
    rows = torch.arange(0, scales.numel(), 37)
    want = x.cpu()[None, :] / scales.cpu()[rows, None]
    got = ref[rows.cuda()].cpu()
    assert torch.equal(got.view(torch.int32)[~want.isnan()], want.view(torch.int32)[~want.isnan()])

    domain = ~(ref.abs() > 57344.0)  # |x / scale| within FMT_MAX (NaN quotients included)
    same = (q.view(torch.int32) == ref.view(torch.int32)) | (q.isnan() & ref.isnan())
    small = ref.abs() < TINY
    n_exact = int((domain & ~small).sum())
    assert n_exact > 50_000_000, n_exact  # the FMA path really ran on many pairs
    bad = domain & ~small & ~same
    assert not bad.any(), (
        f"{int(bad.sum())} quotients differ from div_rn, e.g. x={x[bad.nonzero()[0, 1]].item()!r} "
        f"scale={scales[bad.nonzero()[0, 0]].item()!r}: {q[bad][0].item()!r} vs {ref[bad][0].item()!r}")
    small_ok = (q.abs() < TINY) & (q.signbit() == ref.signbit())
    assert not (domain & small & ~small_ok).any()
    assert int((domain & small).sum()) > 1_000_000  # tiny quotients were exercised too


@pytest.mark.parametrize("fmt", [FP8Format.E4M3, FP8Format.E5M2])
def test_quantize_kernel_is_bit_exact_at_extreme_scales(fmt):
    # Blocks from subnormal magnitudes (scale at its 2^-126 floor) to fp32's largest, with elements
    # far below their block's amax (tiny quotients: signed zero codes) and blocks holding +inf or
    # NaN: codes and scales of both copies equal the CPU emulation's bit for bit.
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(1, 4, 512, 64, generator=gen)
    x = x * torch.logspace(-42, 36, 64)  # channel magnitudes 1e-42 .. 1e36
    x[0, 1] *= torch.logspace(-30, 30, 512)[:, None]  # and token magnitudes
    x = x.clamp(-3.0e38, 3.0e38)
    x[0, 2, 5, 7] = float("inf")
    x[0, 3, 300, 0] = float("nan")
    rc, rs, cc, cs, _ = quantize_operand(x.cuda(), row=True, col=True, block=128, fmt=fmt)
    codes, scales = quantize(x, dim=-1, block=None, fmt=fmt)
    assert _same(rs.cpu(), scales[..., 0]) and _same(rc.cpu(), codes)
    codes, scales = quantize(x, dim=-2, block=128, fmt=fmt)
    assert _same(cc.cpu().transpose(-1, -2).contiguous(), codes) and _same(cs.cpu(), scales)
    assert codes.float().isnan().any() and (codes.view(torch.uint8) == 0x80).any()  # NaN and -0 codes occur


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit, except that any NaN equals any NaN (fp32 scales or fp8 codes)."""
    bits = torch.int32 if a.element_size() == 4 else torch.uint8
    nan_a, nan_b = a.float().isnan(), b.float().isnan()
    return torch.equal(nan_a, nan_b) and torch.equal(a.view(bits)[~nan_a], b.view(bits)[~nan_b])


@pytest.mark.parametrize("recipe", ["fp8_delta", "fp8_delta_fast", "fp8_delta_token"])
def test_channel_copies_by_fma_division_are_the_div_rn_copies(recipe, monkeypatch):
    """``quantize.COL_FMA_DIVISION``: the channel-wise copies with sequence-wide scales divide by FMAs
    instead of ``div.rn``; every code and scale of the backward's copies of Q, dO, K and V is the
    same, on inputs with outliers and a NaN."""
    from hf_fp8_attention.config import RECIPES
    from hf_fp8_attention.kernels import operands
    from hf_fp8_attention.kernels import quantize as quantize_module

    config = RECIPES[recipe]
    gen = torch.Generator(device="cuda").manual_seed(13)
    xs = [torch.randn(2, 3, 1000, 128, device="cuda", generator=gen) * torch.logspace(-3, 3, 128, device="cuda")
          for _ in range(4)]
    xs[1][0, 1, 17, 5] = float("nan")
    q, do, k, v = (x.bfloat16() for x in xs)
    steps = [((q, do), (operands.backward_q_copies(config), operands.copies_for("do", config, row=True, col=True)),
              config.block_q),
             ((k, v), operands.backward_kv_copies(config), config.block_k)]
    for pair, copies, block in steps:
        stats = operands.stats_for(pair, copies)
        outs = []
        for on in (False, True):
            monkeypatch.setattr(quantize_module, "COL_FMA_DIVISION", on)
            got = quantize_module.quantize_operands(pair, copies, block=block, stats=stats)
            outs.append([t for out in got for t in out if t is not None])
        for a, b in zip(*outs):
            assert torch.equal(a.view(torch.uint8) if a.element_size() == 1 else a.view(torch.int32),
                               b.view(torch.uint8) if b.element_size() == 1 else b.view(torch.int32))
