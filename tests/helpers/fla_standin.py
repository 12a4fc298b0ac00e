"""CPU stand-ins for the usp[fla] kernels, ``causal_conv1d_fn`` (causal-conv1d 1.7; at the
end) and fla's ``chunk_gated_delta_rule`` (fla-core 0.6): its documented
signature and argument rules, computed by usp's torch kernel, so that the mapping of
``usp.linear.backends.FlaGdnKernel`` onto fla's arguments is tested without a GPU.

fla's rules it enforces (from the function's docstring and checks): q, k [B, T, H, K] with
the same heads, v [B, T, HV, V] with HV a multiple of H, g and beta [B, T, HV];
``cu_seqlens`` a LongTensor on q's device with B == 1 and one initial state per sequence
([N, HV, K, V]), else one per batch row; chunk size 16, 32 or 64; ``scale`` None means
K ** -0.5; returns o in q's dtype and the final states in float32 (or None).

``defect`` makes it wrong in one way, for the self-check's tests.
"""

from __future__ import annotations

import torch

from usp.linear.backends import FlaGdnKernel
from usp.linear.conv import CausalConv1dKernel
from usp.linear.kernel import chunk_gated_delta_rule as torch_kernel

DEFECTS = ("drops initial_state", "ignores scale", "detaches the final state", "one sequence")


class FlaStandIn:
    """Callable as fla's function; records each call's arguments in ``calls``."""

    def __init__(self, defect: str | None = None):
        assert defect is None or defect in DEFECTS, defect
        self.defect = defect
        self.calls: list[dict] = []

    def __call__(
        self, q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
        use_qk_l2norm_in_kernel=False, use_beta_sigmoid_in_kernel=False,
        allow_neg_eigval=False, state_v_first=False, cu_seqlens=None, cu_seqlens_cpu=None,
        chunk_indices=None, cp_context=None, **kwargs,
    ):  # fmt: skip
        chunk_size = kwargs.pop("chunk_size", 64)
        assert not kwargs, f"fla's function does not read {sorted(kwargs)}"
        self.calls.append(
            {"q": q, "k": k, "v": v, "g": g, "beta": beta, "scale": scale,
             "initial_state": initial_state, "cu_seqlens": cu_seqlens,
             "cu_seqlens_cpu": cu_seqlens_cpu, "chunk_size": chunk_size,
             "output_final_state": output_final_state}
        )  # fmt: skip
        if q.shape[2] != k.shape[2] or v.shape[2] % q.shape[2]:
            raise ValueError("q and k must have the same heads; HV a multiple of H")
        if chunk_size not in (16, 32, 64):
            raise ValueError(f"`chunk_size` must be 16, 32, or 64, got {chunk_size}")
        sequences = q.shape[0]
        if cu_seqlens is not None:
            if q.shape[0] != 1:
                raise ValueError("The batch size is expected to be 1 when using `cu_seqlens`")
            if cu_seqlens.dtype != torch.int64 or cu_seqlens.device != q.device:
                raise ValueError("cu_seqlens must be a LongTensor on q's device")
            sequences = len(cu_seqlens) - 1
        if initial_state is not None and initial_state.shape[0] != sequences:
            raise ValueError(f"{sequences} initial states expected, got {initial_state.shape[0]}")
        if self.defect == "drops initial_state":
            initial_state = None
        if self.defect == "ignores scale":
            scale = None
        if self.defect == "one sequence":
            cu_seqlens = None
            initial_state = None if initial_state is None else initial_state[:1]
        o, final = torch_kernel(
            q, k, v, g, beta, scale=q.shape[-1] ** -0.5 if scale is None else scale,
            initial_state=None if initial_state is None else initial_state.float()
            if q.dtype != torch.float64 else initial_state,
            output_final_state=output_final_state, cu_seqlens=cu_seqlens,
            use_qk_l2norm=use_qk_l2norm_in_kernel, chunk_size=chunk_size,
        )  # fmt: skip
        if self.defect == "one sequence" and final is not None:
            final = final.expand(sequences, *final.shape[1:])
        if self.defect == "detaches the final state" and final is not None:
            final = final.detach()
        if final is not None and q.dtype != torch.float64:
            final = final.float()
        return o.to(q.dtype), final


def standin_kernel(defect=None, *, float64=True) -> FlaGdnKernel:
    """usp's fla kernel calling a stand-in, allowed on the CPU (and in float64, which fla
    itself does not run, so that distributed tests keep their float64 tolerances)."""
    dtypes = (torch.float32, torch.bfloat16, torch.float16) + ((torch.float64,) if float64 else ())
    return FlaGdnKernel(FlaStandIn(defect), device_types=("cpu",), dtypes=dtypes)


CONV_DEFECTS = ("drops initial_states", "ignores activation")


class CausalConv1dStandIn:
    """Callable as ``causal_conv1d.causal_conv1d_fn``; enforces its checks on the path usp
    takes (initial states need the channel-last layout: x and initial_states with
    stride(1) == 1, channels a multiple of 8; initial_states in x's dtype; width 2 to 4)
    and computes with F.conv1d. Records calls in ``calls``."""

    def __init__(self, defect: str | None = None, channel_multiple: int = 8):
        assert defect is None or defect in CONV_DEFECTS, defect
        self.defect = defect
        self.channel_multiple = channel_multiple
        self.calls: list[dict] = []

    def __call__(self, x, weight, bias=None, seq_idx=None, initial_states=None,
                 return_final_states=False, final_states_out=None, activation=None):  # fmt: skip
        self.calls.append({"x": x, "weight": weight, "initial_states": initial_states,
                           "activation": activation, "bias": bias, "seq_idx": seq_idx})  # fmt: skip
        batch, dim, _ = x.shape
        width = weight.shape[1]
        if weight.shape != (dim, width) or not 2 <= width <= 4:
            raise RuntimeError("weight must be (dim, width) with width between 2 and 4")
        if activation not in (None, "silu", "swish"):
            raise NotImplementedError("activation must be None, silu, or swish")
        if initial_states is not None:
            if x.stride(1) != 1 or initial_states.stride(1) != 1 or dim % self.channel_multiple:
                raise RuntimeError("initial_states is only supported for channel last layout")
            if initial_states.dtype != x.dtype or initial_states.shape != (batch, dim, width - 1):
                raise RuntimeError("initial_states must be (batch, dim, width - 1) in x's dtype")
        if self.defect == "drops initial_states":
            initial_states = None
        if initial_states is None:
            initial_states = x.new_zeros(batch, dim, width - 1)
        full = torch.cat([initial_states, x], dim=-1)
        bias = None if bias is None else bias.to(x.dtype)
        out = torch.nn.functional.conv1d(full, weight.to(x.dtype)[:, None], bias, groups=dim)
        if activation in ("silu", "swish") and self.defect != "ignores activation":
            out = torch.nn.functional.silu(out)
        return out.to(x.dtype)


def standin_conv_kernel(defect=None, channel_multiple=8) -> CausalConv1dKernel:
    """usp's causal-conv1d kernel calling a stand-in, allowed on the CPU and in float64
    (``channel_multiple`` below 8 lets tiny distributed cases through; the real rule is
    tested on its own)."""
    dtypes = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
    function = CausalConv1dStandIn(defect, channel_multiple)
    return CausalConv1dKernel(
        function, device_types=("cpu",), dtypes=dtypes, channel_multiple=channel_multiple
    )
