"""The flash-attn package: FA3 (``flash_attn_interface``, Hopper) when installed, else
FA2 (``flash_attn``). Imported lazily, on the first call that could use it.

The low-level functions that return the LSE and take an external out/LSE changed their
signatures across releases (window as a tuple or two ints, ``causal`` or ``is_causal``,
FA2 < 2.7 also returning q/k/v). They are called here by keyword, with the arguments
each release names, read from its signature. This backend has not yet been run on a
GPU by the usp tests (no flash-attn wheel on our machines); the run-time self-check
(``selfcheck.py``) vets it before ``auto`` or an explicit request uses it.

Another way to get FA3 kernels: on torch >= 2.11,
``torch.nn.attention.activate_flash_attention_impl("FA3")`` swaps the kernels behind
usp's ``flash`` backend.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import inspect
from dataclasses import dataclass

import torch

from usp.kernels.backends.base import Grads
from usp.kernels.backends.sdpa_cuda import _CudaBackend, _empty_rows_to_neg_inf
from usp.kernels.masks import lse_for_backward


@dataclass(frozen=True)
class _Api:
    name: str  # "FA3" or "FA2"
    forward: object
    backward: object
    varlen_forward: object
    varlen_backward: object


@functools.cache
def _api() -> _Api | None:
    try:
        fa3 = importlib.import_module("flash_attn_interface")
        if hasattr(fa3, "_flash_attn_forward") and hasattr(fa3, "_flash_attn_backward"):
            # FA3 handles dense and packed calls in one function
            return _Api(
                "FA3",
                fa3._flash_attn_forward,
                fa3._flash_attn_backward,
                fa3._flash_attn_forward,
                fa3._flash_attn_backward,
            )
    except ImportError:
        pass
    try:
        fa2 = importlib.import_module("flash_attn.flash_attn_interface")
    except ImportError:
        return None
    return _Api(
        "FA2",
        fa2._flash_attn_forward,
        fa2._flash_attn_backward,
        fa2._flash_attn_varlen_forward,
        fa2._flash_attn_varlen_backward,
    )


def _call(fn, values: dict):
    """Call ``fn`` with the keyword arguments its signature names, from ``values``."""
    # flash-attn >= 2.7 wraps these in torch.library custom ops; read the wrapped function
    params = inspect.signature(getattr(fn, "_init_fn", fn)).parameters
    missing = [
        n for n, p in params.items() if n not in values and p.default is inspect.Parameter.empty
    ]
    if missing:
        raise TypeError(
            f"{fn.__module__}.{fn.__name__} needs arguments usp does not know: {missing}"
        )
    return fn(**{n: values[n] for n in params if n in values})


def _options(spec, scale) -> dict:
    left = -1 if spec.window is None else spec.window
    right = 0 if spec.causal else -1
    return {
        "dropout_p": 0.0,
        "softmax_scale": scale,
        "causal": spec.causal,
        "is_causal": spec.causal,
        "window_size": (left, right),
        "window_size_left": left,
        "window_size_right": right,
        "softcap": 0.0,
        "alibi_slopes": None,
        "return_softmax": False,
        "deterministic": False,
        "rng_state": None,
    }


def _out_and_lse(result):
    # FA2 < 2.7 returns (out, q, k, v, out_padded, lse, S_dmask, rng_state); later (out, lse, ...)
    return (result[0], result[5]) if len(result) == 8 else (result[0], result[1])


def _packing(cu_q=None, cu_k=None, max_q=None, max_k=None) -> dict:
    """Document boundaries (None for dense calls), under every name the releases use."""
    return {
        "cu_seqlens_q": cu_q, "cu_seqlens_k": cu_k, "max_seqlen_q": max_q, "max_seqlen_k": max_k,
        "seqused_q": None, "seqused_k": None, "sequed_q": None, "sequed_k": None,
    }  # fmt: skip


def _forward(fn, q, k, v, spec, scale, packing):
    values = {"q": q, "k": k, "v": v, **packing, **_options(spec, scale)}
    out, lse = _out_and_lse(_call(fn, values))
    return out, _empty_rows_to_neg_inf(lse)


def _backward(fn, dout, q, k, v, out, lse, spec, scale, packing) -> Grads:
    # the backward writes into the dq/dk/dv buffers it is given
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    values = {
        "dout": dout.contiguous(), "q": q, "k": k, "v": v, "out": out.contiguous(),
        "softmax_lse": lse_for_backward(lse).contiguous(), "dq": dq, "dk": dk, "dv": dv,
        **packing, **_options(spec, scale),
    }  # fmt: skip
    _call(fn, values)
    return dq, dk, dv


class FlashAttnBackend(_CudaBackend):
    name = "flash_attn"
    bottom_right_causal = True
    supports_window = True
    supports_varlen = True

    def unsupported_reason(self, spec):
        if spec.device.type == "cuda" and _api() is None:
            return "needs the flash_attn package (pip install 'usp[flash-attn]'), which is not installed"
        if spec.device.type != "cuda" and importlib.util.find_spec("flash_attn") is None:
            return "needs the flash_attn package (pip install 'usp[flash-attn]') and a CUDA device"
        return super().unsupported_reason(spec)

    def forward(self, q, k, v, spec, scale):
        return _forward(_api().forward, q, k, v, spec, scale, _packing())

    def backward(self, dout, q, k, v, out, lse, spec, scale) -> Grads:
        return _backward(_api().backward, dout, q, k, v, out, lse, spec, scale, _packing())

    def varlen_forward(self, q, k, v, cu_q, cu_k, max_q, max_k, spec, scale):
        packing = _packing(cu_q, cu_k, max_q, max_k)
        return _forward(_api().varlen_forward, q, k, v, spec, scale, packing)

    def varlen_backward(
        self, dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, spec, scale
    ) -> Grads:
        packing = _packing(cu_q, cu_k, max_q, max_k)
        return _backward(_api().varlen_backward, dout, q, k, v, out, lse, spec, scale, packing)
