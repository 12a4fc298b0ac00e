"""``[train] compile = true``: every decoder layer compiled whole (``usp.train.parallelize.
compile_layers``: fullgraph, Inductor with ``usp.compile_options``, the attention's
collectives inside the graph), trained on 4 gloo ranks (ulysses 2 x ring 2, FSDP2) for
3 steps against the same job in eager mode on the same ranks, on the main job's data:
generated documents packed into sequences, a new packing at every step, which the
compiled layers take without recompiling (``error_on_recompile``).

The same launches train the tiny Qwen3-MoE preset (a dense first layer, a sparse one,
the load-balancing loss on) for 5 steps, compiled and eager: the experts' data-dependent
part is one ``usp::moe_experts`` op of each layer's graph (usp.models.moe_op) and the
router statistics leave the layer as an output, so loss, gradient norm and the metrics'
``aux_loss`` agree to the same tolerance.

A family whose layers do not compile whole yet (sliding windows over packed documents:
gpt-oss, Gemma 3; qwen3_5's GDN) is refused at set-up, with the same message on every
rank of the launch.

Tolerance: Inductor fuses and reorders float32 arithmetic, so losses and gradient norms
agree to float32 rounding, not bit for bit: 1e-5 relative per step (observed in one
process: 5e-8 on the loss, gradient norms equal).
"""

from __future__ import annotations

import io

import pytest
from train_cases import base_config
from usp_cases import topology

from usp.config import ConfigError
from usp.models.family import PRESETS, family_of
from usp.sp.plan import Plan
from usp.train.config import train_config_from_dict
from usp.train.trainer import train

STEPS = 3
TOL = 1e-5
COMPILE_TIMEOUT = 600  # Inductor on 4 ranks sharing small CI machines
#: families whose layers do not compile whole yet: sliding windows over packed
#: documents (usp.models.decoder.WINDOW_COMPILE_REFUSAL), the Gated DeltaNet layers
#: (qwen3_5's)
REFUSED_PRESETS = (
    "gpt-oss-tiny",  # windows over packed documents (its experts compile)
    "gemma3-tiny",  # windows over packed documents
    "qwen3.5-tiny",
    "qwen3.5-moe-tiny",
)


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
    packings = []  # the document count of every packed micro-batch
    pack = plan.pack

    def recording_pack(cu_seqlens, **kwargs):
        packings.append(len(cu_seqlens) - 1)
        return pack(cu_seqlens, **kwargs)

    plan.pack = recording_pack
    # a new packing must reuse the layers' graphs: a recompile is an error
    with torch._dynamo.config.patch(error_on_recompile=True):
        result = train(job, plan, output_dir=out, stream=io.StringIO())
    rows = [(r["step"], r["loss"], r["grad_norm"]) for r in result.metrics]
    dense_packings = list(packings)  # (the MoE run below packs too)
    graphs = counters["stats"]["unique_graphs"]
    # the MoE preset, from fresh caches (the dense model's shapes would make Dynamo mark
    # dimensions dynamic): its dense and sparse layers are two graphs of one forward (a
    # recompile by design), so outside error_on_recompile
    torch._dynamo.reset()
    moe = {**config, "model": {"preset": "qwen3-moe-tiny"}}
    result = train(train_config_from_dict(moe), plan, output_dir=f"{out}_moe", stream=io.StringIO())
    moe_rows = [(r["step"], r["loss"], r["grad_norm"], r["aux_loss"]) for r in result.metrics]
    moe_graphs = counters["stats"]["unique_graphs"] - graphs
    breaks = sum(counters["graph_break"].values())
    refused = None
    if config["train"]["compile"]:  # a family that cannot compile yet: refused at set-up
        oss = {**config, "model": {"preset": "gpt-oss-tiny"}}
        try:
            train(train_config_from_dict(oss), plan, output_dir=f"{out}_oss", stream=io.StringIO())
        except ConfigError as err:
            refused = str(err)
    return {"rows": rows, "moe_rows": moe_rows, "graphs": graphs, "moe_graphs": moe_graphs,
            "breaks": breaks,
            "packings": dense_packings, "refused": refused}  # fmt: skip


def test_compiled_layers_train_like_eager_on_4_ranks(distributed, tmp_path):
    runs = {}
    for compile in (False, True):
        # the main job's data (examples/configs/cpu_finetune.toml): documents of 20-40
        # letters, padded to multiples of 8, about 6 packed into each 256-token sequence
        config = base_config(
            steps=STEPS, checkpoint_interval=0, compile=compile, global_batch=2, micro_batch=2,
            seq_len=256,
            data={"synthetic_documents": 256, "synthetic_length": 40, "document_multiple": 8},
        )  # fmt: skip
        out = tmp_path / f"compile_{compile}"
        runs[compile] = distributed.run(
            run_compile_case, config, str(out), world_size=4, timeout=COMPILE_TIMEOUT
        )
    eager, compiled = runs[False], runs[True]
    assert all(r["graphs"] == 0 for r in eager)
    assert all(r["graphs"] > 0 for r in compiled), [r["graphs"] for r in compiled]
    assert all(r["moe_graphs"] == 0 for r in eager)
    assert all(r["moe_graphs"] > 0 for r in compiled), [r["moe_graphs"] for r in compiled]
    assert all(r["breaks"] == 0 for r in compiled)  # each layer whole (fullgraph=True)
    # every step a new packing, with different document counts: reused without recompiling
    packings = compiled[0]["packings"]
    assert len(packings) == STEPS and len(set(packings)) > 1 and min(packings) > 1, packings
    assert packings == eager[0]["packings"]
    assert all(r["rows"] == compiled[0]["rows"] for r in compiled), "ranks log alike"
    refused = compiled[0]["refused"]
    assert refused is not None and "set [train] compile = false for gpt_oss" in refused
    assert "sliding-window layers" in refused
    assert all(r["refused"] == refused for r in compiled)  # every rank, the same message
    rows, reference = compiled[0]["rows"], eager[0]["rows"]
    assert [r[0] for r in rows] == list(range(1, STEPS + 1))
    for (step, loss, norm), (_, ref_loss, ref_norm) in zip(rows, reference):
        assert abs(loss - ref_loss) <= TOL * abs(ref_loss), (step, loss, ref_loss)
        assert abs(norm - ref_norm) <= TOL * abs(ref_norm), (step, norm, ref_norm)
    assert rows[-1][1] < rows[0][1]  # it trains
    # the MoE preset, compiled against eager (its aux term included)
    moe, moe_reference = compiled[0]["moe_rows"], eager[0]["moe_rows"]
    assert all(r["moe_rows"] == moe for r in compiled), "ranks log alike"
    assert [r[0] for r in moe] == list(range(1, STEPS + 1))
    for row, ref in zip(moe, moe_reference):
        for value, expected in zip(row[1:], ref[1:]):
            assert abs(value - expected) <= TOL * abs(expected), (row, ref)
    assert moe[-1][1] < moe[0][1] and moe[0][3] > 0  # it trains, with its aux term


def test_compile_must_be_a_boolean():
    with pytest.raises(ConfigError, match="compile must be true or false"):
        train_config_from_dict(base_config(compile="yes"))


@pytest.mark.parametrize("preset", REFUSED_PRESETS)
def test_compile_refuses_the_moe_and_gdn_families_at_set_up(preset, tmp_path):
    config = base_config(compile=True, checkpoint_interval=0)
    config["model"] = {"preset": preset}
    family = family_of(PRESETS[preset]).name
    with pytest.raises(ConfigError, match=rf"set \[train\] compile = false for {family} models"):
        train(train_config_from_dict(config), None, output_dir=tmp_path, stream=io.StringIO())
    assert not (tmp_path / "checkpoints").exists()  # refused before anything ran
