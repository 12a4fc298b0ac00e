"""Bytes one rank sends and receives per step, by collective kind, in closed form.

:func:`traffic_formula` is the attention's traffic (Ulysses all-to-alls, the ring's K/V
and dK/dV), the formula ``benchmarks/emulate.py`` checks against ``CommStats`` byte
counters; :func:`gdn_traffic` a Gated DeltaNet layer's (docs/models.md's formula, which
``tests/attention/test_gdn_usp.py`` checks against ``CommStats``); the other linear mixers'
are in :mod:`usp.planner.mixer_traffic`, reached by name through :func:`linear_traffic`;
:func:`fsdp_traffic` is FSDP2's (parameter all-gathers, gradient
reduce-scatters); :func:`step_traffic` adds them up for one training step.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Protocol

from usp.planner import mixer_traffic
from usp.process_groups import kv_replication
from usp.ring.window import ring_steps


class HeadShape(Protocol):
    """Attention heads: query heads, KV heads, head dim (``benchmarks/emulate.py``'s
    ``AttentionShape`` is one)."""

    heads: int
    kv_heads: int
    head_dim: int


def _counts(moved: int, calls: int) -> dict[str, int]:
    return {"sent": moved, "received": moved, "calls": calls}


def traffic_formula(
    shape: HeadShape,
    *,
    batch: int,
    seqlen: int,
    ulysses: int,
    ring: int,
    ring_impl: str,
    item_bytes: int,
    acc_bytes: int,
    window: int | None = None,
    layout: str = "zigzag",
    value_dim: int | None = None,
    doc_lengths: tuple[int, ...] | None = None,
    rank: int = 0,
) -> dict[str, dict[str, dict[str, int]]]:
    """Bytes one rank sends and receives per collective kind, ``{"forward": {kind:
    {"sent", "received", "calls"}}, "backward": {...}}``, as ``CommStats.snapshot()``.

    ``seqlen`` is one SP replica's sequence (each rank holds ``seqlen / (u * r)`` tokens);
    ``acc_bytes`` is the element size of the float32 (float64 for float64) accumulators.

    Ulysses (u > 1), one all-to-all each way per pass; a rank keeps 1/u of what it packs:
      forward q, k, v (KV heads replicated to lcm(Hkv, u)) then out; backward dout
      then dq, dk, dv: ((H + Hkv') * D + (H + Hkv') * Dv) * B * L * item * (u - 1) / u
      per pass (Dv = ``value_dim``, D without one).
    Ring (r > 1) on the post-all-to-all block of S/r tokens and Hkv'/u KV heads:
      p2p: forward r-1 K/V blocks; backward r-1 K/V blocks + r-1 accumulator dK/dV blocks
      (each accumulator starts at the owner's next rank and reaches the owner in r-1 hops).
      allgather: forward all_gather of (r-1) local K/V; backward all_gather again and
      reduce_scatter of (r-1) accumulator dK/dV blocks ((r-1)/r of the gathered dK/dV).
    A sliding ``window`` (transformers' W, a dense sequence in ``layout``) shortens the
    p2p ring to k steps (:func:`usp.ring.window.ring_steps`), the dK/dV's last hop going
    straight to its owner. ``contiguous``: k = min(r, 1 + ceil((W-1) / (S/r))), and hop
    s (1 .. k-1) carries only the last t_s = min(S/r, W-1 - (s-1) * S/r) rows of K/V
    (the keys the window needs), the dK/dV accumulator t_1 rows; ``zigzag``: a window
    shorter than a chunk (1 <= W-1 < S/2r) sends its two neighbours the last W-1 rows of
    a chunk each (forward; backward again, and the dK/dV of as many rows back:
    :mod:`usp.ring.zigzag_tails`), a longer one k = r whole blocks, W = 1 nothing.
    ``doc_lengths``: packed documents' lengths in the replica's sequence (each a multiple
    of the layout's chunks). p2p, eager: a window shorter than every document's chunk
    (W-1 < min n_d, n_d = length_d / r contiguous, / 2r zigzag) sends the last W-1 rows
    of each of the N documents, one message (contiguous: to the next rank) or two
    (zigzag: a piece's each way), and their dK/dV back (:mod:`usp.ring.packed_tails`);
    a longer one (some n_d <= W-1) sends each query chunk the rows of earlier chunks its
    windows read, from their owners, one message per chunk and distance, and their dK/dV
    straight back: amounts that differ between ring ranks, ``rank``'s (the ring rank,
    :func:`document_reach_rows`). (A compiled graph runs every step with whole blocks.)
    All-gather: the sum over documents of what each document's block (length_d / r rows)
    would gather as a dense sequence (:func:`window_gather_rows`). A window holding the
    longest document is none.
    ``value_dim``: v's head size when it is not q/k's ``head_dim`` (MLA): the all-to-alls
    move each tensor at its own size (q, k, dq, dk at ``head_dim``; v, out, dout, dv at
    ``value_dim``: ``usp.sp.attend`` pads to one head size after them), and so do the
    ring's K/V and dK/dV messages (``head_dim + value_dim`` columns per K/V pair instead
    of 2 * D).
    The all-gather ring with a window gathers m rows of every rank's block instead of
    S/r (:func:`window_gather_rows`; packed, summed over documents), and reduce-scatters
    their dK/dV; the all-to-alls move what they move without a window.
    """
    u, r = ulysses, ring
    local = seqlen // (u * r)
    value_dim = shape.head_dim if value_dim is None else value_dim
    kv_heads = shape.kv_heads * kv_replication(shape.heads, shape.kv_heads, u)
    forward: dict[str, dict[str, int]] = {}
    backward: dict[str, dict[str, int]] = {}
    if u > 1:
        token_bytes = batch * local * item_bytes  # one head column of this rank's tokens
        # q and k at q/k's head size, v and out at v's (each at its own, as sent)
        columns = (shape.heads + kv_heads) * shape.head_dim + kv_heads * value_dim
        qkv = columns // u * (u - 1) * token_bytes
        out = shape.heads // u * (u - 1) * value_dim * token_bytes
        forward["all_to_all"] = _counts(qkv + out, 2)
        backward["all_to_all"] = _counts(out + qkv, 2)
    if r > 1:
        # K and V elements of a block, each at its own head size
        block = batch * (seqlen // r) * (kv_heads // u) * (shape.head_dim + value_dim)
        kv, dkv = block * item_bytes, block * acc_bytes
        hops, block_len = r - 1, seqlen // r
        # rows of each hop's K/V message, and of the travelling dK/dV accumulator
        rows, acc_rows = [block_len] * hops, block_len
        longest = seqlen if doc_lengths is None else max(doc_lengths)
        reach = None  # packed, a window past some chunk: per-rank rows (document_reach)
        if window is not None and window < longest:  # a window holding every document: none
            chunks = None
            if doc_lengths is not None:  # each document's chunk length
                chunks = tuple(n // (r if layout == "contiguous" else 2 * r) for n in doc_lengths)
            hops = ring_steps(layout, r, block_len, chunks, window - 1) - 1
            rows = [block_len] * hops
            if chunks is not None:  # packed: whole blocks, or every document's tail
                if 0 < window - 1 < min(chunks):  # (packed_tails): one way, or both (zigzag)
                    hops = 1 if layout == "contiguous" else 2
                    rows = [len(chunks) * (window - 1)] * hops
                else:
                    reach = document_reach_rows(layout, r, rank, chunks, window - 1)
            elif layout == "contiguous":  # only the keys the window needs (p2p.tail_starts)
                rows = [min(block_len, window - 1 - s * block_len) for s in range(hops)]
            elif 0 < window - 1 < block_len // 2:  # zigzag: tails both ways (zigzag_tails)
                hops, rows = 2, [window - 1] * 2
            acc_rows = rows[0] if rows else 0
        if reach is not None and ring_impl == "p2p":
            (sent, sends), (received, receives) = reach
            row = kv // block_len  # one row of K and V, in the input's dtype
            acc_row = dkv // block_len
            if sends + receives:
                forward["p2p"] = {"sent": sent * row, "received": received * row,
                                  "calls": sends + receives}  # fmt: skip
                backward["p2p"] = {
                    "sent": sent * row + received * acc_row,
                    "received": received * row + sent * acc_row,
                    "calls": 2 * (sends + receives),
                }
        elif ring_impl == "p2p":
            if hops:  # a window of 1 (each query sees itself): nothing moves
                kv_sent = sum(rows) * kv // block_len
                dkv_sent = hops * acc_rows * dkv // block_len
                forward["p2p"] = _counts(kv_sent, hops)
                backward["p2p"] = _counts(kv_sent + dkv_sent, 2 * hops)
        else:
            gathered = block_len  # rows each rank contributes to the all-gather
            if window is not None and window < longest:
                # each document's block (length / r) as a dense one's (window_gather_rows)
                blocks = [block_len] if doc_lengths is None else [n // r for n in doc_lengths]
                gathered = sum(window_gather_rows(layout, r, b, window - 1) for b in blocks)
            if gathered:  # a window of 1: nothing is gathered
                kv, dkv = kv * gathered // block_len, dkv * gathered // block_len
                forward["all_gather"] = _counts((r - 1) * kv, 1)
                backward["all_gather"] = _counts((r - 1) * kv, 1)
                backward["reduce_scatter"] = _counts((r - 1) * dkv, 1)
    return {"forward": forward, "backward": backward}


def document_reach_rows(
    layout: str, ring: int, rank: int, chunks: tuple[int, ...], w: int
) -> tuple[tuple[int, int], tuple[int, int]]:
    """((rows sent, messages sent), (rows received, messages received)) of ring rank
    ``rank`` when packed documents with chunk lengths ``chunks`` read, under the kernels'
    left window w, past some document's chunk (:mod:`usp.ring.document_reach`). Chunk c
    of every document is held by rank c (contiguous; zigzag: c < r) or 2r-1-c (zigzag,
    c >= r); a query chunk reads from the chunk j back T_j = sum_d t_dj rows,
    t_dj = max(0, min(n_d, w - (j-1) n_d)), one message per (chunk, j) with T_j > 0 whose
    two chunks are on different ranks."""
    count = 2 * ring if layout == "zigzag" else ring
    owner = [c if layout == "contiguous" or c < ring else 2 * ring - 1 - c for c in range(count)]
    reach = [sum(max(0, min(n, w - (j - 1) * n)) for n in chunks) for j in range(count)]
    sent = received = sends = receives = 0
    for reader in range(count):
        for source in range(reader):
            rows = reach[reader - source]
            if not rows or owner[reader] == owner[source]:
                continue
            if owner[source] == rank:
                sent, sends = sent + rows, sends + 1
            if owner[reader] == rank:
                received, receives = received + rows, receives + 1
    return (sent, sends), (received, receives)


def window_gather_rows(layout: str, ring: int, block_len: int, w: int) -> int:
    """Rows of its block every rank contributes to a windowed all-gather ring (the
    kernels' left window ``w`` = W - 1, a dense sequence of blocks of ``block_len``):
    the most rows of one block that other ranks' windows reach. (Packed documents: the
    sum of this over the documents' blocks of length_d / r rows, since one owner has the
    most of every document at once: rank 0 under contiguous, rank 1 under zigzag.)
    A window reaches the
    last t = min(n, w) keys of the chunk before a query chunk (chunk length n), and
    fewer of the chunks before that, so:

    - contiguous (n = S/r): m = t (each rank's chunk is read by the next rank's);
    - zigzag (n = S/2r, rank i holds chunks i and 2r-1-i): m = 2t for r >= 3 (a middle
      rank's two chunks are read by its two neighbours); for r = 2, rank 1's chunk 1 is
      read by its own chunk 2 and, two chunks on, by rank 0's chunk 3 (its last
      min(n, max(0, w - n)) keys), and its chunk 2 by chunk 3: m = t + min(n, max(0, w-n)).
    """
    if ring < 2:
        return 0
    if layout == "contiguous":
        return min(block_len, w)
    n = block_len // 2
    t = min(n, w)
    return 2 * t if ring >= 3 else t + min(n, max(0, w - n))


def gdn_traffic(
    *,
    batch: int,
    seqlen: int,
    ulysses: int,
    ring: int,
    key_heads: int,
    heads: int,
    key_dim: int,
    value_dim: int,
    kernel: int,
    layout: str,
    documents: int,
    item_bytes: int,
    gate_bytes: int,
    state_bytes: int,
) -> dict[str, dict[str, dict[str, int]]]:
    """Bytes one rank sends and receives in one Gated DeltaNet layer
    (:func:`usp.linear.gated_deltanet_usp`), as :func:`traffic_formula` gives them for an
    attention layer; docs/models.md's formula, T = batch * seqlen / (u * r) tokens:

      all-to-all (u > 1): (u-1)/u * T * [(2 Hk' dk + H dv) e + 2 H e_g + H dv e]
      all-gather (r > 1): (r-1) * B * N * [(K-1)(2 Hk' dk + H dv)/u + (H/u) dk (dk + dv)] e_c

    Hk' = lcm(Hk, u) (key heads repeated for the split), N = pieces (2 zigzag, 1
    contiguous) x ``documents``; ``item_bytes`` e (q, k, v, the output), ``gate_bytes``
    e_g (g and beta), ``state_bytes`` e_c (the kernel's compute dtype: the conv tails and
    the chunk maps). The backward moves the same: the all-to-alls inverted, a
    reduce-scatter in place of each all-gather. The ring's part does not grow with S.
    """
    u, r = ulysses, ring
    tokens = batch * seqlen // (u * r)
    key_channels = math.lcm(key_heads, u) * key_dim  # Hk' dk
    forward: dict[str, dict[str, int]] = {}
    backward: dict[str, dict[str, int]] = {}
    if u > 1:
        inputs = tokens * (
            (2 * key_channels + heads * value_dim) * item_bytes + 2 * heads * gate_bytes
        )
        output = tokens * heads * value_dim * item_bytes
        moved = (inputs + output) * (u - 1) // u
        forward["all_to_all"] = _counts(moved, 2)
        backward["all_to_all"] = _counts(moved, 2)
    if r > 1:
        pieces = (2 if layout == "zigzag" else 1) * documents
        tails = (kernel - 1) * (2 * key_channels + heads * value_dim) // u
        maps = heads // u * key_dim * (key_dim + value_dim)
        moved = (r - 1) * batch * pieces * (tails + maps) * state_bytes
        forward["all_gather"] = _counts(moved, 2)
        backward["reduce_scatter"] = _counts(moved, 2)
    return {"forward": forward, "backward": backward}


def fsdp_traffic(
    params_per_layer: int,
    other_params: int,
    layers: int,
    *,
    world: int,
    compute_bytes: int,
    reduce_bytes: int,
    reshard_after_forward: bool = True,
) -> dict[str, dict[str, int]]:
    """FSDP2 over all ``world`` ranks: every layer's parameters are all-gathered (in the
    compute dtype) for its forward and again for its backward (except the last layer,
    kept from forward, as :func:`usp.train.parallelize.fully_shard_model` does), the
    root's (embedding, norm, head) once; every gradient is reduce-scattered once, in
    ``reduce_bytes`` per element. A rank receives ``(world - 1) / world`` of each gathered
    tensor and sends as much of each reduced one. Activation checkpointing re-runs a
    layer's forward inside its backward with the parameters already gathered.
    """
    share = (world - 1) / world
    total = params_per_layer * layers + other_params
    gathers = params_per_layer * (2 * layers - (1 if reshard_after_forward else layers))
    gathers += other_params
    gathered = int(gathers * compute_bytes * share)
    reduced = int(total * reduce_bytes * share)
    return {
        "fsdp_all_gather": {"sent": gathered, "received": gathered, "calls": 2 * layers},
        "fsdp_reduce_scatter": {"sent": reduced, "received": reduced, "calls": layers + 1},
    }


def step_traffic(
    attention: dict[str, dict[str, dict[str, int]]],
    fsdp: dict[str, dict[str, int]],
    *,
    layers: int,
    micro_batches: int,
    recompute: bool,
    linear: dict[str, dict[str, dict[str, int]]] | None = None,
    linear_layers: int = 0,
    mixers: Sequence[tuple[dict[str, dict[str, dict[str, int]]], int]] = (),
) -> dict[str, int]:
    """Bytes sent per step by kind: the attention's forward (twice with activation
    checkpointing, whose recompute runs it again) and backward per layer and
    micro-batch (``layers`` attention layers; ``linear_layers`` Gated DeltaNet layers
    moving ``linear`` each, and each (traffic, layer count) of ``mixers``
    (:func:`linear_traffic`), counted the same way under ``linear_*`` kinds), plus FSDP's
    per step."""
    sent: dict[str, int] = {}
    passes = {"forward": 2 if recompute else 1, "backward": 1}
    for prefix, traffic, count in (
        ("attention", attention, layers),
        ("linear", linear, linear_layers),
        *(("linear", traffic, count) for traffic, count in mixers),
    ):
        for name, kinds in (traffic or {}).items():
            for kind, counts in kinds.items():
                key = f"{prefix}_{kind}"
                sent[key] = sent.get(key, 0) + counts["sent"] * passes[name] * count * micro_batches
    for kind, counts in fsdp.items():
        sent[kind] = sent.get(kind, 0) + counts["sent"]
    return sent


#: each linear mixer's formula by its name (gdn_traffic here, the others in
#: :mod:`usp.planner.mixer_traffic`): what one layer sends and receives
LINEAR_TRAFFIC = {
    "gated_deltanet": gdn_traffic,
    "mamba2": mixer_traffic.mamba2_traffic,
    "kda": mixer_traffic.kda_traffic,
    "short_conv": mixer_traffic.short_conv_traffic,
    "mamba1": mixer_traffic.mamba1_traffic,
}


def linear_traffic(mixer: str, **shape) -> dict[str, dict[str, dict[str, int]]]:
    """One ``mixer`` layer's traffic (:data:`LINEAR_TRAFFIC`; ``shape``: its formula's
    keywords), for :func:`step_traffic`'s ``mixers``."""
    if mixer not in LINEAR_TRAFFIC:
        raise ValueError(
            f"no traffic formula for the linear mixer {mixer!r}; known: {', '.join(LINEAR_TRAFFIC)}"
        )
    return LINEAR_TRAFFIC[mixer](**shape)
