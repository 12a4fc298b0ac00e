"""The optional arguments of a USP attention call (``sinks``, ``window``), and what the SP
ranks agree on of a call before its first collective.

A rank checks its own call (:mod:`usp.sp.attend`); the ranks then agree on
:func:`attention_fields` in the one exchange :func:`usp.comm.call_check.checked_call`
makes: the shapes of q, k and v, their dtype, the options, the documents, which inputs
require grad, and the sinks' values (a rank with other sinks would compute other
outputs and gradients without any error). Where the ranks differ, every rank raises the
same error naming the argument, before any data moves.
"""

from __future__ import annotations

import torch

from usp.comm.agreement import Field, float_bits, stable_hash
from usp.comm.call_check import call_fields, documents_field, grad_field
from usp.kernels.spec import AttentionInputError
from usp.options import BACKENDS, LAYOUTS, RING_IMPLS

#: the inputs whose need of gradients the ranks agree on, in the order of the grad mask
GRAD_INPUTS = ("q", "k", "v", "sinks")


def check_sinks(sinks, spec) -> None:
    """``sinks``: None, or a floating-point tensor [H] (one logit per query head) on q's
    device."""
    if sinks is None:
        return
    if not isinstance(sinks, torch.Tensor) or not sinks.is_floating_point():
        what = sinks.dtype if isinstance(sinks, torch.Tensor) else type(sinks).__name__
        raise AttentionInputError(f"sinks must be a floating-point tensor [num_heads], got {what}")
    if tuple(sinks.shape) != (spec.num_heads,):
        raise AttentionInputError(
            f"sinks must have shape [num_heads] = [{spec.num_heads}] (one logit per query "
            f"head, all heads on every rank), got {tuple(sinks.shape)}"
        )
    if sinks.device != spec.device:
        raise AttentionInputError(f"sinks must be on q's device {spec.device}, got {sinks.device}")


def check_window(window, causal) -> None:
    """``window``: None, or an int >= 1 with ``causal=True``."""
    if window is None:
        return
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise AttentionInputError(
            f"window must be None (full attention) or an int >= 1 (keys i-window+1 .. i), "
            f"got {window!r}"
        )
    if causal is not True:
        raise AttentionInputError(
            f"window={window} needs causal=True: usp computes sliding windows of causal "
            "attention only (keys i-window+1 .. i)"
        )


def kernel_window(window: int | None, longest: int) -> int | None:
    """transformers' ``sliding_window`` W (keys i-W+1 .. i) as the kernels' left window
    (W - 1 keys before the query's own); None when no document is longer than W keys
    (the window changes nothing: plain causal attention)."""
    if window is None or window >= longest:
        return None
    return window - 1


def attention_fields(
    plan, q, k, v, *, causal, softmax_scale, packed, head_chunks, grad: int, sinks, window,
    compiled: bool, partial=None,
) -> list[Field]:  # fmt: skip
    """What the SP ranks agree on of a call (robust to invalid inputs: they show as -1).
    ``softmax_scale`` as the user gave it; ``packed``: the call's PackedSequence or None;
    ``grad``: :func:`usp.comm.call_check.grad_mask` of (q, k, v, sinks); ``compiled``:
    the tensors are stand-ins of a traced graph (no values: the sinks' values are then
    graph inputs, not compared); ``partial``: the call's (out, lse) merged in, or None."""
    options = {
        "layout": (plan.layout, LAYOUTS),
        "ring_impl": (plan.ring_impl, RING_IMPLS),
        "backend": (plan.backend, BACKENDS),
    }
    documents = documents_field(None if packed is None else packed.bounds)
    chunks = head_chunks if type(head_chunks) is int else -1
    window_code = -1 if window is None else window if type(window) is int else -2
    return [
        *call_fields(
            q, k, v, causal=causal, softmax_scale=softmax_scale, options=options,
            documents=documents, grad=grad_field(grad, GRAD_INPUTS),
        ),
        Field("head_chunks", chunks),
        Field("sinks", _sinks_code(sinks), _show_sinks),
        _sinks_values(sinks, compiled),
        Field("window", window_code, _show_window),
        Field("partial", _partial_code(partial), _show_partial),  # more keys' rows merged
    ]  # fmt: skip


def _partial_code(partial) -> int:
    """What the ranks agree on of ``partial``: absent (0) or given (1). Whether its
    tensors require grad may differ (a rank whose rows see no more keys passes constants):
    its backward sends nothing."""
    return int(partial is not None)


def _show_partial(code: int) -> str:
    return {0: "none", 1: "given"}.get(code, str(code))


def _sinks_code(sinks) -> int:
    """What the ranks agree on of ``sinks``' form: absent (0), given as a tensor (its
    length + 1), or something else (-1)."""
    if sinks is None:
        return 0
    return sinks.numel() + 1 if isinstance(sinks, torch.Tensor) else -1


def _sinks_values(sinks, compiled: bool) -> Field:
    """The sinks' values (one host read of H numbers; the per-call agreement runs on
    gloo, or where ``verify=True`` asks for it)."""
    name = "the values of sinks (every rank must pass the same sinks)"
    if compiled or not isinstance(sinks, torch.Tensor) or not sinks.is_floating_point():
        return Field(name, 0)
    values = sinks.detach().to("cpu", torch.float64).flatten().tolist()
    code = stable_hash([float_bits(x) for x in values])
    return Field(name, code, lambda h: f"hash {h}", _values_text(values, code))


def _values_text(values: list[float], code: int, most: int = 8) -> str:
    shown = ", ".join(repr(x) for x in values[:most])
    if len(values) <= most:
        return f"[{shown}]"
    return f"[{shown}, ... ({len(values)} values, hash {code & 0xFFFFFFFF:08x})]"


def _show_window(code: int) -> str:
    return {-2: "not an int", -1: "none"}.get(code, str(code))


def _show_sinks(code: int) -> str:
    return {0: "none", -1: "not a tensor"}.get(code, f"{code - 1} logits")
