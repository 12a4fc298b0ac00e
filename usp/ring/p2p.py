"""Ring attention with point-to-point K/V passing, double buffered.

Forward: at each of the r steps, post the send of the K/V block we hold to the next
rank (and the receive of the previous rank's) before computing on it, so the transfer
overlaps the kernel. Partial results merge by LSE in float32.

Backward: K/V circulate again; each block's dK/dV accumulator (float32) starts at the
owner's next rank, travels one step behind the K/V, collects every other rank's
contribution and reaches the owner after r-1 hops, who adds its own. dQ accumulates
locally in float32.

Sliding windows (:mod:`usp.ring.window`): the blocks are cut to the window, the ring
rotates only while some rank has a block inside it (the accumulators' last hop then goes
straight to their owners). Under ``contiguous`` (dense) each hop sends only the keys the
window needs, the suffix of the block that later steps read (:func:`tail_starts`):
O(W) bytes, not O(S/r). A window shorter than the chunks it reads across exchanges
tails with the neighbours instead (:mod:`usp.ring.tails`): under ``zigzag`` (dense,
eager and compiled) a window shorter than a chunk (:mod:`usp.ring.zigzag_tails`), and
eagerly, packed documents under either layout with a window shorter than every
document's chunk, each document's tail (:mod:`usp.ring.packed_tails`), and other packed
windows the rows of earlier chunks each rank's windows read, from their owners
(:mod:`usp.ring.document_reach`); longer dense zigzag windows send whole blocks.

Compiled, a rank's graph must post the same shifts in the same passes as its
neighbours', also when it never reads a block (rank 0 of a causal contiguous ring gets
the last rank's): every received K/V message ends in an opaque copy of an output
(:func:`usp.comm.traced.copy_after`; else the shift is dead code on that rank alone),
and the first dK/dV accumulator is tied to the incoming gradient
(:func:`usp.comm.traced.stack_after`; else, still zeros on such a rank, its shift
would be posted in the forward). Either way the neighbours would wait forever.
"""

from __future__ import annotations

import torch

from usp.comm import traced
from usp.comm.ring_exchange import RingExchange, TracedRingExchange
from usp.compile_marks import constant_result
from usp.kernels import merge_into
from usp.kernels.docs import DeviceBounds
from usp.kernels.masks import accumulation_dtype
from usp.ring.calls import calls_for
from usp.ring.config import PreparedRing
from usp.ring.document_reach import reach_backward, reach_forward, reach_plan
from usp.ring.kv_message import KVDims, start_pair
from usp.ring.layout import ALL, packed_step_blocks, step_blocks
from usp.ring.packed_tails import packed_tails
from usp.ring.tails import Tails, tails_backward, tails_forward
from usp.ring.window import (
    dense_window_blocks,
    packed_window_blocks,
    ring_steps,
    window_documents,
)
from usp.ring.zigzag_tails import tail_plan


def _kv_rank(ring: RingExchange, step: int) -> int:
    return (ring.rank - step) % ring.size


def _exchange(cfg: PreparedRing):
    """The ring's exchange: posted on the group (eager), or functional collectives
    that a compiled graph holds (their waits where the loops below wait)."""
    if torch.compiler.is_compiling():
        return TracedRingExchange(cfg.peers)
    return RingExchange(cfg.group, cfg.stats)


def _plan(cfg: PreparedRing, local_len: int, documents: DeviceBounds | None = None):
    """(blocks of a step, the kernel calls that compute them) for dense or packed input.
    ``documents``: a compiled graph's piece-vs-piece documents (device boundaries and
    the longest document as a symbolic size), from the live PackedSequence because
    ``cfg`` is the trace's constant, shared by every packing of the shape; None:
    ``cfg``'s own."""
    w, layout, size = cfg.window, cfg.layout, cfg.size
    if not cfg.packed:
        if w is not None:
            blocks = lambda i, j: dense_window_blocks(layout, size, i, j, local_len, w)  # noqa: E731
        else:
            blocks = lambda i, j: step_blocks(layout, cfg.causal, i, j, local_len)  # noqa: E731
        return blocks, calls_for(cfg, None)
    piece_len = cfg.placement.piece_len
    if w is not None and torch.compiler.is_compiling():
        # the graph serves every packing: every block a window could reach, masked
        blocks = lambda i, j: packed_window_blocks(layout, size, i, j, piece_len, None, w)  # noqa: E731
    elif w is not None:
        lengths = chunk_lengths(cfg)
        blocks = lambda i, j: packed_window_blocks(layout, size, i, j, piece_len, lengths, w)  # noqa: E731
    else:
        blocks = lambda i, j: packed_step_blocks(layout, cfg.causal, i, j, piece_len)  # noqa: E731
    return blocks, calls_for(cfg, cfg.placement.piece_docs if documents is None else documents)


def chunk_lengths(cfg: PreparedRing) -> tuple[int, ...]:
    """The chunk length of every packed document (a piece holds one chunk of each)."""
    bounds = cfg.placement.documents.piece_bounds
    return tuple(b - a for a, b in zip(bounds, bounds[1:]))


def tail_starts(cfg: PreparedRing, local_len: int, n_steps: int) -> list[int] | None:
    """A windowed dense ring in the contiguous layout sends only the keys the window
    needs: the block a rank holds at step s is its owner's rows from ``starts[s] =
    max(0, s * L - w)`` on (the keys before are outside every later query's window), so
    each hop forwards a suffix of what arrived, and a window shorter than a block moves
    its last w rows only. None: whole blocks (no window, packed documents, zigzag)."""
    if cfg.window is None or cfg.packed or cfg.layout != "contiguous" or n_steps < 2:
        return None
    return [0] + [max(0, s * local_len - cfg.window) for s in range(1, n_steps)]


def _shifted(rows: slice, offset: int) -> slice:
    """Block rows in a message that starts ``offset`` rows into its block."""
    return rows if not offset else slice(rows.start - offset, rows.stop - offset)


def steps(cfg: PreparedRing, local_len: int) -> int:
    """How many steps the ring rotates: all of them, or with a window only while some
    rank still has a block inside it (:func:`usp.ring.window.ring_steps`)."""
    if cfg.window is None or cfg.size == 1:
        return cfg.size
    if cfg.packed and torch.compiler.is_compiling():  # the packing is not a constant
        return cfg.size
    lengths = chunk_lengths(cfg) if cfg.packed else None
    return _ring_steps(cfg.layout, cfg.size, local_len, lengths, cfg.window)


@constant_result
def _ring_steps(
    layout: str, size: int, local_len: int, lengths: tuple[int, ...] | None, w: int
) -> int:
    """:func:`usp.ring.window.ring_steps`, a constant of a compiled graph: Dynamo runs it
    eagerly instead of tracing it (it ignores the function's cache and traced every
    rank's blocks at every step, in the forward and again in the backward: a fifth of
    Dynamo's time on a windowed contiguous ring of 4)."""
    return ring_steps(layout, size, local_len, lengths, w)


def block_shapes(cfg: PreparedRing, local_len: int, heads: int, kv_heads: int) -> set[tuple]:
    """The (Sq, Sk, H, Hkv, causal, varlen) of every kernel call a pass of this rank makes
    (the same in forward and backward), from the blocks the loops below run."""
    blocks, _ = _plan(cfg, local_len)
    rows = range(local_len)
    shapes = set()
    for kv_rank in range(cfg.size):
        for b in blocks(cfg.rank, kv_rank):
            if b.delta:  # one dense call per document
                docs = cfg.placement.piece_docs
                calls = window_documents(cfg.kernels, docs, b.delta, b.window)
                shapes |= calls.shapes(heads, kv_heads)
                continue
            shape = (len(rows[b.q_rows]), len(rows[b.kv_rows]), heads, kv_heads, b.causal)
            shapes.add((*shape, cfg.packed, b.window))
    return shapes


class _Rows:
    """The row ranges of one tensor that a ring call's blocks read or write, each view
    made once per call: the blocks of every step use the same two or three ranges (all
    rows, a zigzag half, a piece), and each view is an op of host time."""

    __slots__ = ("tensor", "_dim", "_views")

    def __init__(self, tensor: torch.Tensor, dim: int = 1):
        self.tensor = tensor
        self._dim = dim  # the row dimension: 1 for [B, L, ...], 2 for an LSE [B, H, L]
        self._views: dict[tuple, torch.Tensor] = {}

    def __getitem__(self, rows: slice) -> torch.Tensor:
        if rows == ALL:
            return self.tensor
        key = (rows.start, rows.stop)
        view = self._views.get(key)
        if view is None:
            start, stop, _ = rows.indices(self.tensor.shape[self._dim])
            view = self._views[key] = self.tensor.narrow(self._dim, start, stop - start)
        return view


class _Pair:
    """A [2, B, L, Hkv, D] ring message (K and V, or dK and dV) with the row views of
    its two halves."""

    __slots__ = ("tensor", "first", "second")

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor
        self.first, self.second = _Rows(tensor[0]), _Rows(tensor[1])


class _KVRing:
    """The K/V message a step computes on (``current``: its owner's block from row
    ``offset(step)`` on) and how the next one arrives: a whole block in the ``spare``
    buffer (they swap at each exchange), or with a window only the suffix that later
    steps need (:func:`tail_starts`), each in a buffer of its own size. Compiled,
    ``anchors`` holds one element of every message received, for
    :func:`usp.comm.traced.copy_after` (a block a rank never computes on would
    otherwise drop its shift from that rank's graph alone)."""

    __slots__ = ("current", "spare", "tails", "n_steps", "anchors", "dims")

    def __init__(
        self, message: torch.Tensor, n_steps: int, tails: list[int] | None, dims: KVDims | None
    ):
        self.dims = dims  # MLA: K's and V's own head sizes (sent without padding)
        self.current = _Pair(message)
        whole = n_steps > 1 and tails is None
        self.spare = _Pair(torch.empty_like(message)) if whole else None
        self.tails, self.n_steps = tails, n_steps
        self.anchors: list[torch.Tensor] = []

    def offset(self, step: int) -> int:
        return 0 if self.tails is None else self.tails[step]

    def send(self, ring: RingExchange, step: int):
        """Post the message of the next step (None after the last)."""
        if step + 1 >= self.n_steps:
            return None
        if self.tails is None:
            return start_pair(ring, self.current.tensor, self.dims, self.spare.tensor)
        held = self.current.tensor  # [2, B, rows, Hkv, D]
        cut = self.tails[step + 1] - self.tails[step]
        return start_pair(ring, held.narrow(2, cut, held.shape[2] - cut).contiguous(), self.dims)

    def receive(self, pending, step: int) -> None:
        """Wait for ``pending`` (a whole block arrived in ``spare``, or compiled in a
        tensor of its own; our send finished too, so what we sent becomes the spare, or
        is dropped when no receive is left)."""
        received = pending.wait()
        if torch.compiler.is_compiling():
            self.anchors.append(traced.anchor(received))
        if self.tails is not None:
            self.current = _Pair(received)
            return
        spare = self.current if step + 2 < self.n_steps else None
        self.current = _arrived(received, self.spare)
        self.spare = spare


def _arrived(received: torch.Tensor, buffer: _Pair) -> _Pair:
    """The message a wait gave: ``buffer`` itself (eager, received in place), or a
    tensor the compiled graph's collective allocated."""
    return buffer if received is buffer.tensor else _Pair(received)


def _start_accumulator(x: torch.Tensor, acc: torch.dtype) -> torch.Tensor:
    """A kernel's output as the accumulator it starts (the kernels return fresh tensors
    that nothing else holds, so one in the accumulators' dtype is used as it is)."""
    return x if x.dtype == acc else x.to(acc)


def _tails(cfg: PreparedRing, local_len: int) -> Tails | None:
    """The neighbour exchange of tails that replaces the ring (a window shorter than
    every chunk it reads across; packed: eager), or None."""
    if cfg.packed:
        return packed_tails(cfg, local_len)
    return tail_plan(cfg, local_len)


def p2p_forward(q, k, v, cfg: PreparedRing, documents=None) -> tuple[torch.Tensor, torch.Tensor]:
    """q [B, L, H, D], k/v [B, L, Hkv, D] (local) -> out [B, L, H, D], lse [B, H, L];
    ``documents`` as in :func:`_plan`."""
    neighbours = _tails(cfg, q.shape[1])
    if neighbours is not None:  # a window shorter than every chunk: neighbours' tails
        return tails_forward(q, k, v, cfg, neighbours)
    reach = reach_plan(cfg, q.shape[1])
    if reach is not None:  # packed, longer windows: the rows each rank's windows read
        return reach_forward(q, k, v, cfg, reach)
    ring = _exchange(cfg)
    acc = accumulation_dtype(q.dtype)
    n_steps = steps(cfg, q.shape[1])
    # [2, B, L, Hkv, D]: one message
    kv = _KVRing(torch.stack([k, v]), n_steps, tail_starts(cfg, q.shape[1], n_steps), cfg.kv_dims)
    blocks, calls = _plan(cfg, q.shape[1], documents)
    q_rows = _Rows(q)
    out_rows = lse_rows = None  # float32 accumulators [B, L, H, D] and [B, H, L]
    for step in range(n_steps):
        pending = kv.send(ring, step)
        held, offset = kv.current, kv.offset(step)
        for block in blocks(ring.rank, _kv_rank(ring, step)):
            kv_rows = _shifted(block.kv_rows, offset)
            block_out, block_lse = calls.forward(
                q_rows[block.q_rows], held.first[kv_rows], held.second[kv_rows],
                block.causal, block.window, block.delta,
            )  # fmt: skip
            if out_rows is None and block.q_rows == ALL:  # the first block sees every row
                out_rows = _Rows(_start_accumulator(block_out, acc))
                lse_rows = _Rows(_start_accumulator(block_lse, acc), dim=2)
            else:
                if out_rows is None:
                    out = torch.zeros(q.shape[:-1] + (v.shape[-1],), dtype=acc, device=q.device)
                    lse = torch.full(lse_shape(q), float("-inf"), dtype=acc, device=q.device)
                    out_rows, lse_rows = _Rows(out), _Rows(lse, dim=2)
                    del out, lse
                merge_into(out_rows[block.q_rows], lse_rows[block.q_rows], block_out, block_lse)
            del block_out, block_lse  # merged: not alive during the next block's kernel
        del held
        if pending is not None:
            kv.receive(pending, step)
    anchors = kv.anchors
    del kv
    lse = lse_rows.tensor
    if anchors:  # compiled: every shift stays in this rank's graph
        lse = traced.copy_after(lse, lse.dtype, anchors)
    return out_rows.tensor.to(q.dtype), lse


def lse_shape(q: torch.Tensor) -> tuple[int, int, int]:
    """[B, L, H, D] -> the LSE's [B, H, L]."""
    return (q.shape[0], q.shape[2], q.shape[1])


def _add_block_grads(dkv: _Pair, block_grads) -> None:
    """dkv [2, B, L, Hkv, D] += one step's (kv_rows, dk, dv) blocks (a function of its
    own, so that no loop variable keeps the last block alive into the next step)."""
    for kv_rows, dk_block, dv_block in block_grads:
        dkv.first[kv_rows].add_(dk_block)
        dkv.second[kv_rows].add_(dv_block)


def p2p_backward(dout, q, k, v, out, lse, cfg: PreparedRing, documents=None):
    """Gradients of :func:`p2p_forward`. Every buffer is dropped as soon as nothing reads
    it any more (a block's kernel outputs once added, the spare K/V buffer once no
    receive is left, the accumulators before the casts at the end), so that at most
    the float32 dQ, ``own`` and two ``travelling`` dK/dV accumulators, two K/V blocks and
    one step's kernel outputs are alive at once."""
    neighbours = _tails(cfg, q.shape[1])
    if neighbours is not None:
        return tails_backward(dout, q, k, v, out, lse, cfg, neighbours)
    reach = reach_plan(cfg, q.shape[1])
    if reach is not None:
        return reach_backward(dout, q, k, v, out, lse, cfg, reach)
    ring = _exchange(cfg)
    acc = accumulation_dtype(q.dtype)
    dq_rows = _Rows(torch.zeros(q.shape, dtype=acc, device=q.device))
    dout_rows, q_rows, out_rows, lse_rows = _Rows(dout), _Rows(q), _Rows(out), _Rows(lse, dim=2)
    if torch.compiler.is_compiling():  # K/V circulate again in the backward's graph
        message = traced.stack_after([k, v], dout)  # [2, B, L, Hkv, D]
    else:
        message = torch.stack([k, v])
    n_steps = steps(cfg, q.shape[1])
    tails = tail_starts(cfg, q.shape[1], n_steps)
    kv = _KVRing(message, n_steps, tails, cfg.kv_dims)
    del message
    # dK/dV in float32: ``own`` keeps this rank's contribution to its own block (step 0);
    # the accumulator of every other block starts at the owner's next rank, collects
    # one contribution per step, and reaches the owner after r-1 hops. Two buffers
    # (from step 1 on): the accumulator being added to and sent, and the one the next
    # arrives in.
    own = _Pair(torch.zeros((2,) + k.shape, dtype=acc, device=k.device))
    travelling: list[_Pair] = []
    current, dkv_pending = 0, None
    blocks, calls = _plan(cfg, q.shape[1], documents)
    # with tails, the travelling accumulators hold the rows from tails[1] on: every row
    # a later step touches
    first_tail = 0 if tails is None else tails[1]
    for step in range(n_steps):
        kv_pending = kv.send(ring, step)
        held, offset = kv.current, kv.offset(step)
        block_grads = []
        for block in blocks(ring.rank, _kv_rank(ring, step)):
            rows, kv_rows = block.q_rows, _shifted(block.kv_rows, offset)
            dq_block, dk_block, dv_block = calls.backward(
                dout_rows[rows], q_rows[rows], held.first[kv_rows], held.second[kv_rows],
                out_rows[rows], lse_rows[rows], block.causal, block.window, block.delta,
            )  # fmt: skip
            dq_rows[rows].add_(dq_block)
            del dq_block  # added: not alive during the next block's kernel
            acc_rows = _shifted(block.kv_rows, first_tail if step else 0)
            block_grads.append((acc_rows, dk_block, dv_block))
            del dk_block, dv_block
        del held
        if step == 0:
            dkv = own
        elif step == 1:
            shape = own.tensor.narrow(2, first_tail, own.tensor.shape[2] - first_tail).shape
            zeros = torch.zeros(shape, dtype=acc, device=k.device)
            if torch.compiler.is_compiling():
                # tied to the incoming gradient: a rank whose step 1 has no block sends
                # these zeros as they are, and AOT's partitioner would post that shift
                # in the forward, on that rank alone (:func:`traced.stack_after`)
                zeros = traced.stack_after(list(zeros.unbind()), dout)
            travelling = [_Pair(zeros), _Pair(torch.empty_like(zeros))]
            del zeros
            dkv = travelling[current]
        else:  # this block's accumulator arrived (in travelling[current], eager)
            dkv = travelling[current] = _arrived(dkv_pending.wait(), travelling[current])
        _add_block_grads(dkv, block_grads)
        del block_grads
        if step > 0:
            # to the next rank, which adds its share at the next step; after a ring cut
            # short by a window, straight back to the block's owner (step hops behind)
            hops = 1 if step + 1 < ring.size and step + 1 < n_steps else ring.size - step
            receive_into = travelling[1 - current].tensor
            dkv_pending = start_pair(ring, dkv.tensor, cfg.kv_dims, receive_into, hops)
            current = 1 - current
        del dkv
        if kv_pending is not None:
            kv.receive(kv_pending, step)
    anchors = kv.anchors
    del kv
    if dkv_pending is not None:  # everyone else's contributions to this rank's block
        rows = own.tensor.shape[2] - first_tail
        own.tensor.narrow(2, first_tail, rows).add_(dkv_pending.wait())
    del travelling, dkv_pending
    # copies even for float32: dk and dv must not be views of one shared buffer
    # (compiled: the copy of dK also ends every K/V shift, :func:`traced.copy_after`)
    dk = traced.copy_after(own.tensor[0], k.dtype, anchors)
    dv = own.tensor[1].to(v.dtype, copy=True)
    del own
    return dq_rows.tensor.to(q.dtype), dk, dv
