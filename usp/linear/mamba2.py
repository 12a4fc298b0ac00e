"""Mamba-2 (SSD) under hybrid SP: Ulysses over heads x the ring's state pass.

:func:`mamba2_usp` takes a rank's sequence shard of a Mamba-2 layer's conv inputs (x, B,
C), its time step and its per-head parameters, and returns its shard of the scan's output
(with the D skip), exact (forward and backward) against one process:

1. Ulysses: one all-to-all (one per dtype) trades sequence for heads
   ([B, S/P, H, D] -> [B, S/r, H/u, D]) for x, B, C and dt. Heads split over u; the B/C
   groups too, repeated ``lcm(G, u) / G`` times first when u does not divide them (as KV
   heads are for GQA). Each rank takes its heads' conv channels, A and D.
2. The rank's ring block (:mod:`usp.linear.ssd`): the causal conv reads each segment's
   left context (one all-gather of the segments' tails over the ring, as Gated DeltaNet's
   conv does); the scan runs per segment from a zero state; one all-gather of every
   segment's map (its end state from zero and its decay product, a scalar per head);
   every rank composes them in chunk order and adds the start states' contribution.
3. The inverse all-to-all returns [B, S/P, H, P].

Traffic per rank and direction (the backward's reduce-scatters and all-to-alls move the
same): all-to-all ``(u - 1)/u x B x S/P x (H P + 2 G' N) x item + (u - 1)/u x B x S/P x H
x dt item`` forward plus ``(u - 1)/u x B x S/P x H P x item`` back (G' = G repeated);
all-gathers ``(r - 1) x segments x B x ((K - 1) (H P + 2 G' N)/u x item + H/u x (N P + 1)
x state item)`` when a document spans chunks (``usp.planner.mixer_traffic.mamba2_traffic``).

Documents (``packed``) restart the conv and the state at every boundary. One process
(``plan`` None or of one rank) runs the same code without communication. Eager only: under
``torch.compile`` the call is refused (the Gated DeltaNet path is the compiled one).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from usp.errors import InputError
from usp.linear.agreed import (
    ACTIVATIONS,
    COMMON_ERRORS,
    checked_call,
    choice_field,
    documents_field,
    dtype_field,
    eager_only,
    grad_field,
    ring_order_problem,
    shape_field,
)  # fmt: skip
from usp.linear.block import ConvCall, RingPeers
from usp.linear.choice import plan_choice
from usp.linear.conv import CONV_KERNELS, ConvKernel, ConvKernelError, select_conv_kernel
from usp.linear.heads import (
    documents_of,
    rank_channels,
    replicated_channels,
    to_head_sharded_by_dtype,
)  # fmt: skip
from usp.linear.scan_backends import ScanKernel, ScanKernelError, select_scan_kernel
from usp.linear.ssd import SsdOptions, ssd_ring_block
from usp.options import LINEAR_BACKENDS
from usp.process_groups import degrees
from usp.ring.documents import Documents
from usp.sp.ulysses import UlyssesHeadError, to_sequence_sharded

__all__ = ["Mamba2Error", "mamba2_usp"]


class Mamba2Error(InputError):
    """Inputs or options the Mamba-2 path cannot compute."""


def mamba2_usp(
    x: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    dt: torch.Tensor,
    a: torch.Tensor,
    plan=None,
    *,
    d: torch.Tensor | None = None,
    conv_weight: torch.Tensor,
    conv_bias: torch.Tensor | None = None,
    activation: str | None = "silu",
    packed=None,
    chunk_size: int = 64,
    kernel: str | None = None,
    kernels=None,
    conv_kernel: str | None = None,
    conv_kernels=None,
) -> torch.Tensor:
    """The Mamba-2 scan on this rank's sequence shard (exact under SP).

    ``x`` [B, S/P, H, P], ``b`` and ``c`` [B, S/P, G, N]: the conv's inputs, in the plan's
    layout (:meth:`usp.Plan.shard`); ``conv_weight`` [H P + 2 G N, K] and ``conv_bias``
    (or None) in transformers' channel order (x, B, C; head-major); ``activation`` after
    the conv. ``dt`` [B, S/P, H]: the time step after softplus(dt + dt_bias) and its
    limits; ``a`` [H]: A = -exp(A_log); ``d`` [H] or None: the skip. Head h reads group
    h // (H / G). Computes, per head and document (``packed``: cu_seqlens or a
    PackedSequence of ``plan``; the state and the conv restart at each), with x, B, C after
    the conv: ``S_t = exp(dt_t A) S_{t-1} + B_t (dt_t x_t)^T``, ``y_t = S_t^T C_t + D x_t``.
    Returns y [B, S/P, H, P] in the compute dtype (float64 for float64 x, else float32, as
    transformers' torch path). ``plan``: a :class:`usp.Plan`, or None for one process.
    ``chunk_size``: the torch kernel's chunk length (work, not results). ``kernel``:
    ``"auto"``, ``"torch"`` or ``"fla"`` (fla's simple GLA, :mod:`usp.linear.scan_backends`;
    ``kernels``: a dict of them); ``conv_kernel``: ``"auto"``, ``"torch"`` or
    ``"causal_conv1d"`` (:mod:`usp.linear.conv`); None: the plan's ``linear_backend`` /
    ``linear_conv_backend``.

    Raises :class:`Mamba2Error` / ``UlyssesHeadError`` / ``ShardingError`` (and
    ``ScanKernelError`` / ``ConvKernelError`` for a kernel that cannot run) on every SP
    rank, before any data moves, for what it cannot compute.
    """
    eager_only("mamba2_usp", "Mamba-2", Mamba2Error, plan)
    u = 1 if plan is None else plan.ulysses_degree
    checked = _checked(
        x, b, c, dt, a, d, plan, conv_weight, conv_bias, activation, packed, chunk_size,
        (plan_choice(kernel, plan, "linear_backend"), kernels),
        (plan_choice(conv_kernel, plan, "linear_conv_backend"), conv_kernels),
    )  # fmt: skip
    stats = None if plan is None else plan.comm_stats
    ulysses = None if u == 1 else plan.ulysses_group
    rank = 0 if plan is None else plan.ulysses_rank
    heads, groups = x.shape[2], b.shape[2]
    if checked.times > 1:  # groups repeated so that u ranks split them
        b, c = (t.repeat_interleave(checked.times, dim=2) for t in (b, c))
    tensors = [t.flatten(2) for t in (x, b, c)] + [dt]  # [B, S/P, channels] and [B, S/P, H]
    if u > 1:  # [B, S/P, h, D] -> [B, S/r, h/u, D]
        parts = [x, b, c, dt[..., None]]
        parts = to_head_sharded_by_dtype(parts, ulysses, stats)
        tensors = [t.flatten(2) for t in parts[:3]] + [parts[3][..., 0]]
    # this rank's channels: its heads' x, its (repeated) groups' B and C
    channels = _conv_channels(conv_weight, conv_bias, heads, groups, x.shape[3], b.shape[3],
                              checked.times, u, rank)  # fmt: skip
    a_local = rank_channels([a], u, rank)[0]
    d_local = None if d is None else rank_channels([d], u, rank)[0]
    options = SsdOptions(
        ConvCall(channels[0], channels[1], checked.conv_kernel, activation, x.dtype),
        groups * checked.times // u, b.shape[3], chunk_size, checked.kernel,
    )  # fmt: skip
    ring = RingPeers.of(plan)
    xbc = torch.cat(tensors[:3], dim=-1)  # [B, S/r, h P + 2 g N]
    y = ssd_ring_block(xbc, tensors[3], a_local, d_local, checked.documents, ring, options)
    if u > 1:  # [B, S/r, H/u, P] -> [B, S/P, H, P]
        y = to_sequence_sharded(y, ulysses, stats)
    return y


def _conv_channels(weight, bias, heads, groups, head_dim, state, times, u, rank):
    """This rank's conv weight [C_rank, K] and bias (or None): its heads' x channels, then
    its groups' B and C channels (each group's repeated ``times`` times first)."""
    params = [weight] + ([] if bias is None else [bias])
    out = []
    for p in params:
        px, pb, pc = p.split([heads * head_dim, groups * state, groups * state])
        pb, pc = replicated_channels([pb, pc], groups, times)
        out.append(torch.cat(rank_channels([px, pb, pc], u, rank)))
    return out + [None] * (2 - len(out))


@dataclass(frozen=True)
class _Checked:
    times: int  # each B/C group repeated before the all-to-all
    documents: Documents
    kernel: ScanKernel
    conv_kernel: ConvKernel


def _check_inputs(x, b, c, dt, a, d, weight, bias, activation, chunk_size):
    named = {"x": x, "b": b, "c": c, "dt": dt, "a": a, "conv_weight": weight}
    named.update({} if d is None else {"d": d})
    named.update({} if bias is None else {"conv_bias": bias})
    wrong = [
        n for n, t in named.items() if not (isinstance(t, torch.Tensor) and t.is_floating_point())
    ]
    if wrong:
        raise Mamba2Error(
            f"{', '.join(wrong)} must be floating-point tensors (d, conv_bias: or None)"
        )
    if x.dim() != 4 or b.dim() != 4 or c.shape != b.shape or b.shape[:2] != x.shape[:2]:
        raise Mamba2Error(
            f"x must be [B, S, H, P] and b, c [B, S, G, N] of one shape; got x "
            f"{tuple(x.shape)}, b {tuple(b.shape)}, c {tuple(c.shape)}"
        )
    heads, groups = x.shape[2], b.shape[2]
    if dt.shape != x.shape[:3] or a.shape != (heads,) or (d is not None and d.shape != (heads,)):
        raise Mamba2Error(
            f"dt must be [B, S, H] = {tuple(x.shape[:3])}, a and d [H] = [{heads}]; got dt "
            f"{tuple(dt.shape)}, a {tuple(a.shape)}, d {None if d is None else tuple(d.shape)}"
        )
    if heads % groups:
        raise Mamba2Error(f"{heads} heads are not a multiple of {groups} B/C groups")
    if len({x.dtype, b.dtype, c.dtype}) != 1:
        raise Mamba2Error(f"x, b and c must share a dtype; got {x.dtype}, {b.dtype}, {c.dtype}")
    channels = heads * x.shape[3] + 2 * groups * b.shape[3]
    if (
        weight.dim() != 2
        or weight.shape[0] != channels
        or (bias is not None and bias.shape != (channels,))
    ):
        raise Mamba2Error(
            f"conv_weight must be [H P + 2 G N, K] = [{channels}, K] and conv_bias [{channels}]"
            f" or None; got {tuple(weight.shape)} and {None if bias is None else tuple(bias.shape)}"
        )
    if activation not in ACTIVATIONS:
        raise Mamba2Error(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    if weight.shape[1] < 1:
        raise Mamba2Error(f"conv_weight's kernel size must be >= 1, got {tuple(weight.shape)}")
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise Mamba2Error(
            f"chunk_size must be a positive int (the kernel's chunk length, e.g. 64), got "
            f"{chunk_size!r}"
        )


def _checked(x, b, c, dt, a, d, plan, weight, bias, activation, packed, chunk_size, scan, conv):
    """Everything that could fail, checked on this rank and agreed across the SP ranks
    (the same error on every rank) before the first collective
    (:func:`usp.linear.agreed.checked_call`)."""
    u = 1 if plan is None else plan.ulysses_degree
    r = 1 if plan is None else plan.ring_degree

    def check() -> _Checked:
        _check_inputs(x, b, c, dt, a, d, weight, bias, activation, chunk_size)
        heads, groups = x.shape[2], b.shape[2]
        times = degrees.kv_replication_for(
            heads, groups, u, u * r, error=UlyssesHeadError,
            subject=f"cannot split {heads} Mamba-2 heads / {groups} B/C groups over ulysses={u}",
        )  # fmt: skip
        documents = documents_of(plan, x.shape[1] * u * r, packed)
        impl = select_scan_kernel(scan[0], x.device, x.dtype, b.shape[3], x.shape[3], scan[1])
        rank_channels_count = (heads * x.shape[3] + 2 * groups * times * b.shape[3]) // u
        conv_impl = select_conv_kernel(
            conv[0], x.device, x.dtype, rank_channels_count, weight.shape[1], conv[1]
        )
        problem = ring_order_problem(plan, "mamba2_usp")
        if problem is not None:
            raise Mamba2Error(problem)
        return _Checked(times, documents, impl, conv_impl)

    def fields(checked: _Checked | None):
        documents = None if checked is None else checked.documents
        inputs = (x, b, c, dt, a, d, weight, bias)
        return _fields(inputs, activation, chunk_size, documents, scan[0], conv[0])

    return checked_call(plan, "mamba2_usp", check, fields, _ERRORS)


_ERRORS = (Mamba2Error, ScanKernelError, ConvKernelError, *COMMON_ERRORS)
_NAMES = ("x", "b", "c", "dt", "a", "d", "conv_weight", "conv_bias")


def _fields(inputs, activation, chunk_size, documents, kernel, conv_kernel):
    """What the SP ranks must agree on before the first collective (whatever the inputs:
    never raises)."""
    settings = [ACTIVATIONS.index(activation) if activation in ACTIVATIONS else -1, chunk_size]
    return [
        shape_field(
            "shapes of x, b, c, dt, a, d and the conv, activation, chunk_size",
            [*(-1 if t is None else t for t in inputs), *settings],
        ),  # fmt: skip
        dtype_field("dtypes of x, b, c, dt, a, d and the conv", inputs),
        documents_field(documents),
        choice_field("scan kernel (auto, torch or fla)", kernel, LINEAR_BACKENDS),
        choice_field("conv kernel (auto, torch or causal_conv1d)", conv_kernel, CONV_KERNELS),
        grad_field(_NAMES, inputs),
    ]
