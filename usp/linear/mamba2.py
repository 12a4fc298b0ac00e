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
x state item)`` when a document spans chunks (``usp.planner.traffic.mamba2_traffic``).

Documents (``packed``) restart the conv and the state at every boundary. One process
(``plan`` None or of one rank) runs the same code without communication. Eager only: under
``torch.compile`` the call is refused (the Gated DeltaNet path is the compiled one).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from usp.comm.agreement import Field, agree, can_agree, stable_hash
from usp.comm.call_check import documents_field, grad_field, grad_mask
from usp.errors import InputError, ShardingError
from usp.linear.block import ConvCall, RingPeers
from usp.linear.choice import plan_choice
from usp.linear.conv import CONV_KERNELS, ConvKernel, ConvKernelError, select_conv_kernel
from usp.linear.heads import (
    document_bounds,
    documents_of,
    hashed,
    rank_channels,
    replicated_channels,
    to_head_sharded_by_dtype,
)  # fmt: skip
from usp.linear.scan_backends import ScanKernel, ScanKernelError, select_scan_kernel
from usp.linear.ssd import SsdOptions, ssd_ring_block
from usp.options import LINEAR_BACKENDS
from usp.process_groups import HeadLayoutError, degrees
from usp.ring.documents import Documents
from usp.sp.ulysses import UlyssesHeadError, to_sequence_sharded

__all__ = ["Mamba2Error", "mamba2_usp"]

ACTIVATIONS = (None, "silu")


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
    if torch.compiler.is_compiling():
        raise Mamba2Error(
            "mamba2_usp runs eagerly: compile the model around its Mamba-2 layers "
            "(torch.compiler.disable on the layer), or run the model eagerly"
        )
    if getattr(plan, "placement", "sequence") == "documents":  # a plan option: every rank's
        raise Mamba2Error(
            "mamba2_usp does not place documents by length yet: use a plan with "
            'placement="sequence" (the default) for models with Mamba-2 layers'
        )
    u = 1 if plan is None else plan.ulysses_degree
    r = 1 if plan is None else plan.ring_degree
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
    ring = RingPeers(
        None if r == 1 else plan.ring_group, stats, 0 if plan is None else plan.ring_rank
    )
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
    (the same error on every rank) before the first collective."""
    u = 1 if plan is None else plan.ulysses_degree
    r = 1 if plan is None else plan.ring_degree
    error, documents, times, impl, conv_impl = None, None, 1, None, None
    try:
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
        if r > 1 and dist.get_rank(plan.ring_group) != plan.ring_rank:
            raise Mamba2Error(
                f"the ring group orders its ranks differently from the ring rank "
                f"({dist.get_rank(plan.ring_group)} != {plan.ring_rank}); mamba2_usp reads "
                "the gathered chunks in ring-rank order"
            )
    except (InputError, HeadLayoutError) as err:
        error = err
    if plan is not None and plan.sp_degree > 1 and can_agree(plan.sp_group):
        fields = _fields(x, b, dt, weight, bias, activation, chunk_size, documents, scan[0],
                         conv[0])  # fmt: skip
        grad = grad_mask(x, b, c, dt, a, d, weight, bias)  # which backward each rank runs
        fields.append(grad_field(grad, ("x", "b", "c", "dt", "a", "d", "conv_weight", "conv_bias")))
        agree(plan.sp_group, "mamba2_usp", fields, error, _ERRORS)
    if error is not None:
        raise error
    return _Checked(times, documents, impl, conv_impl)


_ERRORS = (
    Mamba2Error, ScanKernelError, ConvKernelError, UlyssesHeadError, HeadLayoutError,
    ShardingError, InputError,
)  # fmt: skip
_DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float16)


def _fields(x, b, dt, weight, bias, activation, chunk_size, documents, kernel, conv_kernel):
    """What the SP ranks must agree on before the first collective (robust to invalid
    inputs: what is not a tensor shows as -1)."""
    shapes = (*_shape(x), *_shape(b), *_shape(weight), bias is None,
              ACTIVATIONS.index(activation) if activation in ACTIVATIONS else -1,
              chunk_size if type(chunk_size) is int else -1)  # fmt: skip
    dtypes = tuple(_DTYPES.index(t.dtype) if getattr(t, "dtype", None) in _DTYPES else -1
                   for t in (x, dt))  # fmt: skip
    return [
        Field("shapes and options", stable_hash(shapes), hashed, f"{shapes}"),
        Field(
            "dtypes of x and dt",
            stable_hash(dtypes),
            hashed,
            f"{[str(getattr(t, 'dtype', None)) for t in (x, dt)]}",
        ),
        documents_field(document_bounds(documents), "documents"),
        Field(
            "scan kernel (auto, torch or fla)",
            _index(kernel, LINEAR_BACKENDS),
            lambda i: LINEAR_BACKENDS[i] if i >= 0 else "unknown",
        ),  # fmt: skip
        Field(
            "conv kernel (auto, torch or causal_conv1d)",
            _index(conv_kernel, CONV_KERNELS),
            lambda i: CONV_KERNELS[i] if i >= 0 else "unknown",
        ),  # fmt: skip
    ]


def _shape(x) -> tuple[int, ...]:
    return tuple(x.shape) if isinstance(x, torch.Tensor) else (-1,)


def _index(name, names) -> int:
    return names.index(name) if name in names else -1
