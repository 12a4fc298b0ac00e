"""One ring-attention call as validated (:class:`PreparedRing`), passed as one object
through autograd."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.distributed as dist

from usp.comm.stats import CommStats
from usp.comm.traced import TracedGroup
from usp.ring.calls import BlockKernels
from usp.ring.kv_message import KVDims
from usp.ring.placement import RankPlacement


@dataclass(frozen=True)
class PreparedRing:
    """A ring-attention call as ``prepare_ring`` validated it: the group (None for a
    single process), the options, the resolved softmax scale and kernels, and this rank's
    placement of the sequence."""

    group: dist.ProcessGroup | None
    causal: bool
    layout: str
    ring_impl: str
    #: the resolved softmax scale and, per block shape, the backend (see ``calls.py``)
    kernels: BlockKernels
    placement: RankPlacement
    stats: CommStats | None = None
    #: attend to this many groups of KV heads one after the other, to bound memory
    #: (allgather: the gathered K/V; p2p and local: every buffer of a pass)
    kv_head_chunks: int = 1
    #: the ring's group as plain values (name, size, this rank), for the functional
    #: collectives of a compiled graph (``usp.comm.traced``); None for a ring of one
    peers: TracedGroup | None = None
    #: the kernels' left window (keys p - window .. p of a query at position p of its
    #: document; ``causal`` only), None for full attention (``usp.ring.window``)
    window: int | None = None
    #: MLA: the real head sizes of K and V inside the pairs padded to one head size, so
    #: that ring messages carry only those columns (:mod:`usp.ring.kv_message`); None
    #: when K and V have the same head size
    kv_dims: KVDims | None = None
    #: the ring's size, this rank in it, and whether the documents are packed: fields,
    #: not properties: inside an autograd function, traced code reads only the fields
    #: of the objects it is given
    size: int = field(init=False)
    rank: int = field(init=False)
    packed: bool = field(init=False)

    def __post_init__(self):
        object.__setattr__(self, "size", 1 if self.peers is None else self.peers.size)
        object.__setattr__(self, "rank", 0 if self.peers is None else self.peers.rank)
        object.__setattr__(self, "packed", self.placement.packed)

    @property
    def softmax_scale(self) -> float:
        return self.kernels.scale

    @property
    def backend(self) -> str:
        """The backend name asked for (``auto`` or a name); ``kernels`` holds the resolved ones."""
        return self.kernels.backend
