"""Placement by documents when something goes wrong, on 2 gloo ranks with a short
timeout: one clear usp error on every rank, before anything is sent, and the groups
usable afterwards (a valid call and a barrier) -- tokens sharded for another placement
on one rank (attention, a Gated DeltaNet layer and a model's forward), ranks balancing
for different cost models, a document that must be split but cannot be."""

from __future__ import annotations

import itertools

import torch
import torch.distributed as dist
from gdn_cases import gdn_inputs
from usp_cases import topology

import usp
from usp.linear import gated_deltanet_usp
from usp.models import Llama, preset
from usp.sp.assignment import DocumentCost

TIMEOUT = 60  # seconds: a hang fails fast
HEAVY = DocumentCost(token_flops=1.0, attention=((None, 4.0),))


def cu_of(lengths) -> torch.Tensor:
    return torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)


def _outcome(call) -> str:
    try:
        call()
        return "no error"
    except Exception as err:  # noqa: BLE001 - the test compares type and text
        return f"{type(err).__name__}: {err}"


def _usable(topo) -> bool:
    plan = usp.Plan(topo, placement="documents")
    cu = cu_of([24, 6, 2])
    packed = plan.pack(cu)
    q = torch.randn(1, 32, 2, 8, generator=torch.Generator().manual_seed(1))
    out = plan.attention(*(plan.shard(q, packed=packed),) * 3, causal=True, packed=packed)
    dist.barrier()
    return bool(torch.isfinite(out).all())


def run_faults():
    topo = topology(1, 2)
    rank = dist.get_rank(topo.sp_group)
    documents = usp.Plan(topo, placement="documents")
    outcomes = {}
    # 24 split (12 a rank), 6 and 2 whole: 18 and 14 tokens; sharded by sequence: 16
    cu = cu_of([24, 6, 2])
    packed = documents.pack(cu)

    def shard(t):  # rank 1 takes an even half (16 tokens), not its placed 14
        return documents.shard(t, packed=packed) if rank == 0 else t[:, 16:]

    local = shard(torch.randn(1, 32, 2, 8))
    outcomes["attention"] = _outcome(
        lambda: documents.attention(local, local, local, causal=True, packed=packed)
    )
    inputs, ws, _ = gdn_inputs(1, 32, 1, 2, 4, 4, 4, dtype=torch.float32)
    gdn_local = [shard(t) for t in inputs]
    outcomes["gdn"] = _outcome(
        lambda: gated_deltanet_usp(*gdn_local, documents, conv_weights=ws, packed=packed)
    )
    model = Llama(preset("tiny").replace(num_hidden_layers=1), documents)
    ids = torch.randint(0, 256, (1, 32), generator=torch.Generator().manual_seed(2))
    outcomes["model"] = _outcome(lambda: model(shard(ids), cu_seqlens=cu))
    # different cost models: [16, 8, 8] is split by HEAVY only
    plan = usp.Plan(topo, placement="documents", placement_cost=HEAVY if rank else None)
    outcomes["cost"] = _outcome(lambda: plan.pack(cu_of([16, 8, 8])))
    # 30 tokens: more work than a rank's share, not a multiple of 4
    outcomes["multiple"] = _outcome(lambda: documents.pack(cu_of([30, 2])))
    return outcomes, _usable(topo)


def test_faults_are_one_error_on_every_rank(distributed):
    results = distributed.run(run_faults, world_size=2, timeout=TIMEOUT)
    (first, usable0), (second, usable1) = results
    assert usable0 and usable1, "the groups work after the failures"
    assert first == second, f"ranks raised different errors:\n{first}\n{second}"
    for name in ("attention", "gdn", "model"):
        message = first[name]
        assert message.startswith("ShardingError") and "failed on rank 1 of 2" in message, name
        assert "placement='documents' gives SP rank 1 14 of these documents" in message, name
    assert first["cost"].startswith("RankDisagreementError")
    assert "the documents' placement" in first["cost"] and "placement_cost" in first["cost"]
    assert first["multiple"].startswith("ShardingError")
    assert "document 0 (30 tokens)" in first["multiple"] and "multiple of 4" in first["multiple"]
