"""Cross-rank agreement on a call before its first collective.

Every rank of a group describes its call as a few named integers (shapes, dtype,
options, a hash of the document boundaries) plus, if its local validation failed, its
error. One all-gather of that fingerprint (one more for the error text, only when some
rank failed or the ranks disagree) lets every rank see the same picture and raise the
*same* error, before any data moved: the group stays usable for the next call, and no rank hangs in a collective
its peers never enter. Every rank always makes the same collectives here, whatever its
own inputs, so the check itself cannot deadlock.

Cost: one tiny all-gather (and a host sync on NCCL) per check.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from usp.comm.collectives import all_gather_uncounted
from usp.errors import RankDisagreementError  # noqa: F401 - re-exported here

_MESSAGE_BYTES = 1024


@dataclass(frozen=True)
class Field:
    """One entry of a fingerprint: a name, its value as an int64, and how to show it.

    ``detail``: this rank's value in words where the int64 is only a hash of it (a
    document's boundaries, a tensor's values), shown instead of ``show(value)`` when the
    ranks disagree on this field (exchanged then only: no cost while they agree)."""

    name: str
    value: int
    show: Callable[[int], str] = str
    detail: str | None = None


def float_bits(value: float) -> int:
    """A float64 as the int64 with the same bits (exact comparison across ranks)."""
    return struct.unpack("<q", struct.pack("<d", float(value)))[0]


def bits_float(bits: int) -> float:
    return struct.unpack("<d", struct.pack("<q", bits))[0]


def stable_hash(values: Sequence[int]) -> int:
    """A hash of integers that is the same in every process (unlike ``hash`` of str)."""
    acc = 1469598103934665603  # FNV-1a, 64-bit
    for value in values:
        for byte in int(value).to_bytes(8, "little", signed=True):
            acc = ((acc ^ byte) * 1099511628211) & 0xFFFFFFFFFFFFFFFF
    return acc - (1 << 64) if acc >= (1 << 63) else acc


def can_agree(group) -> bool:
    """Whether ranks of ``group`` can agree: agreement needs real collectives (not the
    ``fake`` backend of emulations, where one process plays one rank)."""
    return dist.get_backend(group) != "fake"


def _device_for(group) -> torch.device:
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _describe_ranks(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def agree(
    group,
    what: str,
    fields: Sequence[Field],
    error: BaseException | None = None,
    error_kinds: Sequence[type[BaseException]] = (),
) -> None:
    """Raise the same exception on every rank of ``group`` if any rank's ``error`` is set
    or the ranks' ``fields`` differ; return normally on every rank otherwise.

    Every rank must call this with the same ``what`` and the same field names. An error
    is re-raised on every rank as the first failing rank's exception class when that
    class is in ``error_kinds`` (else ``RankDisagreementError``), with its message and
    the list of failing ranks; ranks that raised locally chain their own exception.
    Group ranks are those of ``group`` (``dist.get_rank(group)``).
    """
    size = dist.get_world_size(group)
    kinds = tuple(error_kinds)
    code = 0
    if error is not None:  # the most specific listed class (exact, else the first base)
        exact = [i + 1 for i, kind in enumerate(kinds) if type(error) is kind]
        bases = [i + 1 for i, kind in enumerate(kinds) if isinstance(error, kind)]
        code = (exact or bases or [len(kinds) + 1])[0]
    device = _device_for(group)
    mine = torch.tensor([[code, *(f.value for f in fields)]], dtype=torch.int64, device=device)
    every = torch.empty((size, mine.shape[1]), dtype=torch.int64, device=device)
    all_gather_uncounted(every, mine, group)
    rows = every.tolist()
    codes = [row[0] for row in rows]
    if any(codes):
        raise _shared_error(group, what, codes, error, kinds, device) from error
    for index, f in enumerate(fields, start=1):
        values = [row[index] for row in rows]
        if len(set(values)) > 1:  # every rank sees it: the same exchange everywhere
            details = _exchange_texts(group, f.detail or "", device)
            groups: dict[int, list[int]] = {}
            for rank, value in enumerate(values):
                groups.setdefault(value, []).append(rank)
            described = "; ".join(
                f"{_describe_ranks(ranks)}: {details[ranks[0]] or f.show(value)}"
                for value, ranks in groups.items()
            )
            raise RankDisagreementError(
                f"{what}: the ranks of the group disagree on {f.name} ({described}); every "
                f"rank must make the same call (same shapes, dtype, options and documents)"
            )


def _exchange_texts(group, text: str, device) -> list[str]:
    """Every rank's ``text`` (its first :data:`_MESSAGE_BYTES` bytes), in group-rank order."""
    encoded = text.encode("utf-8")[:_MESSAGE_BYTES]
    mine = torch.zeros((1, _MESSAGE_BYTES), dtype=torch.uint8, device=device)  # zero-padded
    if encoded:
        mine[0, : len(encoded)] = torch.frombuffer(bytearray(encoded), dtype=torch.uint8)
    every = torch.empty(
        (dist.get_world_size(group), _MESSAGE_BYTES), dtype=torch.uint8, device=device
    )
    all_gather_uncounted(every, mine, group)
    return [bytes(row).rstrip(b"\0").decode("utf-8", "replace") for row in every.cpu().tolist()]


def _shared_error(group, what, codes, error, kinds, device) -> BaseException:
    """Exchange the failing ranks' messages; build the error every rank raises."""
    messages = _exchange_texts(group, "" if error is None else f"{error}", device)
    failing = [rank for rank, code in enumerate(codes) if code]
    first = failing[0]
    code = codes[first]
    kind = kinds[code - 1] if code <= len(kinds) else RankDisagreementError
    return kind(f"{what} failed on {_describe_ranks(failing)} of {len(codes)}: {messages[first]}")
