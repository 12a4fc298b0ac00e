"""The flash-attn package: FA3 (``flash_attn_interface``, Hopper) and FA2 (``flash_attn``),
whichever passes its self-check here, FA3 first. Imported lazily, on the first call that
could use it.

Both generations may be installed, and an FA3 build can fail where FA2 works (a GPU it
was not built for, a release whose functions want arguments usp does not know), so the
backend does not stop at the first import that succeeds: for each (device, dtype,
head_dim, packed or not) it self-checks FA3, then FA2, and runs the first that passes,
logging which (``label()`` says it too). Only when every installed generation fails is
the backend reported unsupported, with each generation's reason.

The low-level functions that return the LSE and take an external out/LSE changed their
signatures across releases (window as a tuple or two ints, ``causal`` or ``is_causal``,
FA2 < 2.7 also returning q/k/v, FA3 adding paged-KV, rotary and FP8 arguments). They are
called here by keyword, with the arguments each release names, read from its signature;
arguments for features usp does not use get their neutral value. This backend has not
yet been run on a GPU by the usp tests (no flash-attn wheel on our machines).

Another way to get FA3 kernels: on torch >= 2.11,
``torch.nn.attention.activate_flash_attention_impl("FA3")`` swaps the kernels behind
usp's ``flash`` backend.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import inspect
import logging
import warnings
from dataclasses import dataclass

import torch

from usp.kernels.backends.base import Backend, BackendFailure, Grads, SelfCheck
from usp.kernels.backends.cuda_common import CudaBackend, empty_rows_to_neg_inf
from usp.kernels.masks import lse_for_backward
from usp.kernels.selfcheck import spec_verdict
from usp.kernels.spec import AttentionSpec, BackendUnavailableError

logger = logging.getLogger("usp.kernels")


@dataclass(frozen=True)
class FlashAttnApi:
    """One generation of the package's low-level functions."""

    name: str  # "FA3" or "FA2"
    module: str  # where the functions come from
    forward: object
    backward: object
    varlen_forward: object
    varlen_backward: object


def is_installed() -> bool:
    """Whether any generation of flash-attn is importable (without importing it)."""
    return any(
        importlib.util.find_spec(name) is not None
        for name in ("flash_attn_interface", "flash_attn")
    )


@functools.cache
def candidate_apis() -> tuple[FlashAttnApi, ...]:
    """The installed generations, FA3 first. An import that fails is logged and skipped."""
    apis = []
    try:
        fa3 = importlib.import_module("flash_attn_interface")
        if hasattr(fa3, "_flash_attn_forward") and hasattr(fa3, "_flash_attn_backward"):
            # FA3 handles dense and packed calls in one function
            fwd, bwd = fa3._flash_attn_forward, fa3._flash_attn_backward
            apis.append(FlashAttnApi("FA3", "flash_attn_interface", fwd, bwd, fwd, bwd))
    except Exception as err:  # ImportError, or a broken build failing at import
        logger.info("flash-attn FA3 (flash_attn_interface) not usable: %r", err)
    try:
        fa2 = importlib.import_module("flash_attn.flash_attn_interface")
        apis.append(
            FlashAttnApi(
                "FA2",
                "flash_attn.flash_attn_interface",
                fa2._flash_attn_forward,
                fa2._flash_attn_backward,
                fa2._flash_attn_varlen_forward,
                fa2._flash_attn_varlen_backward,
            )
        )
    except Exception as err:
        logger.info("flash-attn FA2 (flash_attn.flash_attn_interface) not usable: %r", err)
    return tuple(apis)


def _call(fn, values: dict):
    """Call ``fn`` with the keyword arguments its signature names, from ``values``."""
    # flash-attn >= 2.7 wraps these in torch.library custom ops; read the wrapped function
    params = inspect.signature(getattr(fn, "_init_fn", fn)).parameters
    missing = [
        n for n, p in params.items() if n not in values and p.default is inspect.Parameter.empty
    ]
    if missing:
        name = getattr(fn, "__name__", repr(fn))
        raise TypeError(
            f"{getattr(fn, '__module__', '?')}.{name} needs arguments usp does not know: {missing}"
        )
    return fn(**{n: values[n] for n in params if n in values})


# Arguments of features usp does not use (paged KV, KV-cache append, rotary, FP8 scales,
# split-KV scheduling), at the value that switches them off: some FA3 releases declare
# them without defaults.
_UNUSED_FEATURES = {
    "k_new": None, "v_new": None, "qv": None, "out_": None, "cu_seqlens_k_new": None,
    "page_table": None, "kv_batch_idx": None, "leftpad_k": None, "rotary_cos": None,
    "rotary_sin": None, "seqlens_rotary": None, "q_descale": None, "k_descale": None,
    "v_descale": None, "attention_chunk": 0, "rotary_interleaved": True,
    "scheduler_metadata": None, "num_splits": 1, "pack_gqa": None, "sm_margin": 0,
    "block_table": None, "zero_tensors": False,
}  # fmt: skip


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
    # FA2 < 2.7 returns (out, q, k, v, out_padded, lse, S_dmask, rng_state); later
    # FA2 (out, lse, S_dmask, rng_state) and FA3 (out, lse, out_accum, lse_accum)
    return (result[0], result[5]) if len(result) == 8 else (result[0], result[1])


def _packing(cu_q=None, cu_k=None, max_q=None, max_k=None) -> dict:
    """Document boundaries (None for dense calls), under every name the releases use."""
    return {
        "cu_seqlens_q": cu_q, "cu_seqlens_k": cu_k, "max_seqlen_q": max_q, "max_seqlen_k": max_k,
        "seqused_q": None, "seqused_k": None, "sequed_q": None, "sequed_k": None,
    }  # fmt: skip


def _forward(fn, q, k, v, spec, scale, packing):
    values = {**_UNUSED_FEATURES, "q": q, "k": k, "v": v, "out": None, **packing}
    out, lse = _out_and_lse(_call(fn, {**values, **_options(spec, scale)}))
    return out, empty_rows_to_neg_inf(lse)


def _backward(fn, dout, q, k, v, out, lse, spec, scale, packing) -> Grads:
    # the backward writes into the dq/dk/dv buffers it is given
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    values = {
        **_UNUSED_FEATURES, "dout": dout.contiguous(), "q": q, "k": k, "v": v,
        "out": out.contiguous(), "softmax_lse": lse_for_backward(lse).contiguous(),
        "dq": dq, "dk": dk, "dv": dv, **packing, **_options(spec, scale),
    }  # fmt: skip
    _call(fn, values)
    return dq, dk, dv


class FlashAttnVariant(Backend):
    """One generation of flash-attn as a backend: what the self-check vets."""

    device_types = ("cuda",)
    bottom_right_causal = True
    supports_window = True
    supports_varlen = True

    def __init__(self, api: FlashAttnApi):
        self.api = api
        self.name = f"flash_attn[{api.name}]"

    def forward(self, q, k, v, spec, scale):
        return _forward(self.api.forward, q, k, v, spec, scale, _packing())

    def backward(self, dout, q, k, v, out, lse, spec, scale) -> Grads:
        return _backward(self.api.backward, dout, q, k, v, out, lse, spec, scale, _packing())

    def varlen_forward(self, q, k, v, cu_q, cu_k, max_q, max_k, spec, scale):
        packing = _packing(cu_q, cu_k, max_q, max_k)
        return _forward(self.api.varlen_forward, q, k, v, spec, scale, packing)

    def varlen_backward(
        self, dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, spec, scale
    ) -> Grads:
        packing = _packing(cu_q, cu_k, max_q, max_k)
        return _backward(self.api.varlen_backward, dout, q, k, v, out, lse, spec, scale, packing)


def choose_variant(
    apis, spec: AttentionSpec, chosen: dict, check: SelfCheck = spec_verdict
) -> FlashAttnVariant | BackendFailure:
    """The first generation in ``apis`` that passes its self-check (``check``) for this
    call's (device, dtype, head_dim, packed or not), remembered in ``chosen``; else a
    failure naming every generation's reason."""
    device = spec.device
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    key = (device, spec.dtype, spec.head_dim, spec.varlen)
    if key in chosen:
        return chosen[key]
    reasons = []
    for api in apis:
        variant = FlashAttnVariant(api)
        reason = check(variant, spec)
        if reason is None:
            chosen[key] = variant
            where = f"{device}, {spec.dtype}, head_dim={spec.head_dim}" + (
                ", packed" if spec.varlen else ""
            )
            logger.info("flash_attn runs %s (%s) on %s", api.name, api.module, where)
            if reasons:  # an earlier generation is installed but broken here: say so
                message = f"flash_attn runs {api.name} on {where}: " + "; ".join(
                    f"{failed.name} ({failed.module}) {why}" for failed, why in reasons
                )
                logger.warning(message)
                warnings.warn(message, RuntimeWarning, stacklevel=2)
            return variant
        reasons.append((api, reason))
    return BackendFailure.of(
        "; ".join(f"with {api.name} ({api.module}) {reason}" for api, reason in reasons),
        transient=any(getattr(reason, "transient", False) for _, reason in reasons),
    )


class FlashAttnBackend(CudaBackend):
    name = "flash_attn"
    bottom_right_causal = True
    supports_window = True
    supports_varlen = True

    def __init__(self):
        # (device, dtype, head_dim, varlen) -> the generation that passed its self-check
        self._chosen: dict[tuple, FlashAttnVariant] = {}

    def limits_reason(self, spec):
        if not is_installed():
            where = "" if spec.device.type == "cuda" else " and a CUDA device"
            return f"needs the flash_attn package (pip install 'usp[flash-attn]'){where}, which is not installed"
        if spec.device.type == "cuda" and not candidate_apis():
            return BackendFailure(
                "has the flash_attn package installed but neither FA3 (flash_attn_interface) "
                "nor FA2 (flash_attn.flash_attn_interface) imports (see the usp.kernels log)"
            )
        return super().limits_reason(spec)

    def vet(self, spec, check):
        chosen = choose_variant(candidate_apis(), spec, self._chosen, check)
        return chosen if isinstance(chosen, str) else None

    def _variant(self, spec) -> FlashAttnVariant:
        chosen = choose_variant(candidate_apis(), spec, self._chosen)
        if isinstance(chosen, str):
            raise BackendUnavailableError(f"attention backend 'flash_attn' cannot run: it {chosen}")
        return chosen

    def label(self, spec) -> str:
        chosen = choose_variant(candidate_apis(), spec, self._chosen)
        return f"flash_attn ({chosen.api.name})" if not isinstance(chosen, str) else self.name

    def forward(self, q, k, v, spec, scale):
        return self._variant(spec).forward(q, k, v, spec, scale)

    def backward(self, dout, q, k, v, out, lse, spec, scale) -> Grads:
        return self._variant(spec).backward(dout, q, k, v, out, lse, spec, scale)

    def varlen_forward(self, q, k, v, cu_q, cu_k, max_q, max_k, spec, scale):
        return self._variant(spec).varlen_forward(q, k, v, cu_q, cu_k, max_q, max_k, spec, scale)

    def varlen_backward(
        self, dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, spec, scale
    ) -> Grads:
        return self._variant(spec).varlen_backward(
            dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, spec, scale
        )
