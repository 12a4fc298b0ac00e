"""A short causal convolution alone under hybrid SP (LFM2's token mixer), and LFM2's layer.

:func:`short_conv_usp` takes a rank's sequence shard [B, S/P, C] and returns its shard of
the causal depthwise conv (kernel K, optional bias and activation), exact (forward and
backward) against one process, on the conv path of the other linear mixers:

1. Ulysses (u > 1): one all-to-all trades sequence for channels
   ([B, S/P, C] -> [B, S/r, C/u]: the channels are cut into u heads).
2. The rank's ring block is cut into segments (one chunk of one document each,
   :mod:`usp.linear.ring`); each segment's conv reads the last ``K - 1`` inputs of its
   document before it, from one all-gather of every segment's tail over the ring (zeros
   at a document's start; :func:`usp.linear.block.conv_segments`).
3. The inverse all-to-all returns [B, S/P, C].

Traffic per rank and direction (:func:`usp.planner.mixer_traffic.short_conv_traffic`;
the backward moves the same): all-to-all ``(u-1)/u x T x 2 C x e`` (u > 1), all-gather
``(r-1) x B x N x (K-1) x C/u x e_c`` (r > 1, a document spanning chunks), with T the
rank's tokens, N the segments (pieces x documents), e the input's bytes, e_c the compute
dtype's. Documents (``packed``) restart the conv. Eager only.

:class:`ShortConv` is transformers' ``Lfm2ShortConv`` (also LFM2-MoE's and LFM3's) under
the same parameter names (``in_proj``, ``conv``, ``out_proj``): ``B, C, x =
in_proj(h)``, ``y = C * conv(B * x)``, ``out_proj(y)``; the gates are token-local.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

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
from usp.linear.block import ConvCall, RingPeers, conv_segments
from usp.linear.choice import ConvShape, layer_kernel_refusal, plan_choice
from usp.linear.conv import CONV_KERNELS, ConvKernel, ConvKernelError, select_conv_kernel
from usp.linear.heads import channels_to_block, channels_to_shard, documents_of, rank_channels
from usp.linear.kernel import compute_dtype, from_padded, segment_rows
from usp.linear.layer_call import call_documents
from usp.linear.ring import Segments
from usp.ring.documents import Documents

__all__ = ["ShortConv", "ShortConvError", "short_conv_usp"]


class ShortConvError(InputError):
    """Inputs or options the short conv path cannot compute."""


def short_conv_usp(
    x: torch.Tensor,
    plan=None,
    *,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str | None = None,
    packed=None,
    conv_kernel: str | None = None,
    conv_kernels=None,
) -> torch.Tensor:
    """The causal depthwise conv of this rank's sequence shard (exact under SP).

    ``x`` [B, S/P, C] in the plan's layout (:meth:`usp.Plan.shard`); ``weight`` [C, K]
    (``nn.Conv1d(C, C, K, groups=C).weight[:, 0]``) and ``bias`` [C] or None; then
    ``activation`` (None or "silu"). Channel c at token t reads tokens t-K+1..t of its
    document (``packed``: cu_seqlens or a PackedSequence of ``plan``; zeros before a
    document's start). Returns [B, S/P, C] in x's dtype (computed in float32, float64 for
    float64). ``plan``: a :class:`usp.Plan`, or None for one process. ``conv_kernel``:
    ``"auto"``, ``"torch"`` or ``"causal_conv1d"`` (:mod:`usp.linear.conv`;
    ``conv_kernels``: a dict of them); None: the plan's ``linear_conv_backend``.

    Raises :class:`ShortConvError` / ``ShardingError`` (and ``ConvKernelError`` for a
    kernel that cannot run) on every SP rank, before any data moves, for what it cannot
    compute (channels that u does not divide among them).
    """
    eager_only("short_conv_usp", "conv", ShortConvError, plan)
    u = 1 if plan is None else plan.ulysses_degree
    choice = plan_choice(conv_kernel, plan, "linear_conv_backend")
    checked = checked_call(
        plan, "short_conv_usp",
        lambda: _check(x, weight, bias, activation, packed, plan, choice, conv_kernels),
        lambda checked: _fields(x, weight, bias, activation, choice, checked),
        _ERRORS,
    )  # fmt: skip
    stats = None if plan is None else plan.comm_stats
    rank = 0 if plan is None else plan.ulysses_rank
    (block,) = channels_to_block([x], plan, stats)  # [B, S/P, C] -> [B, S/r, C/u]
    w = rank_channels([weight], u, rank)[0]  # this rank's channels
    b = None if bias is None else rank_channels([bias], u, rank)[0]
    ring = RingPeers.of(plan)
    conv = ConvCall(w, b, checked.kernel, activation, x.dtype)
    segments = Segments(checked.documents, ring.rank)
    rows, valid, _ = segment_rows(segments.bounds)
    y = conv_segments(block.to(compute_dtype(x.dtype)), conv, segments, ring, rows, valid)
    y = from_padded(y, valid, x.shape[0]).to(x.dtype)  # [B, S/r, C/u]
    return channels_to_shard(y, plan, stats)  # [B, S/P, C]


@dataclass(frozen=True)
class _Checked:
    documents: Documents
    kernel: ConvKernel


_ERRORS = (ShortConvError, ConvKernelError, *COMMON_ERRORS)


def _check(x, weight, bias, activation, packed, plan, choice, conv_kernels) -> _Checked:
    named = {"x": x, "weight": weight, **({} if bias is None else {"bias": bias})}
    wrong = [
        n for n, t in named.items() if not (isinstance(t, torch.Tensor) and t.is_floating_point())
    ]
    if wrong:
        raise ShortConvError(f"{', '.join(wrong)} must be floating-point tensors (bias: or None)")
    channels = x.shape[-1] if x.dim() == 3 else -1
    if channels < 0 or weight.dim() != 2 or weight.shape[0] != channels or weight.shape[1] < 1:
        raise ShortConvError(
            f"x must be [B, S, C] and weight [C, K >= 1]; got x {tuple(x.shape)}, weight "
            f"{tuple(weight.shape)}"
        )
    if bias is not None and bias.shape != (channels,):
        raise ShortConvError(f"bias must be [C] = [{channels}] or None, got {tuple(bias.shape)}")
    if activation not in ACTIVATIONS:
        raise ShortConvError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    u = 1 if plan is None else plan.ulysses_degree
    if channels % u:
        raise ShortConvError(
            f"{channels} channels do not split over ulysses={u} (each Ulysses rank convolves "
            f"C/u channels); use a ulysses degree that divides {channels}"
        )
    documents = documents_of(plan, x.shape[1] * u * (1 if plan is None else plan.ring_degree),
                             packed)  # fmt: skip
    kernel = select_conv_kernel(
        choice, x.device, x.dtype, channels // u, weight.shape[1], conv_kernels
    )
    problem = ring_order_problem(plan, "short_conv_usp")
    if problem is not None:
        raise ShortConvError(problem)
    return _Checked(documents, kernel)


def _fields(x, weight, bias, activation, choice, checked: _Checked | None):
    """What the SP ranks must agree on (whatever the inputs: never raises)."""
    return [
        shape_field(
            "shapes of x, weight and bias, the activation",
            [
                x,
                weight,
                -1 if bias is None else bias,
                ACTIVATIONS.index(activation) if activation in ACTIVATIONS else -2,
            ],
        ),  # fmt: skip
        dtype_field("dtypes of x, weight and bias", [x, weight, bias]),
        documents_field(None if checked is None else checked.documents),
        choice_field("conv kernel (auto, torch or causal_conv1d)", choice, CONV_KERNELS),
        grad_field(("x", "weight", "bias"), [x, weight, bias]),
    ]


class ShortConv(nn.Module):
    """LFM2's short-conv token mixer: [B, S/P, hidden] -> [B, S/P, hidden] on a rank's
    shard. ``plan``: the :class:`usp.Plan` used when ``forward`` gets none (None: one
    process); ``conv_kernel``: as :func:`short_conv_usp`'s (None: the plan's)."""

    def __init__(self, hidden_size: int, conv_kernel_size: int = 3, bias: bool = False, *,
                 plan=None, conv_kernel: str | None = None):  # fmt: skip
        super().__init__()
        self.plan, self.conv_kernel = plan, conv_kernel
        self.conv = nn.Conv1d(
            hidden_size, hidden_size, conv_kernel_size, groups=hidden_size, bias=bias,
            padding=conv_kernel_size - 1,
        )  # fmt: skip
        self.in_proj = nn.Linear(hidden_size, 3 * hidden_size, bias=bias)
        self.out_proj = nn.Linear(hidden_size, hidden_size, bias=bias)

    def conv_weight(self) -> torch.Tensor:
        return self.conv.weight

    def kernel_refusal(self, plan=None, *, device=None, dtype=None) -> str | None:
        """Why a conv kernel the plan (default: the layer's) forces cannot run this layer
        on ``device`` with activations of ``dtype`` (default: its parameters'), or None."""
        shape = ConvShape(self.conv.in_channels, self.conv.kernel_size[0])
        return layer_kernel_refusal(self, plan, device, dtype, shape, mixer="short conv")

    def forward(self, hidden_states, cache=None, attention_mask=None, *, plan=None, packed=None,
                **kwargs):  # fmt: skip
        """``packed``: the global document boundaries (cu_seqlens or a PackedSequence of the
        plan); a ``usp_packed`` (the HF plug-in's) or ``cu_seq_lens_q`` (transformers'
        padding-free batches) keyword is read as ``packed`` too. ``cache`` and a padding
        ``attention_mask`` are refused."""
        packed = call_documents("ShortConv", cache, attention_mask, packed, kwargs)
        b, c, x = self.in_proj(hidden_states).chunk(3, dim=-1)  # [B, S/P, hidden] each
        y = short_conv_usp(
            b * x, self.plan if plan is None else plan, weight=self.conv.weight[:, 0],
            bias=self.conv.bias, packed=packed, conv_kernel=self.conv_kernel,
        )  # fmt: skip
        return self.out_proj(c * y)
