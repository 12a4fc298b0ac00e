"""Bytes one rank sends and receives in one layer of the linear mixers beside Gated
DeltaNet (whose formula is :func:`usp.planner.traffic.gdn_traffic`): Mamba-2
(:func:`usp.linear.mamba2_usp`), Kimi Delta Attention (:func:`usp.linear.kda_usp`), the
short conv (:func:`usp.linear.short_conv_usp`) and Mamba-1's scan
(:func:`usp.linear.mamba1_usp`), docs/models.md's formulas, each
asserted against ``CommStats`` in the mixer's distributed tests.

Every mixer has the same two parts: one Ulysses all-to-all of its inputs (one call per
dtype) and one of its output back (u > 1), and, when a document spans more than one
chunk of the ring, one all-gather of the segments' conv tails and one of their state maps
over the ring (r > 1), whose size does not grow with S. The backward moves the same: the
all-to-alls inverted, a reduce-scatter in place of each all-gather. With T = batch x
seqlen / (u r) tokens per rank and N = pieces (2 zigzag, 1 contiguous) x documents.
"""

from __future__ import annotations

import math

__all__ = [
    "kda_traffic", "mamba1_traffic", "mamba2_traffic", "mixer_traffic", "short_conv_traffic",
]  # fmt: skip


def _counts(moved: int, calls: int) -> dict[str, int]:
    return {"sent": moved, "received": moved, "calls": calls}


def mixer_traffic(
    *, tokens: int, ulysses: int, ring: int, exchanged: int, returned: int, calls: int,
    gathered: int, gathers: int,
) -> dict[str, dict[str, dict[str, int]]]:  # fmt: skip
    """One layer's traffic from its parts: ``exchanged`` / ``returned`` bytes per token
    into and out of the all-to-alls (all heads; ``calls`` all-to-alls in each direction),
    ``gathered`` bytes one rank contributes to the ring's ``gathers`` all-gathers."""
    u, r = ulysses, ring
    forward: dict[str, dict[str, int]] = {}
    backward: dict[str, dict[str, int]] = {}
    if u > 1:
        moved = tokens * (exchanged + returned) * (u - 1) // u
        forward["all_to_all"] = backward["all_to_all"] = _counts(moved, calls)
    if r > 1 and gathered:
        moved = (r - 1) * gathered
        forward["all_gather"] = _counts(moved, gathers)
        backward["reduce_scatter"] = _counts(moved, gathers)
    return {"forward": forward, "backward": backward}


def _segments(layout: str, documents: int) -> int:
    return (2 if layout == "zigzag" else 1) * documents


def kda_traffic(
    *, batch: int, seqlen: int, ulysses: int, ring: int, key_heads: int, heads: int,
    key_dim: int, value_dim: int, kernel: int, layout: str, documents: int, item_bytes: int,
    gate_bytes: int, state_bytes: int,
) -> dict[str, dict[str, dict[str, int]]]:  # fmt: skip
    """A Kimi Delta Attention layer: Gated DeltaNet's formula with g's ``key_dim`` numbers
    per head in place of one, Hk' = lcm(Hk, u) (key heads repeated for the split):

      all-to-all (u > 1): (u-1)/u * T * [(2 Hk' dk + H dv) e + H (dk + 1) e_g + H dv e]
      all-gather (r > 1): (r-1) * B * N * [(K-1)(2 Hk' dk + H dv)/u + (H/u) dk (dk + dv)] e_c

    ``item_bytes`` e (q, k, v, the output), ``gate_bytes`` e_g (g and beta),
    ``state_bytes`` e_c (the compute dtype: the conv tails and the maps)."""
    u = ulysses
    channels = 2 * math.lcm(key_heads, u) * key_dim + heads * value_dim
    exchanged = channels * item_bytes + heads * (key_dim + 1) * gate_bytes
    tails = (kernel - 1) * channels // u
    maps = heads // u * key_dim * (key_dim + value_dim)
    return mixer_traffic(
        tokens=batch * seqlen // (u * ring), ulysses=u, ring=ring, exchanged=exchanged,
        returned=heads * value_dim * item_bytes, calls=2 if gate_bytes == item_bytes else 3,
        gathered=batch * _segments(layout, documents) * (tails + maps) * state_bytes, gathers=2,
    )  # fmt: skip


def mamba2_traffic(
    *, batch: int, seqlen: int, ulysses: int, ring: int, heads: int, head_dim: int,
    groups: int, state_size: int, kernel: int, layout: str, documents: int, item_bytes: int,
    state_bytes: int,
) -> dict[str, dict[str, dict[str, int]]]:  # fmt: skip
    """A Mamba-2 layer, G' = lcm(G, u) (B/C groups repeated for the split):

      all-to-all (u > 1): (u-1)/u * T * [(H P + 2 G' N) e + H e_c + H P e_c]
      all-gather (r > 1): (r-1) * B * N_s * [(K-1)(H P + 2 G' N)/u + (H/u)(N P + 1)] e_c

    ``item_bytes`` e (x, B, C), ``state_bytes`` e_c (the compute dtype: dt, the output,
    the conv tails and the maps)."""
    u = ulysses
    channels = heads * head_dim + 2 * math.lcm(groups, u) * state_size
    tails = (kernel - 1) * channels // u
    maps = heads // u * (state_size * head_dim + 1)
    return mixer_traffic(
        tokens=batch * seqlen // (u * ring), ulysses=u, ring=ring,
        exchanged=channels * item_bytes + heads * state_bytes,
        returned=heads * head_dim * state_bytes, calls=2 if item_bytes == state_bytes else 3,
        gathered=batch * _segments(layout, documents) * (tails + maps) * state_bytes, gathers=2,
    )  # fmt: skip


def short_conv_traffic(
    *, batch: int, seqlen: int, ulysses: int, ring: int, channels: int, kernel: int,
    layout: str, documents: int, item_bytes: int, state_bytes: int,
) -> dict[str, dict[str, dict[str, int]]]:  # fmt: skip
    """A short conv layer (LFM2's), channels split over the Ulysses ranks:

      all-to-all (u > 1): (u-1)/u * T * C * 2 e
      all-gather (r > 1): (r-1) * B * N * (K-1) * C/u * e_c

    ``item_bytes`` e (the conv's input and output), ``state_bytes`` e_c (the compute
    dtype: the tails)."""
    u = ulysses
    return mixer_traffic(
        tokens=batch * seqlen // (u * ring), ulysses=u, ring=ring, exchanged=channels * item_bytes,
        returned=channels * item_bytes, calls=2,
        gathered=batch * _segments(layout, documents) * (kernel - 1) * channels // u * state_bytes,
        gathers=1,
    )  # fmt: skip


def mamba1_traffic(
    *, batch: int, seqlen: int, ulysses: int, ring: int, channels: int, state_size: int,
    layout: str, documents: int, item_bytes: int, state_bytes: int,
) -> dict[str, dict[str, dict[str, int]]]:  # fmt: skip
    """Mamba-1's selective scan (Jamba's; its conv is a :func:`short_conv_traffic` more),
    channels D split over the Ulysses ranks, B and C (N each) sent to every one of them:

      all-to-all (u > 1): (u-1)/u * T * [D e + D e_c + 2 u N e + D e_c]
      all-gather (r > 1): (r-1) * B * N_s * (D/u) * 2 N * e_c

    ``item_bytes`` e (x, B, C), ``state_bytes`` e_c (the compute dtype: dt, the output,
    the maps)."""
    u = ulysses
    return mixer_traffic(
        tokens=batch * seqlen // (u * ring), ulysses=u, ring=ring,
        exchanged=channels * (item_bytes + state_bytes) + 2 * u * state_size * item_bytes,
        returned=channels * state_bytes, calls=2 if item_bytes == state_bytes else 3,
        gathered=batch * _segments(layout, documents) * channels // u * 2 * state_size
        * state_bytes, gathers=1,
    )  # fmt: skip
