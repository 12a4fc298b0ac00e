"""Tiles of a token loop, and the planner's representative tiles.

Three memory levers loop over tiles of tokens so that their float32 or vocabulary-sized
work tensors exist for one tile at a time: RMSNorm (:mod:`usp.models.norm`), the loss's
output projection (:mod:`usp.models.loss`) and the tiled MLP. :func:`tiles` lists a
loop's tiles.

**Representative tiles.** ``usp plan`` measures a step's memory under fake tensors,
where no op computes anything and each costs the same host time whatever its size, so a
loop over ``n`` tiles costs ``n`` times one tile: at a million tokens per rank these
loops were most of a planned step's time. Where a loop is *memory-periodic* -- every
full tile allocates the same tensors and frees them before the next one starts, and
everything that outlives a tile (outputs, saved values, gradients) was allocated before
the loop and is written in place -- the live bytes at each point of a full tile are the
same in every full tile, and the last tile (the only one that can be shorter) allocates
no more. Then the loop's memory peak is reached in its first full tile or in its last,
and running those two gives the same peak, byte for byte, as running all of them.

Inside :func:`representative_tiles` (entered by the planner around a fake-tensor step),
:func:`tiles` gives a memory-periodic loop only its first and its last tile, and only
when the tensor it tiles is a fake tensor: on real tensors the loop always runs in full,
so the mode can never change a computed value. A loop passes ``periodic=True`` only if
it is memory-periodic as defined above; ``tests/planner/test_representative_tiles.py``
checks that planned footprints are identical with and without the mode.
"""

from __future__ import annotations

from usp.planning_mode import representative, representative_tiles

__all__ = ["representative", "representative_tiles", "tiles"]


def tiles(rows: int, chunk: int, *, representative_only: bool = False) -> list[slice]:
    """The row slices of a loop over ``rows`` rows, ``chunk`` rows at a time (the last
    shorter). ``representative_only``: the first and the last only (a memory-periodic
    loop over fake tensors, see :func:`representative`)."""
    all_tiles = [slice(i, min(i + chunk, rows)) for i in range(0, rows, chunk)]
    if representative_only and len(all_tiles) > 2:
        return [all_tiles[0], all_tiles[-1]]
    return all_tiles
