"""Options of one ring-attention call, passed as one object through autograd."""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from usp.comm.stats import CommStats
from usp.ring.calls import BlockKernels
from usp.ring.placement import RankPlacement


@dataclass(frozen=True)
class RingConfig:
    """A validated call: the group (None for a single process), the options, the resolved
    softmax scale and this rank's placement of the sequence."""

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

    @property
    def softmax_scale(self) -> float:
        return self.kernels.scale

    @property
    def backend(self) -> str:
        """The backend name asked for (``auto`` or a name); ``kernels`` holds the resolved ones."""
        return self.kernels.backend

    @property
    def size(self) -> int:
        return 1 if self.group is None else dist.get_world_size(self.group)

    @property
    def rank(self) -> int:
        return 0 if self.group is None else dist.get_rank(self.group)

    @property
    def packed(self) -> bool:
        return self.placement.packed
