"""The choices a user makes for attention, in one place (no torch import).

Config parsing, the plan, the ring and the kernel registry all read these tuples, so a
new layout, ring implementation or backend is added here once. Linear attention's
kernels (Gated DeltaNet's recurrence and its short conv) are chosen beside attention's
backend (``[attention] linear_backend`` / ``linear_conv_backend``).
"""

from __future__ import annotations

#: how a sequence is cut over the ring (see :mod:`usp.ring.documents`)
LAYOUTS: tuple[str, ...] = ("zigzag", "contiguous")
#: how K/V travel around the ring (see :mod:`usp.ring`)
RING_IMPLS: tuple[str, ...] = ("p2p", "allgather")
#: local attention kernels (see :mod:`usp.kernels`); ``"auto"`` picks one per call
BACKEND_NAMES: tuple[str, ...] = ("cudnn", "flash_attn", "flash", "efficient", "cpu", "math")
AUTO_BACKEND = "auto"
BACKENDS: tuple[str, ...] = (AUTO_BACKEND, *BACKEND_NAMES)

#: Gated DeltaNet's recurrence kernels (see :mod:`usp.linear.backends`); ``"auto"`` picks
#: one per call
LINEAR_BACKENDS: tuple[str, ...] = (AUTO_BACKEND, "torch", "fla")
#: its short conv's kernels (see :mod:`usp.linear.conv`)
LINEAR_CONV_BACKENDS: tuple[str, ...] = (AUTO_BACKEND, "torch", "causal_conv1d")

#: how a packed sequence's documents go to the SP ranks: every document split over the
#: group (``"sequence"``), or short ones whole on one rank (``"documents"``, see
#: :mod:`usp.sp.placed`)
TOKEN_PLACEMENTS: tuple[str, ...] = ("sequence", "documents")

DEFAULT_LAYOUT = "zigzag"
DEFAULT_TOKEN_PLACEMENT = "sequence"
DEFAULT_RING_IMPL = "p2p"
DEFAULT_BACKEND = AUTO_BACKEND
DEFAULT_LINEAR_BACKEND = DEFAULT_LINEAR_CONV_BACKEND = AUTO_BACKEND


def layout_chunks(layout: str, ring_size: int) -> int:
    """How many equal chunks ``layout`` cuts a sequence (every document of a packed one)
    into on a ring of ``ring_size``: 2r for zigzag (rank i holds chunks i and 2r-1-i), r
    for contiguous. The one home of this rule: every length multiple derives from it."""
    return 2 * ring_size if layout == "zigzag" else ring_size


def check_choice(what: str, value, choices: tuple[str, ...], error: type[Exception]) -> str:
    """``value`` if it is one of ``choices``, else ``error`` naming the valid ones."""
    if isinstance(value, str) and value in choices:
        return value
    raise error(f"unknown {what} {value!r}; valid: {', '.join(choices)}")
