"""The collectives of a compiled graph: torch's functional collectives.

Eager code posts its collectives on the process group directly (``collectives.py``,
``ring_exchange.py``): under ``torch.compile`` those calls would break the graph. Here
the same operations are ``torch.ops._c10d_functional`` ops, which Dynamo traces, AOT
autograd keeps in the forward and backward graphs, and Inductor schedules like any op:
each collective is two nodes, the op that posts it and the ``wait_tensor`` that ends
it, so compute placed between them overlaps the transfer.

Every function takes the group's name and ranks as plain values (a call records them
while it is prepared, outside the graph) and returns the received tensor, or for
:func:`post_shift` a :class:`PostedShift` whose ``wait`` gives it. The ring's K/V
rotation is an all-to-all in which only the next rank receives anything
(:func:`post_shift`; as PyTorch's context parallelism rotates by default): unlike
``isend``/``irecv`` (experimental behind ``TORCHDYNAMO_ENABLE_P2P_COMPILATION`` in
torch 2.13) it is a functional op whose output is a fresh tensor, so Inductor's buffer
reuse and AOT's functionalisation treat it like any op. Measured against the
``batch_p2p_ops`` form in ``benchmarks/README.md`` (*Compiled*).

Bytes are not counted here (``CommStats`` is host state a graph cannot update); under
``torch.compile`` the counters see nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

_c10d = torch.ops._c10d_functional


def wait(tensor: torch.Tensor) -> torch.Tensor:
    return _c10d.wait_tensor(tensor)


def all_to_all(send: torch.Tensor, group_name: str, size: int) -> torch.Tensor:
    """Equal-split all-to-all along dim 0: chunk j of ``send`` goes to group rank j."""
    splits = [send.shape[0] // size] * size
    return wait(_c10d.all_to_all_single(send.contiguous(), splits, splits, group_name))


def all_gather(local: torch.Tensor, group_name: str, size: int) -> torch.Tensor:
    """[n, ...] on each rank -> [size * n, ...], in group-rank order."""
    return wait(_c10d.all_gather_into_tensor(local.contiguous(), size, group_name))


def reduce_scatter(full: torch.Tensor, group_name: str, size: int) -> torch.Tensor:
    """[size * n, ...] -> this rank's [n, ...] slice summed over the group."""
    return wait(_c10d.reduce_scatter_tensor(full.contiguous(), "sum", size, group_name))


@dataclass(frozen=True)
class TracedGroup:
    """A process group as the values a functional collective takes (read once, eagerly,
    when a call is prepared): its name, size and this process's rank in it; around a
    ring, ``next`` is where this rank sends and ``prev`` where it receives from."""

    name: str
    size: int
    rank: int
    # fields, not properties: traced code reads an argument's fields only
    next: int = field(init=False)
    prev: int = field(init=False)

    def __post_init__(self):
        object.__setattr__(self, "next", (self.rank + 1) % self.size)
        object.__setattr__(self, "prev", (self.rank - 1) % self.size)

    @classmethod
    def of(cls, group) -> TracedGroup:
        return cls(group.group_name, dist.get_world_size(group), dist.get_rank(group))


class PostedShift:
    """A posted ring shift: :meth:`wait` returns what the previous rank sent."""

    __slots__ = ("_received", "_shape")

    def __init__(self, received: torch.Tensor, shape: torch.Size):
        self._received, self._shape = received, shape

    def wait(self) -> torch.Tensor:
        return wait(self._received).view(self._shape)


def post_shift(send: torch.Tensor, peers: TracedGroup, hops: int = 1) -> PostedShift:
    """Post ``send`` -> the next ring rank and the receive of the previous rank's tensor
    (of the same shape), as one all-to-all whose only non-empty splits are those two;
    ``hops``: to ``hops`` ranks ahead, from ``hops`` ranks behind."""
    numel = send.numel()
    to, source = (peers.rank + hops) % peers.size, (peers.rank - hops) % peers.size
    out_splits = [numel if rank == source else 0 for rank in range(peers.size)]
    in_splits = [numel if rank == to else 0 for rank in range(peers.size)]
    flat = send.contiguous().view(-1)
    received = _c10d.all_to_all_single(flat, out_splits, in_splits, peers.name)
    return PostedShift(received, send.shape)


def all_ranks_true(ok: torch.Tensor, group: TracedGroup | None) -> torch.Tensor:
    """A 0-d bool that is True on every rank of ``group`` exactly when ``ok`` is True on
    all of them (a MIN all-reduce; ``group=None``: ``ok`` itself), so that a check on data
    made inside a graph fails on every rank alike."""
    if group is None or group.size == 1:
        return ok
    flag = ok.to(torch.int32).reshape(1)
    return wait(_c10d.all_reduce(flag, "min", group.name))[0].bool()


def require(ok: torch.Tensor, message: str, group: TracedGroup | None = None) -> None:
    """Inside a compiled graph: fail with ``message`` (a ``RuntimeError`` raised by the
    graph, on every rank of ``group`` alike) unless ``ok`` (a bool tensor) is True."""
    torch._assert_async(all_ranks_true(ok, group), message)


_LIB = torch.library.Library("usp", "FRAGMENT")  # the ops of this package
_LIB.define("stack_after(Tensor[] tensors, Tensor anchor) -> Tensor")


def _stack_after(tensors, anchor):
    return torch.stack(tensors)


_LIB.impl("stack_after", _stack_after, "CompositeExplicitAutograd")


@torch.library.register_fake("usp::stack_after", lib=_LIB)
def _(tensors, anchor):
    return torch.stack(tensors)


def stack_after(tensors: list[torch.Tensor], anchor: torch.Tensor) -> torch.Tensor:
    """``torch.stack(tensors)``, made to depend on ``anchor`` in the graph (which it does
    not read): an opaque op (``usp::stack_after``), so that no decomposition or graph
    pass drops the dependency.

    Why: AOT autograd's partitioner may not recompute a collective, so a collective of
    the backward that depends only on forward values is computed in the forward and its
    result saved for the backward (and merged with the forward's identical one). The
    p2p ring's backward circulates K/V again: its first message stacked after the
    incoming gradient keeps every shift after it in the backward, which then holds one
    or two K/V blocks at a time as eager does, not every rank's block saved from the
    forward to the backward."""
    return torch.ops.usp.stack_after.default(tensors, anchor)


_LIB.define("copy_after(Tensor x, ScalarType dtype, Tensor[] anchors) -> Tensor")


def _copy_after(x, dtype, anchors):
    return x.to(dtype, copy=True)


_LIB.impl("copy_after", _copy_after, "CompositeExplicitAutograd")


@torch.library.register_fake("usp::copy_after", lib=_LIB)
def _(x, dtype, anchors):
    return x.to(dtype, copy=True)


def anchor(received: torch.Tensor) -> torch.Tensor:
    """One element of a received message (a copy: it keeps nothing else alive), for
    :func:`copy_after`."""
    return received.reshape(-1)[:1].clone()


def copy_after(x: torch.Tensor, dtype: torch.dtype, anchors: list[torch.Tensor]) -> torch.Tensor:
    """``x.to(dtype, copy=True)``, made to depend on ``anchors`` in the graph (an opaque
    op, ``usp::copy_after``, as :func:`stack_after`).

    Why: AOT autograd's partitioner keeps only the nodes an output depends on, and a
    collective's ``wait_tensor`` is no exception. A ring shift whose received block a
    rank never computes on (rank 0 of a causal contiguous ring receives the last rank's
    block: every key is after its queries; or a block outside a window) would vanish
    from that rank's graph alone, and the neighbours that still post their half of the
    all-to-all would wait for it forever. Each received message's :func:`anchor` ends
    here, in a copy the ring makes anyway (or a float32 LSE's: a small one)."""
    if not anchors:
        return x.to(dtype, copy=True)
    return torch.ops.usp.copy_after.default(x, dtype, anchors)
