"""Check a distributed attention call before its first byte moves.

A call is validated locally (tensors, options, backend, scale, documents); then, when
``verify`` is on, the ranks of its group agree on a fingerprint of the call (see
:mod:`usp.comm.agreement`), so a bad input on one rank, or ranks that disagree, end in
the same clear error on every rank with the groups still usable.

``verify=None`` means: on for gloo groups and off for NCCL. On gloo the check is one
all-gather of ~20 int64 per call: 3.4 ms per call measured on 4 gloo ranks sharing 2
busy CPU cores (pure latency; small next to CPU attention). On NCCL the same all-gather
is ~10-30 us of latency, but reading its result is a device-to-host sync in every layer,
which stalls the launch queue and the compute/communication overlap; there the plan
agrees once per batch instead (``Plan.pack`` for packed documents, ``Plan.verify_batch``
for shapes and dtypes), and ``verify=True`` turns the per-call check on for debugging.
The choice depends only on the group's backend, which every rank shares, so no rank can
skip a check another rank makes. Inside a compiled graph the check (and the agreement)
runs once, while the graph is traced (:func:`usp.sp.attend.traced_call`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

import torch
import torch.distributed as dist

from usp.comm.agreement import Field, agree, bits_float, float_bits, stable_hash

T = TypeVar("T")

_DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16)


def verify_by_default(group) -> bool:
    """Per-call agreement on gloo, not on NCCL (host sync) or the fake backend."""
    return group is not None and dist.get_backend(group) == "gloo"


def _dtype_code(x) -> int:
    dtype = getattr(x, "dtype", None)
    return _DTYPES.index(dtype) if dtype in _DTYPES else -1


def _show_dtype(code: int) -> str:
    return str(_DTYPES[code]) if 0 <= code < len(_DTYPES) else "not a float tensor"


def _shape(x, ndim: int = 4) -> list[int]:
    shape = list(getattr(x, "shape", ()))[:ndim]
    return shape + [-1] * (ndim - len(shape))


def _choice(choices: Sequence[str]) -> tuple[Callable[[object], int], Callable[[int], str]]:
    def encode(value) -> int:
        return choices.index(value) if value in choices else -1

    def show(code: int) -> str:
        return repr(choices[code]) if 0 <= code < len(choices) else "an invalid value"

    return encode, show


def _show_scale(bits: int) -> str:
    return "default (head_dim**-0.5)" if bits == float_bits(-1.0) else repr(bits_float(bits))


def call_fields(
    q,
    k,
    v,
    *,
    causal,
    softmax_scale,
    options: dict[str, tuple[object, Sequence[str]]],
    documents: Field,
    grad: Field,
) -> list[Field]:
    """The fingerprint of an attention call; robust to invalid inputs (they show as -1).
    Shapes come first, so a rank whose tensors differ hears of its tensors, not of what
    the call derives from them (MLA's default scale follows v's head size).
    ``documents``: :func:`documents_field`; ``grad``: :func:`grad_field`."""
    fields = [
        *(Field(f"{name}.shape[{i}]", n) for name, t in (("q", q), ("k", k), ("v", v))
          for i, n in enumerate(_shape(t))),
        Field("dtype", _dtype_code(q), _show_dtype),
        Field("causal", int(causal) if isinstance(causal, bool) else -1),
    ]  # fmt: skip
    for name, (value, choices) in options.items():
        encode, show = _choice(choices)
        fields.append(Field(name, encode(value), show))
    try:
        scale = -1.0 if softmax_scale is None else float(softmax_scale)
    except (TypeError, ValueError):
        scale = float("nan")
    fields.append(Field("softmax_scale", float_bits(scale), _show_scale))
    return [*fields, documents, grad]


def documents_field(bounds: Sequence[int] | None, name: str = "documents (cu_seqlens)") -> Field:
    """The agreement entry of a call's packed documents: their boundaries' hash (0:
    dense), shown as the boundaries themselves when the ranks disagree."""
    if bounds is None:
        return Field(name, 0, lambda _: "dense", "dense")
    bounds = [int(b) for b in bounds]
    return Field(name, stable_hash(bounds), lambda h: f"hash {h}", bounds_text(bounds))


def bounds_text(bounds: Sequence[int], most: int = 12) -> str:
    """``cu_seqlens [0, 8, 32]`` (the first ``most`` boundaries and the count beyond)."""
    shown = ", ".join(map(str, bounds[:most]))
    more = f", ... ({len(bounds) - 1} documents, last boundary {bounds[-1]})"
    return f"cu_seqlens [{shown}{more if len(bounds) > most else ''}]"


def grad_mask(*tensors) -> int:
    """Bit ``i`` set when gradients are enabled and ``tensors[i]`` requires grad: which
    inputs a call's backward reads (the ranks' backwards make the same collectives, and
    sum the same gradients, only when this is the same everywhere)."""
    if not torch.is_grad_enabled():
        return 0
    return sum(
        1 << i for i, t in enumerate(tensors) if isinstance(t, torch.Tensor) and t.requires_grad
    )


def grad_field(mask: int, names: Sequence[str]) -> Field:
    """The agreement entry of :func:`grad_mask` over inputs called ``names``."""

    def show(value: int) -> str:
        named = [name for i, name in enumerate(names) if value >> i & 1]
        if not named:
            return "no grad"
        return f"{', '.join(named)} require{'s' if len(named) == 1 else ''} grad"

    return Field("needs_grad", mask, show)


def needs_grad(*tensors) -> bool:
    return grad_mask(*tensors) != 0


def checked_call(
    group,
    what: str,
    fields: Callable[[], list[Field]],
    validate: Callable[[], T],
    error_kinds: Sequence[type[BaseException]],
    verify: bool | None,
) -> T:
    """``validate()``'s result, after agreeing on ``fields()`` across ``group`` when
    ``verify`` (None: :func:`verify_by_default`). Errors of ``error_kinds`` raised by
    ``validate`` are shared so that every rank raises the same one."""
    if verify is None:
        verify = verify_by_default(group)
    if not verify or group is None or dist.get_world_size(group) == 1:
        return validate()
    result, error = None, None
    try:
        result = validate()
    except tuple(error_kinds) as err:
        error = err
    agree(group, what, fields(), error, error_kinds)
    return result
