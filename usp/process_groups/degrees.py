"""Which (ulysses, ring) degrees a model's head counts allow, and which one to pick.

The Ulysses all-to-all gives each of the ``u`` ranks ``H / u`` query heads, so ``u`` must
divide ``H``. With grouped-query attention (query head ``h`` uses KV head
``h // (H / Hkv)``) a rank must also hold the KV heads its query heads use. When ``u``
does not divide ``Hkv`` the KV heads are replicated first: ``Hkv`` becomes
``lcm(Hkv, u)`` (each KV head repeated ``lcm(Hkv, u) / Hkv`` times, in place), which
``u`` divides, and the GQA mapping still holds because ``lcm(Hkv, u)`` divides ``H``
(both ``Hkv`` and ``u`` do). Example: Llama-3-8B (``H=32, Hkv=8``) at ``u=16`` repeats
each KV head twice, so every rank holds 2 query heads and the 1 KV head they share.

All functions here are pure.
"""

from __future__ import annotations

from math import lcm

from usp.errors import HeadLayoutError  # noqa: F401 - re-exported here
from usp.process_groups.rank_math import TopologyError, check_degree, divisors

#: what messages call the two head counts: attention's (the default) or, e.g., Gated
#: DeltaNet's ``("value heads", "key heads")``
HEAD_NAMES = ("query heads", "KV heads")


def _check_heads(num_heads: int, num_kv_heads: int, names=HEAD_NAMES) -> None:
    for name, value in (("num_heads", num_heads), ("num_kv_heads", num_kv_heads)):
        try:
            check_degree(name, value)
        except TopologyError as e:
            raise HeadLayoutError(str(e)) from None
    if num_heads % num_kv_heads != 0:
        raise HeadLayoutError(
            f"num_heads({num_heads}) is not a multiple of num_kv_heads({num_kv_heads}): "
            f"grouped-query attention needs the same number of {names[0]} per {names[1][:-1]}"
        )


def kv_replication(num_heads: int, num_kv_heads: int, ulysses_degree: int, names=HEAD_NAMES) -> int:
    """How many times each KV head is repeated so ``ulysses_degree`` ranks split them.

    Returns ``lcm(num_kv_heads, u) // num_kv_heads`` (1 when ``u`` divides
    ``num_kv_heads``). Raises :class:`HeadLayoutError` when ``num_heads`` is not a
    multiple of ``num_kv_heads`` or not divisible by ``u``. ``names``: what the messages
    call the two counts (:data:`HEAD_NAMES`).
    """
    _check_heads(num_heads, num_kv_heads, names)
    try:
        u = check_degree("ulysses_degree", ulysses_degree)
    except TopologyError as e:
        raise HeadLayoutError(str(e)) from None
    if num_heads % u != 0:
        raise HeadLayoutError(
            f"num_heads({num_heads}) is not divisible by ulysses({u}): every Ulysses rank "
            f"must hold the same number of {names[0]}"
        )
    return lcm(num_kv_heads, u) // num_kv_heads


def valid_degree_pairs(
    num_heads: int | None,
    num_kv_heads: int | None,
    sp_size: int,
    ranks_per_node: int | None = None,
) -> list[tuple[int, int]]:
    """All ``(ulysses, ring)`` with ``ulysses * ring == sp_size`` the heads allow.

    ``num_heads=None`` and ``num_kv_heads=None`` mean no head constraint. With
    ``ranks_per_node``, ``ulysses`` must also divide it, so that each Ulysses group of
    contiguous ranks stays inside one node. Ascending in ``ulysses``; never empty, since
    ``(1, sp_size)`` always fits. Head counts that fit no degree at all (``num_heads`` not a
    multiple of ``num_kv_heads``) raise :class:`HeadLayoutError`.
    """
    check_degree("sp_size", sp_size)
    if ranks_per_node is not None:
        check_degree("ranks_per_node", ranks_per_node)
    if (num_heads is None) != (num_kv_heads is None):
        raise HeadLayoutError("give both num_heads and num_kv_heads, or neither")
    if num_heads is not None:
        _check_heads(num_heads, num_kv_heads)
    return [
        (u, sp_size // u)
        for u in divisors(sp_size)
        if _allowed(num_heads, num_kv_heads, u, ranks_per_node)
    ]


def _allowed(
    num_heads: int | None, num_kv_heads: int | None, u: int, ranks_per_node: int | None
) -> bool:
    if ranks_per_node is not None and ranks_per_node % u != 0:
        return False
    return (
        num_heads is None or num_heads % u == 0
    )  # heads already checked: then kv_replication works


def suggest_degrees(
    num_heads: int | None,
    num_kv_heads: int | None,
    sp_size: int,
    ranks_per_node: int | None = None,
) -> tuple[int, int]:
    """``(ulysses, ring)`` with the largest valid Ulysses degree (kept inside a node).

    Largest Ulysses first because the all-to-all runs on intra-node links while the ring
    crosses nodes. Raises :class:`HeadLayoutError` for head counts no degree can split.
    """
    return valid_degree_pairs(num_heads, num_kv_heads, sp_size, ranks_per_node)[-1]


def format_pairs(pairs: list[tuple[int, int]]) -> str:
    """``"(1, 16), (2, 8)"``, or ``"none"``."""
    return ", ".join(f"({u}, {r})" for u, r in pairs) or "none"


def _context(
    num_heads: int | None,
    num_kv_heads: int | None,
    sp_size: int,
    ranks_per_node: int | None,
    names=HEAD_NAMES,
) -> str:
    text = f"sp_size={sp_size}"
    if num_heads is not None:
        first = "heads" if names == HEAD_NAMES else names[0]  # attention's: "32 heads"
        text += f" with {num_heads} {first} / {num_kv_heads} {names[1]}"
    if ranks_per_node is not None:
        text += f" and {ranks_per_node} ranks per node"
    return text


def describe_valid_pairs(
    num_heads: int | None,
    num_kv_heads: int | None,
    sp_size: int,
    ranks_per_node: int | None = None,
    names=HEAD_NAMES,
) -> str:
    """E.g. ``valid (ulysses, ring) pairs for sp_size=16 with 32 heads / 8 KV heads and
    8 ranks per node: (1, 16), (2, 8), (4, 4), (8, 2)``, for error messages."""
    pairs = valid_degree_pairs(num_heads, num_kv_heads, sp_size, ranks_per_node)
    context = _context(num_heads, num_kv_heads, sp_size, ranks_per_node, names)
    return f"valid (ulysses, ring) pairs for {context}: {format_pairs(pairs)}"


def kv_replication_for(
    num_heads: int,
    num_kv_heads: int,
    ulysses_degree: int,
    sp_size: int,
    ranks_per_node: int | None = None,
    *,
    subject: str | None = None,
    error: type[HeadLayoutError] = HeadLayoutError,
    names=HEAD_NAMES,
) -> int:
    """:func:`kv_replication`, or ``error`` saying why the heads do not split and listing
    the (ulysses, ring) pairs that work: the one check of a head split over Ulysses.
    ``subject`` starts the message (default: "cannot split H query heads / Hkv KV heads
    over ulysses=u"); ``names``: what it calls the two counts (:data:`HEAD_NAMES`)."""
    try:
        return kv_replication(num_heads, num_kv_heads, ulysses_degree, names)
    except HeadLayoutError as err:
        if subject is None:
            subject = (
                f"cannot split {num_heads} {names[0]} / {num_kv_heads} {names[1]} over "
                f"ulysses={ulysses_degree}"
            )
        pairs = describe_valid_pairs(num_heads, num_kv_heads, sp_size, ranks_per_node, names)
        raise error(f"{subject}: {err}. {pairs}") from None
