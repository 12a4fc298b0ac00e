"""benchmarks/emulate.py on CPU at tiny sizes: one rank of a world of 8 under the fake
process-group backend, in this (pytest's main) process, which has no default group of
its own (the ``distributed`` fixture's gloo ranks are separate processes).

Checks real things: a row for every grid, layout and ring implementation; positive,
finite times; the emulated rank is the slowest one; every byte equals the formula;
communication times follow the link model and its node placement; JSON and Markdown
are written.
"""

from __future__ import annotations

import json
import math

import pytest
import torch.distributed as dist

from benchmarks import emulate

GRIDS = [(8, 1), (4, 2), (2, 4), (1, 8)]
TINY = ["--preset", "tiny", "--seqlen", "256", "--world", "8", "--backends", "cpu"]
FAST = ["--warmup", "1", "--repeats", "1"]


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    assert not dist.is_initialized()
    out = tmp_path_factory.mktemp("emulate")
    grids = [f"{u}x{r}" for u, r in GRIDS]
    rows = emulate.main([*TINY, *FAST, "--grids", *grids, "--out", str(out)])
    assert not dist.is_initialized(), "the fake world must be torn down after the sweep"
    return rows, out


def _formula(row):
    return emulate.traffic_formula(
        emulate.AttentionShape(row["heads"], row["kv_heads"], row["head_dim"]),
        batch=row["batch"],
        seqlen=row["seqlen"],
        ulysses=row["ulysses"],
        ring=row["ring"],
        ring_impl=row["ring_impl"],
        item_bytes=4,  # fp32 on CPU
        acc_bytes=4,
    )


def test_a_row_for_every_grid_layout_and_ring_impl(sweep):
    rows, _ = sweep
    got = sorted((r["ulysses"], r["ring"], r["layout"], r["ring_impl"]) for r in rows)
    want = sorted(
        [(8, 1, "zigzag", "p2p")]
        + [
            (u, r, layout, impl)
            for u, r in GRIDS
            if r > 1
            for layout in ("zigzag", "contiguous")
            for impl in ("p2p", "allgather")
        ]
    )
    assert got == want


def test_times_are_positive_and_finite(sweep):
    for row in sweep[0]:
        for key in ("fwd_ms", "bwd_ms", "fwd_bwd_ms", "tflops_per_rank", "efficiency"):
            assert math.isfinite(row[key]) and row[key] > 0, (key, row[key])
        assert row["monolithic_ms"] > 0 and row["ideal_ms"] == row["monolithic_ms"] / 8
        assert row["efficiency"] == pytest.approx(row["ideal_ms"] / row["fwd_bwd_ms"])
        assert row["modelled_fwd_bwd_ms"] >= row["fwd_ms"] + row["bwd_ms"] > 0


def test_cpu_has_no_fa2_reference_and_no_peak_memory(sweep):
    for row in sweep[0]:
        assert row["efficiency_fa2"] is None and "flash unavailable" in row["monolithic_fa2_note"]
        assert row["peak_mem_bytes"] is None
        assert row["monolithic_note"] == "cpu measured at full length 256"


def test_every_byte_equals_the_formula(sweep):
    for row in sweep[0]:
        assert row["traffic"] == _formula(row), row["traffic"]
        assert row["traffic_matches_formula"] and row["bytes_vs_formula"] == 1.0
        kinds = {k for phase in row["traffic"].values() for k in phase}
        want = set()
        if row["ulysses"] > 1:
            want.add("all_to_all")
        if row["ring"] > 1:
            want |= {"p2p"} if row["ring_impl"] == "p2p" else {"all_gather", "reduce_scatter"}
        assert kinds == want


def test_contiguous_emulates_the_slowest_ring_rank(sweep):
    for row in sweep[0]:
        u, r = row["ulysses"], row["ring"]
        if row["layout"] == "contiguous" and r > 1:
            assert row["rank"] == (r - 1) * u and row["ring_rank"] == r - 1
            assert row["work_share"] == pytest.approx((2 * r - 1) / r)
            assert "slowest" in row["rank_note"]
        else:
            assert row["rank"] == 0 and row["work_share"] == 1.0


def test_one_node_means_every_link_is_intra_node(sweep):
    for row in sweep[0]:
        for phase, kinds in row["traffic"].items():
            for kind, counts in kinds.items():
                assert row["links"][kind] == {"name": "intra-node", "gbps": 900.0}
                assert row["comm_ms"][phase][kind] == pytest.approx(counts["sent"] / 900e9 * 1e3)


def test_json_and_markdown_are_written(sweep):
    rows, out = sweep
    saved = json.loads((out / "emulate.json").read_text())
    assert len(saved["rows"]) == len(rows) and "fake process group" in saved["setup"]
    markdown = (out / "emulate.md").read_text()
    assert "### Compute and memory per rank" in markdown and "### Traffic per rank" in markdown
    table = [line for line in markdown.splitlines() if line.startswith("| tiny | 256 | 8 |")]
    assert len(table) == len(rows) and all(line.endswith("| 1.00 |") for line in table)


def test_rings_across_nodes_use_the_inter_node_link(tmp_path):
    """4 ranks per node: u=4 stays inside a node, the ring of 2 spans two nodes."""
    rows = emulate.main(
        [*TINY, *FAST, "--grids", "4x2", "--layouts", "zigzag", "--ring-impls", "p2p"]
        + ["--ranks-per-node", "4", "--inter-node-gbps", "25", "--rank", "5"]
        + ["--max-monolithic-tokens", "128", "--out", str(tmp_path)]
    )
    (row,) = rows
    assert (row["rank"], row["ring_rank"], row["ulysses_rank"], row["node"]) == (5, 1, 1, 1)
    assert row["rank_note"] == "requested with --rank"
    assert row["links"]["all_to_all"]["name"] == "intra-node"
    assert row["links"]["p2p"] == {"name": "inter-node", "gbps": 25.0}
    sent = row["traffic"]["backward"]["p2p"]["sent"]
    assert row["comm_ms"]["backward"]["p2p"] == pytest.approx(sent / 25e9 * 1e3)
    assert "measured at 128 tokens, scaled x4 (quadratic)" in row["monolithic_note"]


def test_the_emulator_refuses_to_replace_an_existing_default_group():
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        with pytest.raises(RuntimeError, match="without a default process group"):
            emulate.main([*TINY, *FAST, "--grids", "8x1"])
    finally:
        dist.destroy_process_group()
