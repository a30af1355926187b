"""The kernel test matrix: a fixed, seeded list of attention problems, built the same way on the GPU
(tests/gpu/test_kernel_matrix.py, >= 300 cases) and under the Triton interpreter on the CPU
(tests/test_kernel_matrix_interpreter.py, a small slice).

A case fixes every axis the kernels branch or specialise on: batch, query/kv heads (GQA/MQA),
query/key lengths (1, odd, around and at multiples of the 128-token tiles), head dim 64/96/128/256,
dtype bf16/fp16/fp32, causal, sliding window, the layout and the recipe:

- layout ``dense``: ``(B, H, S, D)`` with causal/window masks; ``Sq < Sk`` aligns the causal
  diagonal to the end (KV-cache decode for ``Sq = 1``);
- layouts ``left_pad`` / ``right_pad``: a padded batch as the Transformers backend runs it under
  torch.compile (:func:`hf_fp8_attention.integration.varlen.plan_contiguous_padding`: every row is
  ``[left padding | tokens | right padding]``, three packed sequences over the flattened batch);
  padding in ``fp8_attention`` itself is always expressed as packed ``cu_seqlens``;
- layout ``packed``: a packed varlen batch with random sequence lengths (some empty or one token,
  queries fewer or more than keys, trailing tokens outside every sequence);
- recipe: every entry of :data:`hf_fp8_attention.RECIPES` (read when the list is generated, so a
  recipe added later joins automatically) with each :class:`DeltaMode`.

The list is generated in code from a fixed seed: the same cases on every run and machine.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from hf_fp8_attention import RECIPES, FP8AttentionConfig
from hf_fp8_attention.config import DeltaMode
from hf_fp8_attention.masking import MaskSpec

import noise_model

LAYOUTS = ("dense", "left_pad", "right_pad", "packed")
HEAD_DIMS = (64, 96, 128, 256)
DTYPES = ("bfloat16", "float16", "float32")
HEADS = ((1, 1), (2, 1), (2, 2), (4, 1), (4, 2), (3, 3))  # (query heads, kv heads)
GPU_LENGTHS = (1, 2, 15, 17, 31, 33, 64, 65, 100, 127, 128, 129, 191, 255, 256, 257, 300, 384)
SLICE_LENGTHS = (1, 5, 16, 17, 23, 32, 33, 40)


@dataclass(frozen=True)
class Case:
    """One problem; ``seqs`` lists ``(q_len, k_len)`` per packed sequence, ``rows`` the valid
    length of each padded row (layouts other than ``dense``)."""

    index: int
    layout: str
    batch: int
    hq: int
    hkv: int
    sq: int
    sk: int
    d: int
    dtype: str
    causal: bool
    window: int | None
    recipe: str
    delta: str
    rows: tuple = ()
    seqs: tuple = ()
    trailing: tuple = (0, 0)

    @property
    def id(self) -> str:
        shape = f"{self.batch}x{self.hq}/{self.hkv}x{self.sq}/{self.sk}x{self.d}"
        mask = ("causal" if self.causal else "full") + (f"-w{self.window}" if self.window else "")
        return f"{self.index:03d}-{self.layout}-{shape}-{self.dtype}-{mask}-{self.recipe}-{self.delta}"

    def config(self, **overrides) -> FP8AttentionConfig:
        return RECIPES[self.recipe].replace(delta=DeltaMode(self.delta), **overrides)


def recipe_deltas() -> list[tuple[str, str]]:
    """Every (recipe, delta mode) pair, in a fixed order."""
    return [(name, mode.value) for name in sorted(RECIPES) for mode in DeltaMode]


def generate(n: int, seed: int, lengths=GPU_LENGTHS, dtypes=DTYPES, max_batch: int = 3,
             grouped: bool = True) -> list[Case]:
    """``n`` cases; shapes, heads, window sizes, padding and packing are drawn from ``random.Random(seed)``.

    ``grouped``: the axes the kernels are compiled for (recipe and delta, head dim, dtype, causal,
    window, varlen or not) take one of ``len(HEAD_DIMS) * len(recipe_deltas())`` fixed combinations, so the
    matrix compiles a bounded number of kernel variants (Triton compiles every combination once:
    seconds each, the bulk of a cold run) while every (recipe, delta) pair still meets every head
    dim and every dtype, and each combination gets several shapes. Not grouped: every axis cycles
    on its own (small slices).
    """
    rng = random.Random(seed)
    pairs = recipe_deltas()
    n_groups = len(HEAD_DIMS) * len(pairs)
    cases = []
    for i in range(n):
        j = i % n_groups if grouped else i
        t, r = (j // len(pairs)) % len(HEAD_DIMS), j % len(pairs)
        recipe, delta = pairs[r]
        d = HEAD_DIMS[t] if grouped else HEAD_DIMS[i % len(HEAD_DIMS)]
        dtype = dtypes[(r + t) % len(dtypes)] if grouped else dtypes[i % len(dtypes)]
        kind = (5 * j) % 8  # all 8 (causal, window, varlen) combinations every 8 groups
        causal, windowed, varlen = bool(kind & 1), bool(kind & 2), bool(kind & 4)
        if grouped:
            layout = LAYOUTS[1 + (i // n_groups + j) % 3] if varlen else "dense"
        else:
            layout = LAYOUTS[i % len(LAYOUTS)]
        hq, hkv = HEADS[rng.randrange(len(HEADS))]
        rows, seqs, trailing = (), (), (0, 0)
        if layout == "dense":
            batch = rng.randint(1, max_batch)
            sq, sk = rng.choice(lengths), rng.choice(lengths)
            if causal and sq > sk:
                sq, sk = sk, sq
        elif layout in ("left_pad", "right_pad"):
            batch = rng.randint(2, max_batch + 1)
            sk = max(2, rng.choice(lengths))
            # Prefill (q_len = kv_len), or decode / chunked prefill: the last q_len positions.
            sq = sk if rng.random() < 0.7 else rng.choice([x for x in lengths if x <= sk] or [1])
            rows = tuple([sk] + [rng.randint(0, sk) for _ in range(batch - 1)])  # one full row, one may be empty
        else:
            batch = 1
            n_seq = rng.randint(1, 4)
            small = [x for x in lengths if x <= max(lengths) // 2] or list(lengths)
            seqs = []
            for _ in range(n_seq):
                k_len = rng.choice([0, 1] + small) if rng.random() < 0.3 else rng.choice(small)
                q_len = k_len if rng.random() < 0.6 else rng.choice([0, 1] + small)
                seqs.append((q_len, k_len))
            trailing = (rng.choice((0, 0, 3)), rng.choice((0, 0, 2)))
            sq = sum(q for q, _ in seqs) + trailing[0]
            sk = sum(k for _, k in seqs) + trailing[1]
            seqs = tuple(seqs)
        window = rng.randint(1, max(1, sk)) if windowed else None
        cases.append(Case(index=i, layout=layout, batch=batch, hq=hq, hkv=hkv, sq=sq, sk=sk, d=d, dtype=dtype,
                          causal=causal, window=window, recipe=recipe, delta=delta, rows=rows, seqs=seqs,
                          trailing=trailing))
    return cases


def kernel_variants(cases: list[Case]) -> set:
    """The distinct compile-time combinations a list of cases asks the kernels for."""
    return {(c.recipe, c.delta, c.d, c.dtype, c.causal, c.window is not None, c.layout != "dense") for c in cases}


def build(case: Case, device: str | torch.device = "cpu"):
    """``q, k, v, dout, mask`` of ``case`` on ``device`` (values drawn on the CPU, seeded by the index).

    Dense layouts give q as a transposed ``(B, S, H, D)`` view (the layout Transformers hands over);
    padded and packed layouts are ``(1, H, T, D)`` over all tokens with ``cu_seqlens``.
    """
    from hf_fp8_attention.integration.varlen import flatten_batch, plan_contiguous_padding

    dtype = getattr(torch, case.dtype)
    gen = torch.Generator().manual_seed(1000 + case.index)

    def randn(*shape):
        return torch.randn(*shape, generator=gen)

    if case.layout in ("dense", "left_pad", "right_pad"):
        b = case.batch
        q = randn(b, case.sq, case.hq, case.d).transpose(1, 2)
        k, v, dout = randn(b, case.hkv, case.sk, case.d), randn(b, case.hkv, case.sk, case.d), randn(b, case.hq, case.sq, case.d)
    else:
        q, dout = randn(1, case.hq, case.sq, case.d), randn(1, case.hq, case.sq, case.d)
        k, v = randn(1, case.hkv, case.sk, case.d), randn(1, case.hkv, case.sk, case.d)
    cu_q = cu_k = None
    if case.layout in ("left_pad", "right_pad"):
        pos = torch.arange(case.sk)
        lengths = torch.tensor(case.rows)[:, None]
        valid = pos < lengths if case.layout == "right_pad" else pos >= case.sk - lengths
        cu_q, cu_k, _ = plan_contiguous_padding(valid, case.sq)
        q, k, v, dout = (flatten_batch(t) for t in (q.contiguous(), k, v, dout))
    elif case.layout == "packed":
        cu_q = torch.tensor([0] + [q for q, _ in case.seqs], dtype=torch.int32).cumsum(0, dtype=torch.int32)
        cu_k = torch.tensor([0] + [k for _, k in case.seqs], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    q, k, v, dout = (t.to(dtype).to(device) for t in (q, k, v, dout))
    if cu_q is not None:
        cu_q, cu_k = cu_q.to(device), cu_k.to(device)
    mask = MaskSpec(causal=case.causal, window=case.window, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    return q, k, v, dout, mask


def coverage(cases: list[Case]) -> dict[str, set]:
    """What a list of cases covers, per axis (checked by the matrix tests)."""
    lengths = {x for c in cases for x in (c.sq, c.sk)}
    return {
        "recipe_delta": {(c.recipe, c.delta) for c in cases},
        "layout": {c.layout for c in cases},
        "d": {c.d for c in cases},
        "dtype": {c.dtype for c in cases},
        "causal": {c.causal for c in cases},
        "window": {c.window is not None for c in cases},
        "gqa": {c.hq != c.hkv for c in cases},
        "length_kinds": {kind for x in lengths for kind in (("one",) if x == 1 else ()) + (("odd",) if x % 2 else ())
                         + (("tile_multiple",) if x and x % 128 == 0 else ())},
        "decode": {c.sq < c.sk for c in cases},
        "empty_padded_row": {0 in c.rows for c in cases if c.rows},
        "empty_sequence": {any(k == 0 for _, k in c.seqs) for c in cases if c.seqs},
    }


def noise_bounds(case: Case, q, k, v, dout, mask, o_rel: float, lse_abs: float, grad_rel: float) -> dict:
    """The bounds for ``case`` (inputs as :func:`build` gives them): ``o``, ``lse``, ``dq``, ``dk``,
    ``dv`` (before the bf16/fp16 output rounding the caller adds); see tests/noise_model.py."""
    return noise_model.noise_bounds(q, k, v, dout, mask, case.config(), scale=case.d**-0.5, o_rel=o_rel,
                                    lse_abs=lse_abs, grad_rel=grad_rel)
