"""Document placement by length (``placement="documents"``) through whole models, in
float64 against transformers' own implementation run document by document: a dense
family (Llama), a windowed one (gpt-oss: sliding window 6, sinks, experts) and a Gated
DeltaNet one (Qwen3.5), each on a packed batch of documents from 1 token to longer than
a rank's share, on ulysses 2 x ring 2 (zigzag), ulysses 1 x ring 4 (contiguous) and dp 2
x ring 2 (each replica its own batch): the loss on every rank and every gradient summed
over the SP group (1e-10), and the RoPE positions gathered back. One launch; every case asserts that some
documents were computed whole and some split.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from model_cases import (
    cu_of,
    global_batch,
    grad_errors,
    load_hf_reference,
    sft_labels,
    transformers_reference,
    write_family_checkpoint,
)
from qwen3_5_cases import load_reference as qwen3_5_reference
from qwen3_5_cases import write_checkpoint as write_qwen3_5
from usp_cases import topology

pytest.importorskip("transformers", reason="the reference is HF transformers")
pytest.importorskip("safetensors", reason="checkpoints are safetensors files")

import usp  # noqa: E402
from usp.linear import GatedDeltaNet  # noqa: E402
from usp.models import config_from_file, document_cost  # noqa: E402
from usp.sp.sharding import document_position_ids  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")  # (tests/conftest.py)

#: 64 tokens: 1 to 40 tokens, the 40 longer than a rank's share on 4 ranks (16) and on 2
#: (32): split on every grid; a multiple of every grid's sequence_multiple (4 or 8)
LENGTHS = [1, 3, 40, 5, 2, 9, 4]
GRIDS = [(2, 2, "zigzag"), (1, 4, "contiguous"), (1, 2, "zigzag")]  # the last: dp 2


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("placement")
    return {
        "llama": write_family_checkpoint(root / "llama", "llama", seed=5),
        "gpt_oss": write_family_checkpoint(root / "gpt_oss", "gpt_oss", seed=6),
        "qwen3_5": write_qwen3_5(root / "qwen3_5", "tied", seed=7),
    }


def reference_of(family, path):
    return qwen3_5_reference(path) if family == "qwen3_5" else load_hf_reference(path)


def batch_of(replica: int):
    """Replica ``replica``'s packed batch (tokens, globally shifted SFT labels)."""
    ids = global_batch(1, sum(LENGTHS), seed=30 + replica)
    cu = cu_of(LENGTHS)
    return ids, sft_labels(ids, [0, 1, 3, 2, 0, 4, 1], cu), cu


def run_families(checkpoints: dict):
    """On every rank, for each family and grid: the gathered positions, every SP rank's
    loss, the SP-summed gradients, and what this rank holds."""
    results = []
    for family, path in checkpoints.items():
        for ulysses, ring, layout in GRIDS:
            topo = topology(ulysses, ring)
            # the family's own cost model for one of them, the default for the others
            cost = document_cost(config_from_file(path / "config.json")) if ring == 4 else None
            plan = usp.Plan(topo, backend="math", layout=layout, placement="documents",
                            placement_cost=cost)  # fmt: skip
            model = usp.models.from_pretrained(str(path), plan, dtype=torch.float64)
            for module in model.modules():
                if isinstance(module, GatedDeltaNet):
                    module.chunk_size = 3  # several kernel chunks per document
            ids, labels, cu = batch_of(topo.dp_rank)
            batch = usp.models.shard_batch(plan, ids, labels=labels, cu_seqlens=cu, shift=False)
            placed = batch.packed
            loss = model(batch.input_ids, **batch.model_kwargs())
            loss.backward()
            losses = [None] * plan.sp_degree
            dist.all_gather_object(losses, loss.item(), group=plan.sp_group)
            grads = {}
            for name, param in model.named_parameters():
                grads[name] = param.grad.detach().clone()
                dist.all_reduce(grads[name], group=plan.sp_group)
            results.append({
                "case": (family, ulysses, ring, layout), "replica": topo.dp_rank,
                "positions": plan.gather(batch.position_ids[0], dim=0, packed=placed),
                "losses": losses,
                "grads": grads, "split": placed.assignment.split,
                "whole": placed.whole is not None,
            })  # fmt: skip
    return results


def test_placed_families_match_transformers(distributed, checkpoints):
    expected = {
        (family, replica): transformers_reference(reference_of(family, path), *batch_of(replica))
        for family, path in checkpoints.items()
        for replica in (0, 1)
    }
    every_rank = distributed.run(run_families, checkpoints, world_size=4, timeout=600)
    failures = []
    for rank, results in enumerate(every_rank):
        for result in results:
            case, want = result["case"], expected[result["case"][0], result["replica"]]
            assert result["split"] and len(result["split"]) < len(LENGTHS), case
            assert len(set(result["losses"])) == 1, (case, result["losses"])
            # every token's RoPE position is its place in its document
            assert torch.equal(result["positions"], document_position_ids(cu_of(LENGTHS))), case
            errors = {
                "loss": abs(result["losses"][0] - want["loss"]) / want["loss"],
                **grad_errors(result["grads"], want["grads"]),
            }
            failures += [
                f"{case} rank {rank} {n}: {e:.3g}" for n, e in errors.items() if not e <= 1e-10
            ]
    # in every case some rank computed whole documents
    for index in range(len(every_rank[0])):
        case = [results[index] for results in every_rank]
        assert any(r["whole"] for r in case), case[0]["case"]
    assert not failures, "\n".join(failures)
