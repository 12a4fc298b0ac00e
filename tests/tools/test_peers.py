"""benchmarks/peers.py on CPU at tiny sizes: usp and its peers as rank 0 of a fake world
of 4, in this (pytest's main) process, which has no default group of its own.

What can run on CPU runs and is checked: usp on every grid and ring implementation; torch
CP's ring core (the CPU stand-in for ``context_parallel``) with both rotate methods, also
on 4 gloo ranks against the single-process reference so the stand-in is known to compute
attention; the byte counter against usp's own counters, usp's traffic formula, torch's
ring algorithm and hand-computed collectives. What cannot run (``context_parallel``
itself, ring-flash-attn and yunchang without flash-attn and CUDA) must be a skipped row
that says why.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.distributed as dist
from reference import relative_error
from usp_cases import global_inputs, reference_with_grads

from benchmarks import emulate, peers
from benchmarks.collectives import CollectiveCounter
from benchmarks.peer_cases import Peer, Setup, expand_kv, torch_ring_attention, torch_ring_options
from benchmarks.peer_results import run_peer

SP = 4
TINY = ["--preset", "tiny", "--seqlen", "128", "--sp", str(SP), "--usp-backend", "cpu"]
FAST = ["--warmup", "1", "--repeats", "1", "--monolithic-repeats", "1"]
SHAPE = emulate.PRESETS["tiny"]  # H=8, Hkv=2, D=16; fp32 on CPU
LOCAL = 128 // SP


@pytest.fixture(scope="module")
def table(tmp_path_factory):
    assert not dist.is_initialized()
    out = tmp_path_factory.mktemp("peers")
    rows = peers.main([*TINY, *FAST, "--grids", "1x4", "2x2", "--out", str(out)])
    assert not dist.is_initialized(), "every fake world must be torn down"
    return rows, out


def _rows(rows, name):
    return [r for r in rows if r["name"] == name]


def test_one_row_per_peer_grid_and_variant(table):
    rows, _ = table
    got = [(r["name"], r["ulysses"], r["ring"], r["variant"], r["kernel"]) for r in rows]
    assert got == [
        ("usp", 1, 4, "p2p", "cpu"),
        ("usp", 1, 4, "allgather", "cpu"),
        ("torch-cp", 1, 4, "allgather", "flash"),
        ("torch-cp", 1, 4, "alltoall", "flash"),
        ("torch-cp-ring", 1, 4, "allgather", "flash"),
        ("torch-cp-ring", 1, 4, "alltoall", "flash"),
        ("ring-flash-attn", 1, 4, "zigzag", "flash-attn"),
        ("yunchang", 1, 4, "zigzag", "flash-attn"),
        ("usp", 2, 2, "p2p", "cpu"),
        ("usp", 2, 2, "allgather", "cpu"),
        ("yunchang", 2, 2, "zigzag", "flash-attn"),
    ]
    assert all(r["rank"] == 0 for r in rows)


def test_usp_and_torch_ring_rows_have_sane_finite_times(table):
    rows, _ = table
    measured = _rows(rows, "usp") + _rows(rows, "torch-cp-ring")
    assert len(measured) == 6
    for r in measured:
        assert r["status"] == "ok", (r["label"], r["reason"])
        for key in ("fwd_ms", "bwd_ms", "fwd_bwd_ms", "tflops_per_rank", "efficiency"):
            assert math.isfinite(r[key]) and r[key] > 0, (r["label"], key, r[key])
        assert r["fwd_bwd_ms"] == pytest.approx(r["fwd_ms"] + r["bwd_ms"])  # one repeat
        assert r["ideal_ms"] == pytest.approx(r["monolithic_ms"] / SP)
        assert r["efficiency"] == pytest.approx(r["ideal_ms"] / r["fwd_bwd_ms"])
        assert r["peak_mem_bytes"] is None, "peak memory is CUDA-only"
        assert r["unrecognised_collectives"] == []
    references = {r["label"]: r["monolithic_note"] for r in measured}
    assert all("at full length 128" in note for note in references.values())
    assert {note.split()[0] for note in references.values()} == {"usp:cpu", "sdpa:flash"}


def test_rows_that_cannot_run_here_say_why(table):
    rows, _ = table
    for r in _rows(rows, "torch-cp"):
        assert r["status"] == "skipped"
        assert "no CPU kernel" in r["reason"] and "sharding strategy" in r["reason"]
    for r in _rows(rows, "ring-flash-attn") + _rows(rows, "yunchang"):
        assert r["status"] == "skipped", r["label"]
        assert "does not import" in r["reason"] or "need CUDA" in r["reason"], r["reason"]
        assert "fwd_ms" not in r and "bytes_sent" not in r


def _usp_formula(row):
    return emulate.traffic_formula(
        SHAPE,
        batch=1,
        seqlen=128,
        ulysses=row["ulysses"],
        ring=row["ring"],
        ring_impl=row["variant"],
        item_bytes=4,
        acc_bytes=4,
    )


def test_usp_bytes_equal_its_counters_and_its_formula(table):
    for r in _rows(table[0], "usp"):
        assert r["traffic"] == r["comm_stats"] == _usp_formula(r), r["label"]
        assert r["comm_stats_agree"] is True
        assert r["bytes_sent"] == sum(
            c["sent"] for phase in r["traffic"].values() for c in phase.values()
        )


def _torch_ring_formula(rotate):
    """torch CP's ring: K/V expanded to H heads travel; dK/dV travel in float32, once per
    step including the last (back to the owner); allgather gathers K/V once per pass."""
    kv = 2 * 1 * SHAPE.heads * LOCAL * SHAPE.head_dim * 4
    dkv = kv  # float32 accumulators, fp32 inputs

    def kind(moved, calls):
        return {"sent": moved, "received": moved, "calls": calls}

    if rotate == "allgather":
        return {
            "forward": {"all_gather": kind((SP - 1) * kv, 1)},
            "backward": {"all_gather": kind((SP - 1) * kv, 1), "all_to_all": kind(SP * dkv, SP)},
        }
    return {
        "forward": {"all_to_all": kind((SP - 1) * kv, SP - 1)},
        "backward": {"all_to_all": kind((SP - 1) * kv + SP * dkv, 2 * SP - 1)},
    }


def test_torch_ring_bytes_follow_its_algorithm(table):
    for r in _rows(table[0], "torch-cp-ring"):
        assert r["traffic"] == _torch_ring_formula(r["variant"]), r["label"]
        assert r["comm_stats"] is None


def test_json_and_markdown_are_written(table):
    rows, out = table
    saved = json.loads((out / "peers.json").read_text())
    assert [r["label"] for r in saved["rows"]] == [r["label"] for r in rows]
    assert "fake process group" in saved["setup"] and "say nothing about GPUs" in saved["setup"]
    md = (out / "peers.md").read_text()
    assert "### One rank, side by side" in md and "### Traffic per rank" in md
    table = md.split("### Traffic per rank")[0]
    body = [line for line in table.splitlines() if line.startswith("| usp |")]
    assert len(body) == 4 and all(line.endswith("| ok |") for line in body)
    for i, r in enumerate(rows, 1):
        if r["status"] != "ok":
            assert f"[{i}] {r['label']}: skipped: {r['reason']}" in md


def test_every_option_changes_what_runs(tmp_path):
    """Non-default peers, ring implementations, rotate methods, SDPA backend, batch,
    ranks per node and monolithic cap; without the 1 x P grid the ring peers come first."""
    rows = peers.main(
        [*TINY, *FAST, "--grids", "2x2", "--peers", "usp", "torch-cp", "torch-cp-ring"]
        + ["--usp-ring-impls", "allgather", "--torch-rotates", "alltoall"]
        + ["--torch-backends", "cudnn", "--batch", "2", "--ranks-per-node", "2"]
        + ["--max-monolithic-tokens", "64", "--out", str(tmp_path)]
    )
    assert [r["label"] for r in rows] == [
        "torch-cp 1x4 alltoall cudnn",
        "torch-cp-ring 1x4 alltoall flash",
        "usp 2x2 allgather cpu",
    ]
    cp, ring, usp_row = rows
    assert cp["status"] == "skipped" and "no CPU kernel" in cp["reason"]
    assert ring["traffic"]["forward"]["all_to_all"]["sent"] == 2 * (SP - 1) * 2 * 8 * LOCAL * 16 * 4
    assert usp_row["traffic"] == usp_row["comm_stats"]
    formula = emulate.traffic_formula(
        SHAPE,
        batch=2,
        seqlen=128,
        ulysses=2,
        ring=2,
        ring_impl="allgather",
        item_bytes=4,
        acc_bytes=4,
    )
    assert usp_row["traffic"] == formula
    for r in (ring, usp_row):
        assert r["status"] == "ok"
        assert "at 64 tokens, scaled x4 (quadratic)" in r["monolithic_note"]


def _setup(seqlen, sp):
    return Setup(
        preset="tiny",
        seqlen=seqlen,
        sp=sp,
        dtype="fp32",
        batch=1,
        ranks_per_node=sp,
        device=torch.device("cpu"),
        warmup=0,
        repeats=1,
        monolithic_repeats=1,
        max_monolithic_tokens=seqlen,
    )


def test_a_peer_that_raises_is_a_failed_row_with_the_error():
    setup = _setup(seqlen=64, sp=2)
    row = run_peer(Peer("usp", 1, 2, "p2p", "no-such-backend"), setup, {})
    assert row["status"] == "failed" and "no-such-backend" in row["reason"]
    assert not dist.is_initialized()


def test_bad_sizes_are_refused_with_the_rule():
    with pytest.raises(ValueError, match="multiple of 2 \\* sp = 8"):
        _setup(seqlen=100, sp=4)
    with pytest.raises(SystemExit):
        peers.main([*TINY, "--grids", "2x1"])


# ------------------------------------------------------------------ the byte counter
def test_counter_sizes_each_collective_like_comm_stats():
    """Rank 1 of 4 (fake): hand-computed bytes for each collective form peers meet."""
    from torch.distributed import _functional_collectives as funcol
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=4)
    try:
        # torch 2.13 renamed the tensor forms; older releases lack the new names
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        gather_functional = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor
        x = torch.zeros(8, 3)  # 96 bytes, rows of 12
        with CollectiveCounter() as counter:
            dist.all_to_all_single(torch.empty_like(x), x)  # keeps 1/4
            dist.all_to_all_single(torch.empty(5, 3), x, [5, 0, 0, 0], [1, 0, 3, 4])
            gather(torch.empty(32, 3), x)
            scatter(torch.empty(2, 3), x)
            dist.all_reduce(x)
            dist.batch_isend_irecv(
                [dist.P2POp(dist.isend, x, 2), dist.P2POp(dist.irecv, torch.empty(4, 3), 0)]
            )
            gather_functional(x, 0, dist.group.WORLD).wait()
            funcol.permute_tensor(x.flatten(), [1, 2, 3, 0], dist.group.WORLD).wait()
    finally:
        dist.destroy_process_group()
    # all-to-alls: equal split keeps 1/4 (72 of 96 bytes move); uneven: rows 1 + 3 + 4
    # (of 12 bytes) leave, 5 rows arrive from rank 0; permute: all 96 bytes to rank 2,
    # 96 from rank 0
    assert counter.traffic == {
        "all_to_all": {"sent": 72 + 8 * 12 + 96, "received": 72 + 5 * 12 + 96, "calls": 3},
        "all_gather": {"sent": 2 * 3 * 96, "received": 2 * 3 * 96, "calls": 2},
        "reduce_scatter": {"sent": 3 * 24, "received": 3 * 24, "calls": 1},
        "all_reduce": {"sent": 2 * 3 * 96 // 4, "received": 2 * 3 * 96 // 4, "calls": 1},
        "p2p": {"sent": 96, "received": 48, "calls": 1},
    }
    assert counter.unrecognised == set()


# ------------------------------------------------------------------ the torch stand-in
def run_torch_ring_core(rotate):
    """One rank of torch's ring core on gloo: head-tail shard in, errors against the
    float64 reference out (GQA: K/V expanded as the benchmark does)."""
    torch.set_num_threads(1)
    size, rank = dist.get_world_size(), dist.get_rank()
    heads, kv_heads = 4, 2
    q, k, v, dout = global_inputs(16 * size, heads, kv_heads, head_dim=8, batch=2)
    expected = reference_with_grads(q, k, v, dout, causal=True)

    def head_tail(t):  # [B, S, H, D] -> this rank's chunks i and 2P-1-i
        chunks = t.chunk(2 * size, dim=1)
        return torch.cat([chunks[rank], chunks[2 * size - 1 - rank]], dim=1)

    local = [head_tail(t).transpose(1, 2).float().contiguous() for t in (q, k, v, dout)]
    ql, kl, vl = (t.requires_grad_() for t in local[:3])
    with torch_ring_options(rotate):
        group = heads // kv_heads
        out = torch_ring_attention(ql, expand_kv(kl, group), expand_kv(vl, group), dist.group.WORLD)
        out.backward(local[3])
    actual = [t.transpose(1, 2) for t in (out.detach(), ql.grad, kl.grad, vl.grad)]
    names = ("out", "dq", "dk", "dv")
    return {n: relative_error(a, head_tail(e)) for n, a, e in zip(names, actual, expected)}


@pytest.mark.parametrize("rotate", ["allgather", "alltoall"])
def test_torch_ring_stand_in_computes_attention(distributed, rotate):
    results = distributed.run(run_torch_ring_core, rotate, world_size=4, timeout=60)
    for rank, errors in enumerate(results):
        assert max(errors.values()) < 1e-5, (rank, errors)


@pytest.mark.parametrize("form", ["path", "module"])
def test_the_script_runs_by_path_and_as_a_module(tmp_path, form):
    """``python benchmarks/peers.py`` (from any directory) and ``python -m
    benchmarks.peers`` (from the repository root) both find the benchmarks package."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    if form == "path":
        argv, cwd = [sys.executable, str(root / "benchmarks" / "peers.py"), "--help"], tmp_path
    else:
        argv, cwd = [sys.executable, "-m", "benchmarks.peers", "--help"], root
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # no help from outside
    result = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("usage: ") and "--grids" in result.stdout
