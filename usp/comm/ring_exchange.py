"""Point-to-point exchange around a ring: send to the next rank, receive from the previous.

Used with double buffering: post the exchange of the block you are about to compute
on, compute, then wait. On ring size 1 nothing is ever sent (gloo cannot send to
itself, and it would be wasted work anyway). :class:`RingExchange` posts on the group
(eager); :class:`TracedRingExchange` is the same exchange inside a compiled graph
(:mod:`usp.comm.traced`). Both return a handle whose ``wait()`` gives the received
tensor: the buffer passed as ``recv_into`` (eager) or a fresh tensor (compiled).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from usp.comm.stats import CommStats
from usp.comm.traced import PostedShift, TracedGroup, post_shift


def _bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


@dataclass
class PendingExchange:
    received: torch.Tensor
    _requests: list

    def wait(self) -> torch.Tensor:
        for request in self._requests:
            request.wait()
        return self.received


class RingExchange:
    """Neighbours of this rank in ``group``; ring order is the group's rank order."""

    def __init__(self, group: dist.ProcessGroup | None, stats: CommStats | None = None):
        """``group=None``: a single process (a ring of one, no communication)."""
        self.group = group
        self.stats = stats
        if group is None:
            self.size, self.rank = 1, 0
            return
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self._next = dist.get_global_rank(group, (self.rank + 1) % self.size)
        self._prev = dist.get_global_rank(group, (self.rank - 1) % self.size)
        self._coalesced: bool | None = None  # known at the first exchange (per device)

    def _coalescing(self, device: torch.device) -> bool:
        if self._coalesced is None:
            self._coalesced = self.group._get_backend(device).supports_coalescing
        return self._coalesced

    def start(
        self, send: torch.Tensor, recv_into: torch.Tensor | None = None, hops: int = 1
    ) -> PendingExchange:
        """Post ``send`` -> next rank and a receive from the previous rank into ``recv_into``
        (a fresh buffer like ``send`` when None). Returns a handle; call ``wait()``.
        ``hops``: send ``hops`` ranks ahead and receive from ``hops`` ranks behind instead
        (a windowed ring returning its gradients to their owners early)."""
        if self.size == 1:
            raise RuntimeError("RingExchange.start called on a ring of size 1")
        if hops != 1:
            return self._shift(send, recv_into, hops)
        recv = torch.empty_like(send) if recv_into is None else recv_into
        # NCCL: one coalesced batch (separate calls could deadlock)
        if self._coalescing(send.device):
            ops = [
                dist.P2POp(dist.isend, send, self._next, self.group),
                dist.P2POp(dist.irecv, recv, self._prev, self.group),
            ]
            requests = dist.batch_isend_irecv(ops)
        else:
            # gloo (and the fake backend): what batch_isend_irecv does for a backend
            # without coalescing, posted on the group directly, without its per-call
            # argument checks (a third of a ring step's host time on CPU)
            requests = [
                self.group.send([send], (self.rank + 1) % self.size, 0),
                self.group.recv([recv], (self.rank - 1) % self.size, 0),
            ]
        if self.stats is not None:
            self.stats.record("p2p", sent=_bytes(send), received=_bytes(recv))
        return PendingExchange(recv, requests)

    def _shift(self, send, recv_into, hops: int) -> PendingExchange:
        recv = torch.empty_like(send) if recv_into is None else recv_into
        to, source = (self.rank + hops) % self.size, (self.rank - hops) % self.size
        if self._coalescing(send.device):
            ops = [
                dist.P2POp(dist.isend, send, dist.get_global_rank(self.group, to), self.group),
                dist.P2POp(dist.irecv, recv, dist.get_global_rank(self.group, source), self.group),
            ]
            requests = dist.batch_isend_irecv(ops)
        else:
            requests = [self.group.send([send], to, 0), self.group.recv([recv], source, 0)]
        if self.stats is not None:
            self.stats.record("p2p", sent=_bytes(send), received=_bytes(recv))
        return PendingExchange(recv, requests)

    def post(self, sends, receives) -> tuple[list[PendingExchange], PendingExchange]:
        """Messages between any ranks of the ring (not a shift): ``sends`` and
        ``receives`` are lists of (tensor, ring rank); messages between two ranks match
        in the order each posts them. Returns a handle per receive and one for every
        send. Each send and each receive counts as one call."""
        if self.size == 1:
            raise RuntimeError("RingExchange.post called on a ring of size 1")
        pairs = sends + receives
        if pairs and self._coalescing(pairs[0][0].device):  # NCCL: one batch
            ops = [
                dist.P2POp(op, t, dist.get_global_rank(self.group, peer), self.group)
                for op, part in ((dist.isend, sends), (dist.irecv, receives))
                for t, peer in part
            ]
            # one coalesced batch may return one request for all: every handle waits all
            requests = dist.batch_isend_irecv(ops)
            sent, received = requests, [requests] * len(receives)
        else:
            sent = [self.group.send([t], peer, 0) for t, peer in sends]
            received = [[self.group.recv([t], peer, 0)] for t, peer in receives]
        if self.stats is not None:
            for t, _ in sends:
                self.stats.record("p2p", sent=_bytes(t), received=0)
            for t, _ in receives:
                self.stats.record("p2p", sent=0, received=_bytes(t))
        handles = [PendingExchange(t, r) for (t, _), r in zip(receives, received)]
        return handles, PendingExchange(None, sent)


class TracedRingExchange:
    """:class:`RingExchange` inside a compiled graph: the shift is a functional
    collective (:func:`usp.comm.traced.post_shift`), its ``wait`` a graph node; nothing
    is counted (the graph cannot update host counters)."""

    def __init__(self, peers: TracedGroup | None):
        """``peers=None``: a ring of one (no communication)."""
        self.peers = peers
        self.size = 1 if peers is None else peers.size
        self.rank = 0 if peers is None else peers.rank

    def start(
        self, send: torch.Tensor, recv_into: torch.Tensor | None = None, hops: int = 1
    ) -> PostedShift:
        """Post ``send`` -> next rank (``hops`` ranks ahead); ``recv_into`` is not used
        (the op allocates)."""
        if self.peers is None:
            raise RuntimeError("TracedRingExchange.start called on a ring of size 1")
        return post_shift(send, self.peers, hops)
