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

__all__ = ["GdnShape", "forced_kernel_refusal", "plan_choice"]


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


def forced_kernel_refusal(
    linear_backend: str,
    linear_conv_backend: str,
    device: torch.device,
    dtype: torch.dtype,
    shape: GdnShape,
    ulysses: int = 1,
    *,
    kernels=None,
    conv_kernels=None,
) -> str | None:
    """Why a forced kernel cannot run layers of ``shape`` on ``device`` with activations
    of ``dtype`` under ``ulysses`` (None: both can, or ``"auto"`` / ``"torch"`` chosen):
    ``'linear_backend = "fla" cannot ...: it needs ...; set linear_backend = ...'``.
    ``kernels`` / ``conv_kernels``: as in :func:`usp.linear.gated_deltanet_usp`. Runs no
    kernel (the self-checks wait for the first call)."""
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
                f'linear_backend = "{linear_backend}" cannot run the Gated DeltaNet recurrence '
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
                f'linear_conv_backend = "{linear_conv_backend}" cannot run the Gated DeltaNet '
                f"conv here ({where}, {channels} channels per rank, K={shape.conv_width}): it "
                f'{reason}; set linear_conv_backend = "auto" ({linear_conv_backend} where it '
                'can run, else torch\'s conv1d) or "torch"'
            )
    return "; ".join(problems) or None
