"""Options of one ring-attention call, passed as one object through autograd."""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from usp.comm.stats import CommStats

RING_IMPLS = ("p2p", "allgather")


@dataclass(frozen=True)
class RingConfig:
    group: dist.ProcessGroup
    causal: bool
    softmax_scale: float | None
    layout: str
    ring_impl: str
    backend: str
    stats: CommStats | None = None
    #: allgather only: gather K/V in this many chunks of KV heads to bound memory
    kv_head_chunks: int = 1

    @property
    def size(self) -> int:
        return dist.get_world_size(self.group)

    @property
    def rank(self) -> int:
        return dist.get_rank(self.group)
