"""Ring attention across the ring group (layer 4): exact, load-balanced, overlapped."""

from usp.ring.api import RingInputError, ring_attention
from usp.ring.config import RING_IMPLS
from usp.ring.documents import LAYOUTS, DocumentLayoutError, Documents

__all__ = [
    "LAYOUTS",
    "RING_IMPLS",
    "DocumentLayoutError",
    "Documents",
    "RingInputError",
    "ring_attention",
]
