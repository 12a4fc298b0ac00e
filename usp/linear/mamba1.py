"""Mamba-1 (Jamba's Mamba layer) under hybrid SP: the selective scan with a diagonal decay
per channel and state, on the ring design of the other linear mixers.

:func:`mamba1_usp` takes a rank's sequence shard of the scan's inputs (x after the conv,
dt after softplus, B, C) and returns its shard of ``y = scan + D x``, exact (forward and
backward) against one process:

1. Ulysses (u > 1): one all-to-all per dtype trades sequence for channels
   ([B, S/P, D] -> [B, S/r, D/u] for x and dt; B and C, which every channel reads, go to
   every Ulysses rank: [B, S/P, N] repeated u times -> [B, S/r, N]).
2. The rank's ring block (:func:`usp.linear.selective_scan.selective_scan_ring_block`):
   the scan per segment from a zero state, one all-gather over the ring of every
   segment's map (its final state and its decay product, [D/u, N] each), composed in
   chunk order; each token adds its start state's term.
3. The inverse all-to-all returns [B, S/P, D].

Traffic per rank and direction (:func:`usp.planner.mixer_traffic.mamba1_traffic`; the
backward moves the same): all-to-all ``(u-1)/u x T x [D (e + e_c) + 2 u N e + D e_c]``,
all-gather ``(r-1) x B x N_s x (D/u) x 2 N x e_c``. Jamba's conv runs before the scan (its
x_proj reads every channel of the conv's output): :class:`Mamba1Mixer` runs it with
:func:`usp.linear.short_conv_usp`, so a Jamba layer costs two all-to-all round trips at
u > 1. Documents (``packed``) restart the state. Eager only.

:class:`Mamba1Mixer` is transformers' ``JambaMambaMixer`` under the same parameter names
(``in_proj``, ``conv1d``, ``x_proj``, ``dt_proj``, ``A_log``, ``D``, ``out_proj``,
``dt_layernorm``, ``b_layernorm``, ``c_layernorm``) and with its forward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from usp.errors import InputError
from usp.linear.agreed import (
    COMMON_ERRORS,
    checked_call,
    documents_field,
    dtype_field,
    eager_only,
    grad_field,
    ring_order_problem,
    shape_field,
)  # fmt: skip
from usp.linear.block import RingPeers
from usp.linear.choice import ConvShape, layer_kernel_refusal, plan_choice
from usp.linear.heads import channels_to_block, channels_to_shard, documents_of, rank_channels
from usp.linear.kernel import compute_dtype
from usp.linear.layer_call import call_documents
from usp.linear.selective_scan import SelectiveScanOptions, selective_scan_ring_block
from usp.linear.short_conv import short_conv_usp
from usp.ring.documents import Documents

__all__ = ["Mamba1Error", "Mamba1Mixer", "mamba1_usp"]

_NAMES = ("x", "dt", "a", "b", "c", "d")
#: the kernels the scan takes: usp's torch kernel only (no CUDA kernel is mapped yet)
KERNELS = ("auto", "torch")


class Mamba1Error(InputError):
    """Inputs or options the Mamba-1 path cannot compute."""


def mamba1_usp(
    x: torch.Tensor,
    dt: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    plan=None,
    *,
    d: torch.Tensor | None = None,
    packed=None,
    chunk_size: int = 64,
    kernel: str | None = None,
) -> torch.Tensor:
    """Mamba-1's selective scan on this rank's sequence shard (exact under SP).

    ``x`` [B, S/P, D] (after the conv), ``dt`` [B, S/P, D] (after softplus: >= 0), ``a``
    [D, N] (A = -exp(A_log)), ``b`` and ``c`` [B, S/P, N], ``d`` [D] or None (the skip), in
    the plan's layout (:meth:`usp.Plan.shard`). Computes, per channel and document
    (``packed``: cu_seqlens or a PackedSequence of ``plan``; the state restarts at each):
    ``h_t = exp(dt_t A) h_{t-1} + dt_t x_t B_t``, ``y_t = h_t C_t + D x_t``. Returns
    y [B, S/P, D] in the compute dtype (float64 for float64 x, else float32).
    ``chunk_size``: the kernel's chunk length (work, not results). ``kernel``: ``"auto"``
    or ``"torch"`` (usp's torch kernel; None: the plan's ``linear_backend``, which must
    then be one of those).

    Raises :class:`Mamba1Error` / ``ShardingError`` on every SP rank, before any data
    moves, for what it cannot compute (channels that u does not divide among them).
    """
    eager_only("mamba1_usp", "Mamba", Mamba1Error, plan)
    u = 1 if plan is None else plan.ulysses_degree
    choice = kernel if kernel is not None else "auto" if plan is None else plan.linear_backend
    inputs = (x, dt, a, b, c, d)
    checked = checked_call(
        plan, "mamba1_usp", lambda: _check(inputs, packed, chunk_size, choice, plan),
        lambda checked: _fields(inputs, chunk_size, choice, checked), _ERRORS,
    )  # fmt: skip
    stats = None if plan is None else plan.comm_stats
    rank = 0 if plan is None else plan.ulysses_rank
    # [B, S/P, D] -> [B, S/r, D/u]; B and C, which every channel reads, to every rank
    x, dt, b, c = channels_to_block([x, dt, *(t.repeat(1, 1, u) for t in (b, c))], plan, stats)
    a = rank_channels([a], u, rank)[0]
    d = None if d is None else rank_channels([d], u, rank)[0]
    y = selective_scan_ring_block(x, dt, a, b, c, d, checked.documents, RingPeers.of(plan),
                                  SelectiveScanOptions(chunk_size))  # fmt: skip
    return channels_to_shard(y, plan, stats)  # [B, S/P, D]


@dataclass(frozen=True)
class _Checked:
    documents: Documents


_ERRORS = (Mamba1Error, *COMMON_ERRORS)


def _check(inputs, packed, chunk_size, choice, plan) -> _Checked:
    x, dt, a, b, c, d = inputs
    named = dict(zip(_NAMES, inputs))
    if d is None:
        del named["d"]
    wrong = [
        n for n, t in named.items() if not (isinstance(t, torch.Tensor) and t.is_floating_point())
    ]
    if wrong:
        raise Mamba1Error(f"{', '.join(wrong)} must be floating-point tensors (d: or None)")
    if x.dim() != 3 or dt.shape != x.shape or b.dim() != 3 or c.shape != b.shape or (
        b.shape[:2] != x.shape[:2]
    ):  # fmt: skip
        raise Mamba1Error(
            f"x and dt must be [B, S, D] and b, c [B, S, N] of one [B, S]; got x "
            f"{tuple(x.shape)}, dt {tuple(dt.shape)}, b {tuple(b.shape)}, c {tuple(c.shape)}"
        )
    channels, state = x.shape[2], b.shape[2]
    if a.shape != (channels, state) or (d is not None and d.shape != (channels,)):
        raise Mamba1Error(
            f"a must be [D, N] = {(channels, state)} and d [D] or None; got a "
            f"{tuple(a.shape)}, d {None if d is None else tuple(d.shape)}"
        )
    if type(chunk_size) is not int or chunk_size < 1:
        raise Mamba1Error(f"chunk_size must be a positive int (e.g. 64), got {chunk_size!r}")
    if choice not in KERNELS:
        raise Mamba1Error(
            f"Mamba-1's scan runs on usp's torch kernel (kernel 'auto' or 'torch'), not "
            f"{choice!r}: no {choice} kernel is mapped for it; pass kernel='torch' (or set "
            "the plan's linear_backend to 'auto')"
        )
    u = 1 if plan is None else plan.ulysses_degree
    if channels % u:
        raise Mamba1Error(
            f"{channels} channels do not split over ulysses={u} (each Ulysses rank scans "
            f"D/u channels); use a ulysses degree that divides {channels}"
        )
    r = 1 if plan is None else plan.ring_degree
    documents = documents_of(plan, x.shape[1] * u * r, packed)
    problem = ring_order_problem(plan, "mamba1_usp")
    if problem is not None:
        raise Mamba1Error(problem)
    return _Checked(documents)


def _fields(inputs, chunk_size, choice, checked: _Checked | None):
    """What the SP ranks must agree on (whatever the inputs: never raises)."""
    return [
        shape_field(
            "shapes of x, dt, a, b, c, d and chunk_size",
            [
                *(-1 if t is None else t for t in inputs),
                chunk_size,
                KERNELS.index(choice) if choice in KERNELS else -1,
            ],
        ),  # fmt: skip
        dtype_field("dtypes of x, dt, a, b, c, d", inputs),
        documents_field(None if checked is None else checked.documents),
        grad_field(_NAMES, inputs),
    ]


class _RMSNorm(nn.Module):
    """RMSNorm over the last dim in float32 (float64 for float64), weight applied in the
    input's dtype (transformers' ``JambaRMSNorm``)."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.to(compute_dtype(x.dtype))
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * h.to(x.dtype)


class Mamba1Mixer(nn.Module):
    """Jamba's Mamba token mixer: [B, S/P, hidden] -> [B, S/P, hidden] on a rank's shard.
    ``plan``: the :class:`usp.Plan` used when ``forward`` gets none (None: one process);
    ``chunk_size``: the scan's (work, not results); ``conv_kernel``: the conv's
    (:func:`usp.linear.short_conv_usp`; None: the plan's)."""

    def __init__(
        self, hidden_size: int, intermediate_size: int, state_size: int, time_step_rank: int,
        conv_kernel_size: int = 4, *, conv_bias: bool = True, proj_bias: bool = False,
        rms_norm_eps: float = 1e-6, plan=None, chunk_size: int = 64,
        conv_kernel: str | None = None,
    ):  # fmt: skip
        super().__init__()
        self.intermediate_size, self.ssm_state_size = intermediate_size, state_size
        self.time_step_rank = time_step_rank
        self.plan, self.chunk_size, self.conv_kernel = plan, chunk_size, conv_kernel
        self.in_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=proj_bias)
        self.conv1d = nn.Conv1d(
            intermediate_size, intermediate_size, conv_kernel_size, groups=intermediate_size,
            bias=conv_bias, padding=conv_kernel_size - 1,
        )  # fmt: skip
        self.x_proj = nn.Linear(intermediate_size, time_step_rank + 2 * state_size, bias=False)
        self.dt_proj = nn.Linear(time_step_rank, intermediate_size, bias=True)
        a = torch.arange(1, state_size + 1, dtype=torch.float32).expand(intermediate_size, -1)
        self.A_log = nn.Parameter(torch.log(a).contiguous())
        self.D = nn.Parameter(torch.ones(intermediate_size))
        self.out_proj = nn.Linear(intermediate_size, hidden_size, bias=proj_bias)
        self.dt_layernorm = _RMSNorm(time_step_rank, rms_norm_eps)
        self.b_layernorm = _RMSNorm(state_size, rms_norm_eps)
        self.c_layernorm = _RMSNorm(state_size, rms_norm_eps)

    def conv_weight(self) -> torch.Tensor:
        return self.conv1d.weight

    def kernel_refusal(self, plan=None, *, device=None, dtype=None) -> str | None:
        """Why a kernel the plan (default: the layer's) forces cannot run this layer on
        ``device`` with activations of ``dtype`` (default: its parameters'), or None: the
        scan takes usp's torch kernel only; the conv as :class:`usp.linear.ShortConv`'s."""
        plan = self.plan if plan is None else plan
        scan = plan_choice(None, plan, "linear_backend")
        problems = [] if scan in KERNELS else [
            f'linear_backend = "{scan}" cannot run the Mamba-1 scan: no {scan} kernel is '
            'mapped for it; set linear_backend = "auto" (usp\'s torch kernel) or "torch"'
        ]  # fmt: skip
        shape = ConvShape(self.intermediate_size, self.conv1d.kernel_size[0])
        conv = layer_kernel_refusal(self, plan, device, dtype, shape, mixer="Mamba-1")
        return "; ".join(problems + ([] if conv is None else [conv])) or None

    def forward(self, hidden_states, cache=None, attention_mask=None, *, plan=None, packed=None,
                **kwargs):  # fmt: skip
        """``packed``: the global document boundaries (cu_seqlens or a PackedSequence of the
        plan); a ``usp_packed`` (the HF plug-in's) or ``cu_seq_lens_q`` (transformers'
        padding-free batches) keyword is read as ``packed`` too. ``cache`` and a padding
        ``attention_mask`` are refused."""
        packed = call_documents("Mamba1Mixer", cache, attention_mask, packed, kwargs)
        plan = self.plan if plan is None else plan
        x, z = self.in_proj(hidden_states).chunk(2, dim=-1)  # [B, S/P, D] each
        x = short_conv_usp(
            x, plan, weight=self.conv1d.weight[:, 0], bias=self.conv1d.bias, activation="silu",
            packed=packed, conv_kernel=self.conv_kernel,
        )  # fmt: skip
        dt, b, c = self.x_proj(x).split(
            [self.time_step_rank, self.ssm_state_size, self.ssm_state_size], dim=-1
        )
        dt = F.linear(self.dt_layernorm(dt), self.dt_proj.weight)  # the bias inside softplus
        dtype = compute_dtype(hidden_states.dtype)
        dt = F.softplus(dt.to(dtype) + self.dt_proj.bias.to(dtype))
        y = mamba1_usp(
            x,
            dt,
            -torch.exp(self.A_log.to(dtype)),
            self.b_layernorm(b),
            self.c_layernorm(c),
            plan,
            d=self.D,
            packed=packed,
            chunk_size=self.chunk_size,
        )  # fmt: skip  [B, S/P, D] in the compute dtype
        y = y * F.silu(z.to(y.dtype))
        return self.out_proj(y.to(hidden_states.dtype))
