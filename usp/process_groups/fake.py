"""One process as one rank of a large job: PyTorch's ``fake`` process-group backend.

Collectives of the ``fake`` backend return at once with the right shapes (no data
moves), so a single device can run exactly one rank's share of a P-rank job: its
kernels, its memory, and (through ``CommStats``) the bytes it would send. The benchmarks
use this to time and size one rank; usp skips its cross-rank agreement there.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore  # registers "fake"


@contextmanager
def fake_world(world: int, rank: int, device: torch.device) -> Iterator[None]:
    """A default process group of the ``fake`` backend in which this process is ``rank``
    of ``world``; destroyed on exit. Needs a process without a default group."""
    if dist.is_initialized():
        raise RuntimeError(
            "fake_world needs a process without a default process group (it creates a fake one)"
        )
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()
