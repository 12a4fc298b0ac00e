"""Per-rank byte counters for every collective ``usp`` issues.

Counting is a few integer additions per collective call (never per element), so the
counters are cheap enough to leave on. A :class:`CommStats` belongs to whoever owns the
process groups (a :class:`usp.process_groups.Topology` carries one); nothing here is global.

Conventions: ``sent`` counts bytes this rank puts on the wire for other ranks, and
``received`` bytes it gets from other ranks; the part of an all-to-all or all-gather a
rank keeps for itself is not counted.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

KINDS = ("all_to_all", "p2p", "all_gather", "reduce_scatter", "all_reduce")


@dataclass
class CommStats:
    enabled: bool = True
    sent: Counter = field(default_factory=Counter)
    received: Counter = field(default_factory=Counter)
    calls: Counter = field(default_factory=Counter)

    def record(self, kind: str, *, sent: int, received: int) -> None:
        if kind not in KINDS:
            raise ValueError(f"unknown collective kind {kind!r}; expected one of {KINDS}")
        if not self.enabled:
            return
        self.sent[kind] += int(sent)
        self.received[kind] += int(received)
        self.calls[kind] += 1

    def reset(self) -> None:
        self.sent.clear()
        self.received.clear()
        self.calls.clear()

    def snapshot(self) -> dict[str, dict[str, int]]:
        """``{kind: {"sent": bytes, "received": bytes, "calls": n}}`` for kinds used."""
        return {
            kind: {
                "sent": self.sent[kind],
                "received": self.received[kind],
                "calls": self.calls[kind],
            }
            for kind in KINDS
            if self.calls[kind]
        }

    @property
    def total_sent(self) -> int:
        return sum(self.sent.values())

    @property
    def total_received(self) -> int:
        return sum(self.received.values())
