"""What a :func:`usp.linear.gated_deltanet_usp` call must be, checked on each rank, and
what its SP ranks agree on before the first collective.

:func:`check_inputs` refuses, with the argument named and the fix, what the kernels
would fail on deep inside (or compute wrongly): tensors of the wrong kind or shape,
non-finite scales, booleans for integers, conv weights of the wrong form.
:func:`agreed_fields` is the call's fingerprint for :func:`usp.comm.agreement.agree`:
the shapes, the dtypes of q/k/v and of g/beta (one all-to-all per dtype: ranks that
differ would exchange messages of different sizes), the options, the documents, which
inputs require grad (a rank whose backward skips a reduce-scatter would leave its peers
waiting in it) and the kernels. A rank that differs makes every rank raise the same
error naming the field, with each rank's value.
"""

from __future__ import annotations

import math

import torch

from usp.comm.agreement import Field, float_bits, stable_hash
from usp.comm.call_check import documents_field, grad_field, grad_mask
from usp.errors import InputError
from usp.linear.backends import GDN_KERNELS
from usp.linear.conv import CONV_KERNELS
from usp.linear.heads import document_bounds, hashed

ACTIVATIONS = (None, "silu")
#: the inputs whose need of gradients the ranks agree on, in the order of the grad mask
GRAD_INPUTS = ("q", "k", "v", "g", "beta", "conv_weights[0]", "conv_weights[1]", "conv_weights[2]")
_DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float16)


class LinearAttentionError(InputError):
    """Inputs or options the Gated DeltaNet path cannot compute."""


def _describe(x) -> str:
    return f"a tensor {tuple(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__


def check_inputs(q, k, v, g, beta, conv_weights, activation, chunk_size, scale) -> None:
    """Raise :class:`LinearAttentionError` naming the argument for what cannot run."""
    named = {"q": q, "k": k, "v": v, "g": g, "beta": beta}
    wrong = [f"{n} is {_describe(t)}" for n, t in named.items() if not _is_float_tensor(t)]
    if wrong:
        raise LinearAttentionError(
            f"q, k, v, g and beta must be floating-point tensors; {', '.join(wrong)}"
        )
    if q.dim() != 4 or k.shape != q.shape or v.dim() != 4:
        raise LinearAttentionError(
            f"q and k must be [B, S, Hk, dk] of one shape and v [B, S, H, dv]; got q "
            f"{tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    if v.shape[:2] != q.shape[:2] or g.shape != v.shape[:3] or beta.shape != v.shape[:3]:
        raise LinearAttentionError(
            f"g and beta must be [B, S, H] = {tuple(v.shape[:3])} and q, v share [B, S]; got "
            f"g {tuple(g.shape)}, beta {tuple(beta.shape)}, q {tuple(q.shape)}"
        )
    if len({q.dtype, k.dtype, v.dtype}) != 1 or g.dtype != beta.dtype:
        raise LinearAttentionError(
            f"q, k, v must share a dtype and g, beta another; got {q.dtype}, {k.dtype}, "
            f"{v.dtype} and {g.dtype}, {beta.dtype}"
        )
    if v.shape[2] % q.shape[2]:
        raise LinearAttentionError(
            f"{v.shape[2]} value heads are not a multiple of {q.shape[2]} key heads"
        )
    if activation not in ACTIVATIONS:
        raise LinearAttentionError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise LinearAttentionError(
            f"chunk_size must be a positive int (the kernel's chunk length, e.g. 64), got "
            f"{chunk_size!r}"
        )
    if scale is not None and (
        isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale)
    ):
        raise LinearAttentionError(
            f"scale must be a finite number, or None for dk**-0.5 = {q.shape[3] ** -0.5:.4g}; "
            f"got {scale!r}"
        )
    if conv_weights is not None:
        _check_conv_weights(conv_weights, q, k, v)


def _is_float_tensor(x) -> bool:
    return isinstance(x, torch.Tensor) and x.is_floating_point()


def _check_conv_weights(conv_weights, q, k, v) -> None:
    expected = [q.shape[2] * q.shape[3], k.shape[2] * k.shape[3], v.shape[2] * v.shape[3]]
    ws = list(conv_weights) if isinstance(conv_weights, (list, tuple)) else None
    if ws is None or len(ws) != 3 or not all(_is_float_tensor(w) and w.dim() == 2 for w in ws):
        got = "" if ws is None else ", ".join(_describe(w) for w in ws)
        raise LinearAttentionError(
            f"conv_weights must be (wq, wk, wv), each a floating-point tensor [channels, "
            f"kernel] with channels {expected}; got {got or _describe(conv_weights)}"
        )
    got = [w.shape[0] for w in ws]
    kernels = {w.shape[1] for w in ws}
    if got != expected or len(kernels) != 1:
        raise LinearAttentionError(
            f"conv_weights must be [channels, kernel] with channels {expected} and one "
            f"kernel size; got {[tuple(w.shape) for w in ws]}"
        )
    if ws[0].shape[1] < 1:
        raise LinearAttentionError(
            f"conv_weights' kernel size must be >= 1 (Qwen3.5's is 4), got "
            f"{[tuple(w.shape) for w in ws]}; pass conv_weights=None for no conv"
        )


def inputs_grad_mask(q, k, v, g, beta, conv_weights) -> int:
    """:func:`usp.comm.call_check.grad_mask` of :data:`GRAD_INPUTS`."""
    ws = tuple(conv_weights) if isinstance(conv_weights, (list, tuple)) else ()
    return grad_mask(q, k, v, g, beta, *ws)


def conv_width(conv_weights) -> int:
    """The conv's kernel size as the ranks compare it (-1: no conv, or weights that
    :func:`check_inputs` refuses)."""
    if conv_weights is None:
        return -1
    first = conv_weights[0] if isinstance(conv_weights, (list, tuple)) and conv_weights else None
    return first.shape[1] if isinstance(first, torch.Tensor) and first.dim() == 2 else -2


def agreed_fields(
    tensors, conv_weights, activation, chunk_size, scale, use_qk_l2norm, documents, choices,
    grad: int,
) -> list[Field]:  # fmt: skip
    """What the SP ranks must agree on before the first collective (robust to invalid
    inputs). ``tensors``: q, k, v, g, beta; ``documents``: the call's Documents or None;
    ``choices``: (GDN kernel, conv kernel) names; ``grad``: the
    :func:`usp.comm.call_check.grad_mask` of :data:`GRAD_INPUTS`."""
    q, _, v, g, _ = tensors
    try:
        scale_bits = float_bits(-1.0 if scale is None else scale)
    except (TypeError, ValueError, OverflowError):
        scale_bits = -1
    options = (ACTIVATIONS.index(activation) if activation in ACTIVATIONS else -1,
               scale_bits, int(use_qk_l2norm) if isinstance(use_qk_l2norm, bool) else -1)  # fmt: skip
    chunk = chunk_size if type(chunk_size) is int else -1
    return [
        _shape_field("q shape", q),
        _shape_field("v shape", v),
        Field("dtype of q, k, v", _dtype_code(q), _show_dtype),
        Field("dtype of g, beta", _dtype_code(g), _show_dtype),
        Field("conv kernel size", conv_width(conv_weights)),
        Field("chunk_size", chunk),
        Field(
            "activation, scale, use_qk_l2norm",
            stable_hash(options),
            hashed,
            f"activation={activation!r}, scale={scale!r}, use_qk_l2norm={use_qk_l2norm!r}",
        ),  # fmt: skip
        documents_field(document_bounds(documents), "documents"),
        grad_field(grad, GRAD_INPUTS),
        _choice_field("GDN kernel (auto, torch or fla)", choices[0], GDN_KERNELS),
        _choice_field("conv kernel (auto, torch or causal_conv1d)", choices[1], CONV_KERNELS),
    ]


def _shape_field(name: str, x) -> Field:
    if not isinstance(x, torch.Tensor):
        return Field(name, -1, lambda _: "not a tensor")
    shape = tuple(x.shape)
    return Field(name, stable_hash(shape), hashed, str(shape))


def _dtype_code(x) -> int:
    dtype = getattr(x, "dtype", None)
    return _DTYPES.index(dtype) if dtype in _DTYPES else len(_DTYPES)


def _show_dtype(code: int) -> str:
    return str(_DTYPES[code]) if code < len(_DTYPES) else "not a float tensor"


def _choice_field(name: str, value, choices) -> Field:
    code = choices.index(value) if value in choices else -1
    return Field(name, code, lambda i: choices[i] if i >= 0 else "unknown")
