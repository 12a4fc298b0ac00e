"""``[train] compile = true``: every decoder layer compiled whole (``usp.train.parallelize.
compile_layers``: fullgraph, Inductor with ``usp.compile_options``, the attention's
collectives inside the graph), trained on 4 gloo ranks (ulysses 2 x ring 2, FSDP2) for
5 steps against the same job in eager mode on the same ranks.

Tolerance: Inductor fuses and reorders float32 arithmetic, so losses and gradient norms
agree to float32 rounding, not bit for bit: 1e-5 relative per step (observed in one
process: 5e-8 on the loss, gradient norms equal).
"""

from __future__ import annotations

import io
import json

import pytest
import torch
from train_cases import base_config
from usp_cases import topology

from usp.config import ConfigError
from usp.plan import Plan
from usp.train.config import train_config_from_dict
from usp.train.trainer import train

STEPS = 5
TOL = 1e-5
COMPILE_TIMEOUT = 600  # Inductor on 4 ranks sharing small CI machines


def run_compile_case(config, out):
    import torch._dynamo
    import torch._inductor.config
    from torch._dynamo.utils import counters

    # 4 ranks share the machine: no pool of compile workers per rank
    torch._inductor.config.compile_threads = 1
    torch._dynamo.reset()
    counters.clear()
    job = train_config_from_dict(config)
    plan = Plan(topology(2, 2), verify_calls=False)  # as usp train does
    result = train(job, plan, output_dir=out, stream=io.StringIO())
    rows = [(r["step"], r["loss"], r["grad_norm"]) for r in result.metrics]
    breaks = sum(counters["graph_break"].values())
    return {"rows": rows, "graphs": counters["stats"]["unique_graphs"], "breaks": breaks}


def whole_sequence_documents(path, *, count=24, length=64) -> dict:
    """A [data] table of documents exactly one sequence long: every batch has the same
    shapes, so each layer compiles a few graphs once (packed batches of ever-new
    document lengths would recompile the attention's per-document code)."""
    gen = torch.Generator().manual_seed(21)
    rows = torch.randint(0, 256, (count, length), generator=gen).tolist()
    path.write_text("".join(json.dumps({"input_ids": r}) + "\n" for r in rows))
    return {"source": "jsonl", "files": [str(path)], "tokenizer": "byte"}


def test_compiled_layers_train_like_eager_on_4_ranks(distributed, tmp_path):
    runs = {}
    data = whole_sequence_documents(tmp_path / "docs.jsonl")
    for compile in (False, True):
        config = base_config(
            steps=STEPS, checkpoint_interval=0, compile=compile, global_batch=2, micro_batch=2
        )
        config["data"] = data
        out = tmp_path / f"compile_{compile}"
        runs[compile] = distributed.run(
            run_compile_case, config, str(out), world_size=4, timeout=COMPILE_TIMEOUT
        )
    eager, compiled = runs[False], runs[True]
    assert all(r["graphs"] == 0 for r in eager)
    assert all(r["graphs"] > 0 for r in compiled), [r["graphs"] for r in compiled]
    assert all(r["breaks"] == 0 for r in compiled)  # each layer whole (fullgraph=True)
    assert all(r["rows"] == compiled[0]["rows"] for r in compiled), "ranks log alike"
    rows, reference = compiled[0]["rows"], eager[0]["rows"]
    assert [r[0] for r in rows] == list(range(1, STEPS + 1))
    for (step, loss, norm), (_, ref_loss, ref_norm) in zip(rows, reference):
        assert abs(loss - ref_loss) <= TOL * abs(ref_loss), (step, loss, ref_loss)
        assert abs(norm - ref_norm) <= TOL * abs(ref_norm), (step, norm, ref_norm)
    assert rows[-1][1] < rows[0][1]  # it trains


def test_compile_must_be_a_boolean():
    with pytest.raises(ConfigError, match="compile must be true or false"):
        train_config_from_dict(base_config(compile="yes"))
