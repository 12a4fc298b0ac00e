"""Position ids of packed sequences, checked by value on every rank of several grids.

A position that fails to restart per document changes a float64 model's output by about
1e-8 relative (RoPE of nearby positions), so a tolerance is a weak witness. Here the
exact in-document positions are written out from the layout's definition (and, for one
grid, as literal numbers) and compared with equality with what every rank's
``Plan.position_ids`` returns, what ``usp.models.shard_batch`` hands an HF model, and
what the native model's decoder stack receives in a forward pass (the trainer's path:
``model(input_ids, cu_seqlens=plan.pack(...))`` without position ids).
"""

from __future__ import annotations

import pytest
import torch
from usp_cases import topology

import usp
from usp.models import PRESETS, Llama, shard_batch

LENGTHS = [8, 16, 40]  # multiples of 2r for r <= 4: every layout below packs them as they are


def expected_positions(lengths, *, ring, ulysses, ring_rank, ulysses_rank, layout):
    """In-document positions of the tokens rank (ring_rank, ulysses_rank) holds, in local
    order. Every document is cut into ``2 * ring`` (zigzag) or ``ring`` (contiguous) equal
    chunks; ring rank i holds chunk i (and chunk 2r-1-i under zigzag) of every document,
    first piece of every document, then second piece of every document; the Ulysses
    ranks split that block into equal contiguous parts."""
    chunks = 2 * ring if layout == "zigzag" else ring
    pieces = [ring_rank, 2 * ring - 1 - ring_rank] if layout == "zigzag" else [ring_rank]
    block = []
    for chunk in pieces:
        for n in lengths:
            size = n // chunks
            block += list(range(chunk * size, (chunk + 1) * size))
    part = len(block) // ulysses
    return block[ulysses_rank * part : (ulysses_rank + 1) * part]


def test_the_expected_positions_written_out():
    """The formula above on one small case, as literal numbers (r 2, u 2, zigzag)."""
    at = {
        (rr, ur): expected_positions(
            [8, 16], ring=2, ulysses=2, ring_rank=rr, ulysses_rank=ur, layout="zigzag"
        )
        for rr in (0, 1)
        for ur in (0, 1)
    }
    assert at[0, 0] == [0, 1, 0, 1, 2, 3]
    assert at[0, 1] == [6, 7, 12, 13, 14, 15]
    assert at[1, 0] == [2, 3, 4, 5, 6, 7]
    assert at[1, 1] == [4, 5, 8, 9, 10, 11]
    contiguous = expected_positions(
        [8, 16], ring=2, ulysses=1, ring_rank=1, ulysses_rank=0, layout="contiguous"
    )
    assert contiguous == [4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15]


def _cu(lengths) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def _positions_seen(plan, lengths):
    """(Plan.position_ids, shard_batch's, the decoder stack's) positions on this rank."""
    cu = _cu(lengths)
    total = int(cu[-1])
    packed = plan.pack(cu)
    direct = plan.position_ids(total, packed=packed)
    ids = torch.randint(0, 256, (1, total), generator=torch.Generator().manual_seed(0))
    batch = shard_batch(plan, ids, cu_seqlens=cu)
    # packed once already (cu_seqlens=a PackedSequence): the same shards, labels, positions
    again = shard_batch(plan, ids, cu_seqlens=packed)
    for name in ("input_ids", "labels", "position_ids"):
        assert torch.equal(getattr(again, name), getattr(batch, name)), name
    assert again.packed is packed and again.fingerprint == batch.fingerprint
    torch.manual_seed(0)
    model = Llama(PRESETS["tiny"], plan)
    seen = []

    def record(module, args, kwargs):
        seen.append((args[1] if len(args) > 1 else kwargs["position_ids"]).clone())

    model.model.register_forward_pre_hook(record, with_kwargs=True)
    with torch.no_grad():
        model(plan.shard(ids, packed=packed), cu_seqlens=packed)
    return direct.tolist(), batch.position_ids.tolist(), seen[0].reshape(-1).tolist()


def run_positions(ulysses, ring, layout, lengths):
    plan = usp.Plan(topology(ulysses, ring), layout=layout, backend="math")
    coords = (plan.ring_rank, plan.ulysses_rank)
    return coords, _positions_seen(plan, lengths)


@pytest.mark.parametrize(
    "ulysses, ring, layout",
    [(2, 2, "zigzag"), (1, 4, "zigzag"), (1, 4, "contiguous"), (4, 1, "zigzag")],
)
def test_every_rank_gets_the_exact_document_positions(distributed, ulysses, ring, layout):
    results = distributed.run(run_positions, ulysses, ring, layout, LENGTHS, world_size=4)
    seen_coords = set()
    for (ring_rank, ulysses_rank), (direct, batch, model) in results:
        seen_coords.add((ring_rank, ulysses_rank))
        expected = expected_positions(
            LENGTHS,
            ring=ring,
            ulysses=ulysses,
            ring_rank=ring_rank,
            ulysses_rank=ulysses_rank,
            layout=layout,
        )
        assert direct == expected, (ring_rank, ulysses_rank)
        assert batch == [expected], "shard_batch: the same positions, one row"
        assert model == expected, "the decoder stack receives these positions"
    assert len(seen_coords) == 4, "every rank reported its own coordinates"
    everything = sorted(p for _, (direct, _, _) in results for p in direct)
    assert everything == sorted(p for n in LENGTHS for p in range(n)), "each position once"


def test_one_process_positions_restart_in_every_document():
    direct, batch, model = _positions_seen(usp.Plan(None, backend="math"), LENGTHS)
    expected = [p for n in LENGTHS for p in range(n)]
    assert direct == model == expected
    assert batch == [expected]
