"""Which kernels a Gated DeltaNet layer runs: its own choice or its plan's, and a forced
kernel that cannot run here refused before a run starts.

A layer's ``kernel=`` / ``conv_kernel=`` (:class:`usp.linear.GatedDeltaNet`,
:func:`usp.linear.gated_deltanet_usp`) default to None: the plan's ``linear_backend`` /
``linear_conv_backend`` (a config's ``[attention]``; ``"auto"`` without a plan). A forced
kernel that cannot run a call is refused at that call, on every SP rank
(``GdnKernelError`` / ``ConvKernelError``). :func:`forced_kernel_refusal` asks the same
question up front, from the layer's shape: the kernels' limits (installed, device, dtype,
key head dim, conv width and channels), not their self-checks, which run on first use.
``usp train`` and the HF integration ask it at set-up, so a forced ``"fla"`` on a machine
without it stops there, on every rank alike, with what to change.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from usp.linear import backends, conv
from usp.options import AUTO_BACKEND, LINEAR_BACKENDS, LINEAR_CONV_BACKENDS

__all__ = [
    "ConvShape", "GdnShape", "Mamba2Shape", "forced_kernel_refusal", "layer_kernel_refusal",
    "plan_choice",
]  # fmt: skip


def plan_choice(given: str | None, plan, name: str) -> str:
    """``given``, or for None the plan's choice ``name`` (``"linear_backend"`` or
    ``"linear_conv_backend"``; ``"auto"`` without a plan)."""
    if given is not None:
        return given
    return AUTO_BACKEND if plan is None else getattr(plan, name)


#: what head-split messages call Gated DeltaNet's two head counts (value heads over
#: Ulysses; key heads repeated as attention's KV heads are)
GDN_HEADS = ("value heads", "key heads")


@dataclass(frozen=True)
class GdnShape:
    """A Gated DeltaNet layer's heads and conv, as its kernels see them."""

    key_heads: int
    value_heads: int
    key_dim: int
    value_dim: int
    conv_width: int

    def rank_channels(self, ulysses: int) -> int:
        """The conv channels one Ulysses rank holds: its share of q, k (key heads repeated
        to lcm(Hk, u) when u does not divide them) and v."""
        key_heads = math.lcm(self.key_heads, ulysses)  # Hk when u divides it
        return (2 * key_heads * self.key_dim + self.value_heads * self.value_dim) // ulysses


@dataclass(frozen=True)
class Mamba2Shape:
    """A Mamba-2 layer's heads, B/C groups and conv, as its kernels see them (the scan's
    key dim is the state size N)."""

    heads: int
    head_dim: int
    groups: int
    state_size: int
    conv_width: int

    @property
    def key_dim(self) -> int:
        return self.state_size

    def rank_channels(self, ulysses: int) -> int:
        """The conv channels one Ulysses rank holds: its heads' x and its (repeated)
        groups' B and C."""
        groups = math.lcm(self.groups, ulysses)
        return (self.heads * self.head_dim + 2 * groups * self.state_size) // ulysses


@dataclass(frozen=True)
class ConvShape:
    """A layer whose only kernel is its short conv (the short conv alone; Mamba-1's conv):
    its channels, split over the Ulysses ranks."""

    channels: int
    conv_width: int
    key_dim: int = 0  # no recurrence kernel

    def rank_channels(self, ulysses: int) -> int:
        return self.channels // ulysses


def layer_kernel_refusal(layer, plan, device, dtype, shape, *, mixer: str, kernels=None):
    """A usp mixer layer's :func:`forced_kernel_refusal`: ``plan`` (default: the layer's
    own), the layer's own choices (its ``kernel`` / ``conv_kernel``, None: the plan's),
    ``device`` / ``dtype`` (default: its conv weight's). Runs no kernel."""
    plan = layer.plan if plan is None else plan
    weight = layer.conv_weight()
    recurrence = plan_choice(getattr(layer, "kernel", None), plan, "linear_backend")
    return forced_kernel_refusal(
        recurrence if shape.key_dim else AUTO_BACKEND,  # a conv alone: no recurrence kernel
        plan_choice(layer.conv_kernel, plan, "linear_conv_backend"),
        weight.device if device is None else device,
        weight.dtype if dtype is None else dtype,
        shape,
        1 if plan is None else plan.ulysses_degree,
        kernels=kernels,
        mixer=mixer,
    )


def forced_kernel_refusal(
    linear_backend: str,
    linear_conv_backend: str,
    device: torch.device,
    dtype: torch.dtype,
    shape: GdnShape | Mamba2Shape,
    ulysses: int = 1,
    *,
    kernels=None,
    conv_kernels=None,
    mixer: str = "Gated DeltaNet",
) -> str | None:
    """Why a forced kernel cannot run ``mixer`` layers of ``shape`` on ``device`` with
    activations of ``dtype`` under ``ulysses`` (None: both can, or ``"auto"`` / ``"torch"``
    chosen): ``'linear_backend = "fla" cannot ...: it needs ...; set linear_backend = ...'``.
    ``kernels`` / ``conv_kernels``: the registries the layer's entry point looks the names
    up in (default: Gated DeltaNet's; :data:`usp.linear.backends.KDA_DEFAULT` for KDA,
    :data:`usp.linear.scan_backends.DEFAULT` for Mamba-2). Runs no kernel (the
    self-checks wait for the first call)."""
    problems = []
    where = f"{torch.device(device).type}, {dtype}"
    if linear_backend not in LINEAR_BACKENDS:
        problems.append(
            f"linear_backend = {linear_backend!r} is unknown; valid: {', '.join(LINEAR_BACKENDS)}"
        )
    elif linear_backend not in (AUTO_BACKEND, "torch"):
        kernel = (backends.DEFAULT if kernels is None else kernels).get(linear_backend)
        reason = kernel.limits_reason(torch.device(device), dtype, shape.key_dim)
        if reason is not None:
            problems.append(
                f'linear_backend = "{linear_backend}" cannot run the {mixer} recurrence '
                f"here ({where}, dk={shape.key_dim}): it {reason}; set linear_backend = "
                f'"auto" ({linear_backend} where it can run, else usp\'s torch kernel) or "torch"'
            )
    if linear_conv_backend not in LINEAR_CONV_BACKENDS:
        problems.append(
            f"linear_conv_backend = {linear_conv_backend!r} is unknown; valid: "
            f"{', '.join(LINEAR_CONV_BACKENDS)}"
        )
    elif linear_conv_backend not in (AUTO_BACKEND, "torch"):
        kernel = (conv.DEFAULT if conv_kernels is None else conv_kernels)[linear_conv_backend]
        channels = shape.rank_channels(ulysses)
        reason = kernel.limits_reason(torch.device(device), dtype, channels, shape.conv_width)
        if reason is not None:
            problems.append(
                f'linear_conv_backend = "{linear_conv_backend}" cannot run the {mixer} '
                f"conv here ({where}, {channels} channels per rank, K={shape.conv_width}): it "
                f'{reason}; set linear_conv_backend = "auto" ({linear_conv_backend} where it '
                'can run, else torch\'s conv1d) or "torch"'
            )
    return "; ".join(problems) or None
