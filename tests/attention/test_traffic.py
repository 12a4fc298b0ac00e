"""Every byte usp_attention moves, per rank, per collective kind, per pass, on gloo.

The bytes each rank sends AND receives, and the number of calls, must equal
``traffic_formula`` of ``benchmarks/emulate.py`` (the formula the emulator reports its
measurements against) exactly, forward and backward separately: Ulysses all-to-all
(q, k, v and out forward; dout and dq, dk, dv backward, a rank not counting the chunk
it keeps), the p2p ring (K/V blocks, then float32 dK/dV accumulators) and the allgather
ring (all_gather forward and backward, reduce_scatter of float32 dK/dV). Here: the grid
with data parallelism (dp 2 x u2 x r2 on 8 ranks; MHA, GQA and GQA with KV replication,
both ring implementations, both layouts, bf16 and float32) and the formula itself (by
hand, and KV replication's growth). Every grid without data parallelism (u4r1, u2r2,
u1r4 on 4 ranks; u8r1, u4r2, u2r4, u1r8 on 8) is checked on the accuracy runs of
tests/attention/test_usp_attention.py (``test_usp_matches_single_process_reference``:
the same shapes, both ring implementations, both layouts, bf16 and float32, causal and
not), which count the bytes of every call they make.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from usp_cases import global_inputs, stated_traffic, topology, usp_run

from benchmarks import emulate

# name -> (heads, kv heads); "gqa-replicated" needs KV replication whenever u > 2
HEADS = {"mha": (8, 8), "gqa": (8, 4), "gqa-replicated": (8, 2)}
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
LOCAL_LEN, BATCH, HEAD_DIM = 8, 2, 16


def measure(ulysses, ring):
    """On every rank: CommStats snapshots of one forward and one backward per case."""
    topo = topology(ulysses, ring)
    results = {}
    for heads, impl, layout, dtype in itertools.product(
        HEADS, ("p2p", "allgather"), ("zigzag", "contiguous"), DTYPES
    ):
        inputs = global_inputs(
            LOCAL_LEN * topo.sp_degree, *HEADS[heads], head_dim=HEAD_DIM, batch=BATCH
        )
        results[heads, impl, layout, dtype] = traffic = {}
        usp_run(topo, inputs, dtype=DTYPES[dtype], layout=layout, causal=True, ring_impl=impl,
                traffic=traffic)  # fmt: skip
    return results


def expected(ulysses, ring, heads, impl, dtype, sp_degree):
    return stated_traffic(
        *HEADS[heads], ulysses=ulysses, ring=ring, ring_impl=impl, dtype=DTYPES[dtype],
        seq_len=LOCAL_LEN * sp_degree, head_dim=HEAD_DIM, batch=BATCH,
    )  # fmt: skip


#: with data parallelism: dp 2 x u2 x r2 (the grids without it: test_usp_attention.py)
GRIDS_WITH_DP = [(8, (2, 2))]


@pytest.mark.parametrize(
    "world,grid", GRIDS_WITH_DP, ids=[f"{w}ranks-u{u}r{r}" for w, (u, r) in GRIDS_WITH_DP]
)
def test_every_rank_moves_exactly_the_formula(distributed, world, grid):
    u, r = grid
    failures = []
    for rank, results in enumerate(distributed.run(measure, u, r, world_size=world, timeout=300)):
        for (heads, impl, layout, dtype), traffic in results.items():
            want = expected(u, r, heads, impl, dtype, u * r)
            if traffic != want:
                failures.append(
                    f"rank {rank} {heads} {impl} {layout} {dtype}: got {traffic}, want {want}"
                )
    assert not failures, "\n".join(failures[:10])


def test_the_formula_by_hand():
    """Spot values worked out independently of ``traffic_formula``: Llama-3-8B heads, bf16,
    128k tokens, u=4 x r=2 (no replication) and u=8 x r=8 at 1M (KV heads 8 -> 8/8 = 1)."""
    shape = emulate.AttentionShape(32, 8, 128)
    f = emulate.traffic_formula(
        shape, batch=1, seqlen=131072, ulysses=4, ring=2, ring_impl="p2p", item_bytes=2, acc_bytes=4
    )
    local = 131072 // 8
    # q (32 heads) + k, v (8 each) + out (32): 80 heads of 16k tokens, 3/4 of it leaves
    assert f["forward"]["all_to_all"]["sent"] == 80 * local * 128 * 2 * 3 // 4 == 251_658_240
    # one K/V block: 64k tokens x 2 KV heads x 128 x 2 bytes x (K and V)
    block = 65536 * 2 * 128 * 2 * 2
    assert f["forward"]["p2p"] == {"sent": block, "received": block, "calls": 1}
    # backward: the K/V block again + its float32 dK/dV accumulator (twice the bytes), one hop each
    assert f["backward"]["p2p"] == {
        "sent": block + 2 * block,
        "received": 3 * block,
        "calls": 2,
    }
    big = emulate.traffic_formula(
        shape,
        batch=1,
        seqlen=1 << 20,
        ulysses=8,
        ring=8,
        ring_impl="allgather",
        item_bytes=2,
        acc_bytes=4,
    )
    kv = 2 * (1 << 17) * 1 * 128 * 2  # 128k tokens x 1 KV head x 128 x bf16, K and V
    assert big["forward"]["all_gather"]["sent"] == 7 * kv
    assert big["backward"]["reduce_scatter"]["received"] == 7 * 2 * kv
    assert set(big["backward"]) == {"all_to_all", "all_gather", "reduce_scatter"}


def test_replication_grows_kv_traffic():
    """Hkv=2 at u=8: each KV head is repeated 4 times before the all-to-all, so GQA moves
    exactly what MHA moves; at u=2 nothing is repeated and the ring moves 1/4 of MHA's."""
    mha, gqa = emulate.AttentionShape(8, 8, 16), emulate.AttentionShape(8, 2, 16)
    common = dict(batch=1, seqlen=256, ring_impl="p2p", item_bytes=2, acc_bytes=4)
    assert emulate.traffic_formula(gqa, ulysses=8, ring=2, **common) == emulate.traffic_formula(
        mha, ulysses=8, ring=2, **common
    )
    split_mha = emulate.traffic_formula(mha, ulysses=2, ring=8, **common)
    split_gqa = emulate.traffic_formula(gqa, ulysses=2, ring=8, **common)
    for phase in ("forward", "backward"):
        assert 4 * split_gqa[phase]["p2p"]["sent"] == split_mha[phase]["p2p"]["sent"]
