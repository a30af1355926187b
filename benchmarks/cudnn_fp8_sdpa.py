"""cuDNN's own FP8 attention (``sdpa_fp8`` / ``sdpa_fp8_backward`` of cudnn-frontend) as a timing baseline.

The anchor a trainable FP8 attention has to beat besides bf16: cuDNN's FP8 SDPA, one scale per
tensor for every operand (Q, K, V, O, dO, S, dP), E4M3 inputs. Needs the ``nvidia-cudnn-frontend``
Python package (1.23 used here) and cuDNN >= 9.14 on a Hopper GPU; :func:`available` says why not.

:class:`CudnnFp8Attention` builds the forward and backward graphs of one shape once and returns
zero-argument callables that execute them, for ``triton.testing.do_bench``. What is timed is cuDNN's
kernels alone: the inputs are handed over already in FP8 with their scales (a training step would
also pay for the amax and the casts of Q, K, V and dO, and the FP8 package's own times include its
quantization). O and the gradients are written in bf16 where cuDNN builds that graph, else in FP8
(``o_dtype`` says which, ``refused`` why not bf16). Scales come from the data: each
input's amax, each FP8 output's from a float32 reference's, dP's from the amax cuDNN reports after
one fwd+bwd (:meth:`CudnnFp8Attention.calibrate`, delayed scaling's way).
:meth:`CudnnFp8Attention.errors` compares O and the gradients with that reference, so
that a wrong mask or scale cannot pass as a fast baseline.

Layouts: q (B, H, S, D), k, v (B, Hkv, S, D), bf16 as ``bench_attention.py`` makes them or fp32 (the
fixture's, ``recipe_errors.py --recipes ... cudnn_fp8``); the FP8 copies are token-major (B, S, H, D),
cuDNN's usual layout.
"""
from __future__ import annotations

import math
from enum import IntEnum

import torch

E4M3 = torch.float8_e4m3fn
MIN_CUDNN = 91400  # sdpa_fp8 with the diagonal-band (causal) options


class CudnnFp8Refused(RuntimeError):
    """cuDNN builds no FP8 SDPA graph for this shape here (e.g. Hopper's head_dim 128 only)."""


def available() -> tuple[bool, str]:
    """(True, "") where cuDNN's FP8 SDPA can run here, else (False, why)."""
    try:
        import cudnn
    except Exception as err:  # noqa: BLE001 (an ImportError, or cuDNN's library not found)
        return False, f"cudnn-frontend not importable ({type(err).__name__}: {str(err)[:120]})"
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9:
        return False, "needs a Hopper or newer GPU"
    if cudnn.backend_version() < MIN_CUDNN:
        return False, f"needs cuDNN >= 9.14, found {cudnn.backend_version_string()}"
    return True, ""


def fp8_scale(amax: float) -> float:
    """The quantization scale of a tensor with this amax: a power of two that maps it to 128 / 4
    (cudnn-frontend's own tests' choice, leaving headroom for values above the measured amax)."""
    return 128.0 / 2.0 ** math.ceil(math.log2(max(amax, 0.0625))) * 0.25


class _Fwd(IntEnum):
    q, k, v, o, stats, q_descale, k_descale, v_descale, s_descale, s_scale, o_scale, s_amax, o_amax = range(13)


class _Bwd(IntEnum):
    q, k, v, o, dO, stats = range(100, 106)
    q_descale, k_descale, v_descale, o_descale, dO_descale, s_descale, dP_descale = range(106, 113)
    s_scale, dQ_scale, dK_scale, dV_scale, dP_scale, dQ, dK, dV, dQ_amax, dK_amax, dV_amax, dP_amax = range(113, 125)


def _scalar(value: float) -> torch.Tensor:
    return torch.tensor([value], dtype=torch.float32, device="cuda")


class CudnnFp8Attention:
    """cuDNN FP8 SDPA for one shape: q (B, H, S, D), k, v (B, Hkv, S, D) (bf16 or fp32), causal or not;
    ``scale`` the softmax scale (default 1/sqrt(D)). Raises RuntimeError where it cannot run here
    (:func:`available`'s reason), :class:`CudnnFp8Refused` where cuDNN builds no graph for the shape."""

    def __init__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, dout: torch.Tensor,
                 scale: float | None = None):
        ok, why = available()
        if not ok:
            raise RuntimeError(f"cuDNN's FP8 SDPA cannot run here: {why}")
        import cudnn

        self.cudnn = cudnn
        b, h, s, d = q.shape
        hkv = k.shape[1]
        self.shape = (b, h, hkv, s, d)
        self.causal = causal
        self.attn_scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
        self.handle = cudnn.create_handle()
        cudnn.set_stream(handle=self.handle, stream=torch.cuda.current_stream().cuda_stream)
        self.q, self.k, self.v, self.dout = q, k, v, dout
        amax = {name: t.abs().amax().item() for name, t in (("q", q), ("k", k), ("v", v), ("dO", dout))}
        self.scales = {name: fp8_scale(a) for name, a in amax.items()}
        self.codes = {name: (t.transpose(1, 2) * self.scales[name]).to(E4M3).contiguous()
                      for name, t in (("q", q), ("k", k), ("v", v), ("dO", dout))}
        self.reference = self._reference()
        self.s_scale = fp8_scale(1.0)  # P = softmax in [0, 1]
        self.out_scales = {name: fp8_scale(t.abs().amax().item()) for name, t in self.reference.items()}
        head = (dout[0, 0].float() @ v[0, 0].float().T).abs().amax().item()  # dP of the first (batch, head)
        self.dP_first_head = head
        self.dP_scale = fp8_scale(2.0 * head)  # until calibrate() reads the amax cuDNN reports
        self.o_dtype, refused = None, []
        for o_dtype in (torch.bfloat16, E4M3):  # bf16 O and gradients where cuDNN builds them
            try:
                self.fwd = self._build(self._forward_graph(o_dtype))
                self.bwd = self._build(self._backward_graph(o_dtype))
            except (cudnn.cudnnGraphNotSupportedError, RuntimeError) as err:
                refused.append(f"{o_dtype}: {str(err)[:200]}")
                continue
            self.o_dtype = o_dtype
            break
        if self.o_dtype is None:
            raise CudnnFp8Refused(f"cuDNN builds no FP8 SDPA for (B, H, Hkv, S, D) = {self.shape}: {refused}")
        self.refused = refused
        self._allocate()
        self.calibrate()

    # --- graphs -----------------------------------------------------------------------------------
    def _mask_kwargs(self) -> dict:
        if not self.causal:
            return {}
        return {"right_bound": 0, "diagonal_alignment": self.cudnn.diagonal_alignment.TOP_LEFT}

    def _type(self, dtype):
        dt = self.cudnn.data_type
        return {torch.bfloat16: dt.BFLOAT16, E4M3: dt.FP8_E4M3, torch.float32: dt.FLOAT}[dtype]

    def _strides(self, heads: int) -> tuple:
        """(B, H, S, D) dims over token-major (B, S, H, D) storage."""
        _, _, _, s, d = self.shape
        return (s * heads * d, d, heads * d, 1)

    def _graph(self):
        dt = self.cudnn.data_type
        return self.cudnn.pygraph(io_data_type=dt.FP8_E4M3, intermediate_data_type=dt.FLOAT, compute_data_type=dt.FLOAT)

    def _operands(self, g, uids, dtypes) -> list:
        """Graph tensors of the (B, heads, S, D) operands ``uids`` (token-major storage), in ``dtypes``:
        Q, dO and O have H heads, K and V Hkv (told apart by the uid's name)."""
        b, h, hkv, s, d = self.shape
        out = []
        for uid, dtype in zip(uids, dtypes):
            heads = hkv if uid.name in ("k", "v") else h
            out.append(g.tensor(uid=uid, dim=(b, heads, s, d), stride=self._strides(heads), data_type=dtype))
        return out

    def _output(self, t, uid, dim, stride, dtype) -> None:
        """Mark graph tensor ``t`` an output with this uid, shape, strides and cuDNN data type."""
        t.set_uid(uid).set_output(True).set_dim(dim).set_stride(stride)
        t.set_data_type(dtype)

    def _scalars(self, g, ids) -> list:
        return [g.tensor(uid=int(i), dim=(1, 1, 1, 1), stride=(1, 1, 1, 1), data_type=self.cudnn.data_type.FLOAT)
                for i in ids]

    def _forward_graph(self, o_dtype):
        b, h, hkv, s, d = self.shape
        g = self._graph()
        fp8, f32 = self.cudnn.data_type.FP8_E4M3, self.cudnn.data_type.FLOAT
        q, k, v = self._operands(g, (_Fwd.q, _Fwd.k, _Fwd.v), (fp8,) * 3)
        dq_, dk_, dv_, ds_, ss_, so_ = self._scalars(g, (_Fwd.q_descale, _Fwd.k_descale, _Fwd.v_descale,
                                                         _Fwd.s_descale, _Fwd.s_scale, _Fwd.o_scale))
        o, stats, s_amax, o_amax = g.sdpa_fp8(
            q=q, k=k, v=v, descale_q=dq_, descale_k=dk_, descale_v=dv_, descale_s=ds_, scale_s=ss_, scale_o=so_,
            generate_stats=True, attn_scale=self.attn_scale, use_causal_mask=False, **self._mask_kwargs())
        self._output(o, _Fwd.o, (b, h, s, d), self._strides(h), self._type(o_dtype))
        self._output(stats, _Fwd.stats, (b, h, s, 1), (h * s, s, 1, 1), f32)
        for t, uid in ((s_amax, _Fwd.s_amax), (o_amax, _Fwd.o_amax)):
            self._output(t, uid, (1, 1, 1, 1), (1, 1, 1, 1), f32)
        return g

    def _backward_graph(self, o_dtype):
        b, h, hkv, s, d = self.shape
        g = self._graph()
        fp8, f32 = self.cudnn.data_type.FP8_E4M3, self.cudnn.data_type.FLOAT
        q, k, v, o, do = self._operands(g, (_Bwd.q, _Bwd.k, _Bwd.v, _Bwd.o, _Bwd.dO),
                                        (fp8, fp8, fp8, self._type(o_dtype), fp8))
        stats = g.tensor(uid=_Bwd.stats, dim=(b, h, s, 1), stride=(h * s, s, 1, 1), data_type=f32)
        scalars = self._scalars(g, range(_Bwd.q_descale, _Bwd.dP_scale + 1))
        names = ("descale_q", "descale_k", "descale_v", "descale_o", "descale_dO", "descale_s", "descale_dP",
                 "scale_s", "scale_dQ", "scale_dK", "scale_dV", "scale_dP")
        dq, dk, dv, *amaxes = g.sdpa_fp8_backward(
            q=q, k=k, v=v, o=o, dO=do, stats=stats, attn_scale=self.attn_scale, use_padding_mask=False,
            **dict(zip(names, scalars)), **self._mask_kwargs())
        for t, uid, heads in ((dq, _Bwd.dQ, h), (dk, _Bwd.dK, hkv), (dv, _Bwd.dV, hkv)):
            self._output(t, uid, (b, heads, s, d), self._strides(heads), self._type(o_dtype))
        for t, uid in zip(amaxes, (_Bwd.dQ_amax, _Bwd.dK_amax, _Bwd.dV_amax, _Bwd.dP_amax)):
            self._output(t, uid, (1, 1, 1, 1), (1, 1, 1, 1), f32)
        return g

    def _build(self, g):
        g.validate()
        g.build_operation_graph()
        g.create_execution_plans([self.cudnn.heur_mode.A, self.cudnn.heur_mode.FALLBACK])
        g.check_support()
        g.build_plans()
        return g

    # --- buffers and execution ----------------------------------------------------------------------
    def _allocate(self) -> None:
        b, h, hkv, s, d = self.shape
        c, sc = self.codes, self.scales
        out = dict(device="cuda", dtype=self.o_dtype)
        self.o = torch.empty(b, s, h, d, **out)
        self.stats = torch.empty(b, h, s, 1, device="cuda", dtype=torch.float32)
        self.dq, self.dk, self.dv = (torch.empty(b, s, n, d, **out) for n in (h, hkv, hkv))
        fp8_out = self.o_dtype == E4M3  # then O and the gradients take scales from the reference's amaxes
        o_scale, dq_scale, dk_scale, dv_scale = (self.out_scales[n] if fp8_out else 1.0
                                                 for n in ("o", "dq", "dk", "dv"))
        self.fwd_pack = {
            _Fwd.q: c["q"], _Fwd.k: c["k"], _Fwd.v: c["v"], _Fwd.o: self.o, _Fwd.stats: self.stats,
            _Fwd.q_descale: _scalar(1 / sc["q"]), _Fwd.k_descale: _scalar(1 / sc["k"]),
            _Fwd.v_descale: _scalar(1 / sc["v"]), _Fwd.s_descale: _scalar(1 / self.s_scale),
            _Fwd.s_scale: _scalar(self.s_scale), _Fwd.o_scale: _scalar(o_scale),
            _Fwd.s_amax: _scalar(0.0), _Fwd.o_amax: _scalar(0.0)}
        self.bwd_pack = {
            _Bwd.q: c["q"], _Bwd.k: c["k"], _Bwd.v: c["v"], _Bwd.o: self.o, _Bwd.dO: c["dO"], _Bwd.stats: self.stats,
            _Bwd.q_descale: _scalar(1 / sc["q"]), _Bwd.k_descale: _scalar(1 / sc["k"]),
            _Bwd.v_descale: _scalar(1 / sc["v"]), _Bwd.o_descale: _scalar(1 / o_scale),
            _Bwd.dO_descale: _scalar(1 / sc["dO"]), _Bwd.s_descale: _scalar(1 / self.s_scale),
            _Bwd.dP_descale: _scalar(1 / self.dP_scale), _Bwd.s_scale: _scalar(self.s_scale),
            _Bwd.dQ_scale: _scalar(dq_scale), _Bwd.dK_scale: _scalar(dk_scale), _Bwd.dV_scale: _scalar(dv_scale),
            _Bwd.dP_scale: _scalar(self.dP_scale), _Bwd.dQ: self.dq, _Bwd.dK: self.dk, _Bwd.dV: self.dv,
            _Bwd.dQ_amax: _scalar(0.0), _Bwd.dK_amax: _scalar(0.0), _Bwd.dV_amax: _scalar(0.0),
            _Bwd.dP_amax: _scalar(0.0)}
        self.fwd_pack = {int(key): val for key, val in self.fwd_pack.items()}
        self.bwd_pack = {int(key): val for key, val in self.bwd_pack.items()}
        self.fwd_ws = torch.empty(self.fwd.get_workspace_size(), device="cuda", dtype=torch.uint8)
        self.bwd_ws = torch.empty(self.bwd.get_workspace_size(), device="cuda", dtype=torch.uint8)

    def calibrate(self) -> dict:
        """Delayed scaling's second step, as a framework runs it: one fwd+bwd, then dP's scale set from
        the amax cuDNN reports for it (it scales dS = P∘(dP − D), whose values are far below dP's own
        at long sequences). Returns the amaxes cuDNN reported."""
        self.forward_backward()
        torch.cuda.synchronize()
        reported = {name: self.bwd_pack[int(uid)].item() for name, uid in
                    (("dP", _Bwd.dP_amax), ("dQ", _Bwd.dQ_amax), ("dK", _Bwd.dK_amax), ("dV", _Bwd.dV_amax))}
        self.dP_scale = fp8_scale(reported["dP"])
        self.bwd_pack[int(_Bwd.dP_scale)].fill_(self.dP_scale)
        self.bwd_pack[int(_Bwd.dP_descale)].fill_(1 / self.dP_scale)
        self.reported_amax = reported
        return reported

    def forward(self) -> None:
        self.fwd.execute(self.fwd_pack, self.fwd_ws, handle=self.handle)

    def backward(self) -> None:
        self.bwd.execute(self.bwd_pack, self.bwd_ws, handle=self.handle)

    def forward_backward(self) -> None:
        self.forward()
        self.backward()

    def runner(self, mode: str):
        """The zero-argument callable that ``mode`` (fwd, bwd, fwdbwd) times; bwd runs the forward once first."""
        if mode == "bwd":
            self.forward()
        return {"fwd": self.forward, "bwd": self.backward, "fwdbwd": self.forward_backward}[mode]

    def _reference(self) -> dict:
        """O and the gradients of float32 attention on the bf16 inputs, (B, H, S, D) each: the scales of
        FP8 outputs come from their amaxes, and :meth:`errors` compares with them."""
        q, k, v = (t.detach().float().requires_grad_() for t in (self.q, self.k, self.v))
        groups = q.shape[1] // k.shape[1]
        o = torch.nn.functional.scaled_dot_product_attention(
            q, k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1), is_causal=self.causal,
            scale=self.attn_scale)
        o.backward(self.dout.float())
        return {"o": o.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}

    def outputs(self) -> dict:
        """One fwd+bwd; O and the gradients as float32 (B, H, S, D) / (B, Hkv, S, D) of the inputs' scale.
        cuDNN dequantizes its inputs with the descales it is given and multiplies its outputs by their
        scales (1 for bf16 outputs): dividing by those undoes them."""
        self.forward_backward()
        torch.cuda.synchronize()
        fp8_out = self.o_dtype == E4M3
        found = {"o": self.o, "dq": self.dq, "dk": self.dk, "dv": self.dv}
        return {name: t.float().transpose(1, 2) / (self.out_scales[name] if fp8_out else 1.0)
                for name, t in found.items()}

    def errors(self) -> dict:
        """Relative errors (Frobenius) of O, dQ, dK and dV against float32 attention on the same inputs,
        and the dP amaxes behind dP's scale (the first head's, and the one cuDNN reported)."""
        out = {"dP_amax_first_head": self.dP_first_head, "dP_amax_reported": self.reported_amax["dP"]}
        for name, got in self.outputs().items():
            ref = self.reference[name]
            out[f"{name}_rel_err"] = ((got - ref).norm() / ref.norm()).item()
        return out

    def close(self) -> None:
        self.cudnn.destroy_handle(self.handle)


__all__ = ["CudnnFp8Attention", "CudnnFp8Refused", "available", "fp8_scale"]
