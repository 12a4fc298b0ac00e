"""Options of one ring-attention call, passed as one object through autograd."""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from usp.comm.stats import CommStats
from usp.ring.documents import Documents

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
    #: packed documents (batch 1), or None for a dense sequence
    documents: Documents | None = None

    @property
    def size(self) -> int:
        return dist.get_world_size(self.group)

    @property
    def rank(self) -> int:
        return dist.get_rank(self.group)

    def documents_for(self, local_len: int) -> Documents:
        """The packed documents, or the dense sequence as one document (without a causal
        mask the order of keys does not matter: one contiguous piece)."""
        if self.documents is not None:
            return self.documents
        layout = self.layout if self.causal else "contiguous"
        return Documents.single(local_len * self.size, self.size, layout)
