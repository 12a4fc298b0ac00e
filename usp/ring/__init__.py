"""Ring attention across the ring group (layer 4): exact, load-balanced, overlapped."""

from usp.options import LAYOUTS, RING_IMPLS
from usp.ring.api import RingInputError, ring_attention
from usp.ring.documents import DocumentLayoutError, Documents

__all__ = [
    "LAYOUTS",
    "RING_IMPLS",
    "DocumentLayoutError",
    "Documents",
    "RingInputError",
    "ring_attention",
]
