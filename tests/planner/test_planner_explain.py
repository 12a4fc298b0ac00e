"""``usp.planner.explain``: what is live at each phase's peak of a planned step, by op,
source line and module, adding up to the planner's own numbers."""

import pytest
from planner_cases import target_of, write_config

from usp.models import Levers
from usp.planner.explain import NOT_CREATED, explain, main, text
from usp.planner.footprint import Choice
from usp.planner.measure import measure

pytestmark = pytest.mark.usefixtures("one_thread")  # (tests/conftest.py)


@pytest.fixture
def target(tmp_path):
    path = write_config(tmp_path, ulysses=2, ring=2, seq_len=1024, device="cuda")
    return target_of(path, 4, "cuda")


@pytest.mark.parametrize(
    "choice", [Choice(2, 2, 1, Levers(True)), Choice(1, 4, 1, Levers("offload", 64))]
)
def test_every_byte_of_each_phase_peak_is_attributed(target, choice):
    """Each phase's groups add up to the tracker's peak, and per category to the planner's
    breakdown, byte for byte; only what existed before the step (the optimizer state
    of the first step) is not made by an op of the step; everything else names a usp
    source line or an autograd node (or FSDP's own buffers, outside usp)."""
    explained = explain(target, choice, layers=2)
    planned = measure(target, choice, layers=2)
    assert [e.device for e in explained] == [p.device for p in planned.phases]
    for e, phase in zip(explained, planned.phases):
        assert e.attributed == e.device == phase.device > 0
        for name, value in phase.breakdown.items():
            assert e.category(name) == value, (e.phase, name)
        before = [i for i in e.live if i.where == NOT_CREATED.where]
        assert {i.category for i in before} <= {"optimizer_state", "parameters"}
        for item in e.live:
            assert item.where.startswith(("usp/", "autograd ", "(outside usp)", "(not created"))
    backward = explained[1]
    # the tokens of this rank: 1024 / 4; its layer input [1, 256, 64] in bf16 is there
    assert backward.tokens == 256
    sources = {i.where.split(":")[0] for i in backward.live}
    assert "usp/models/stack.py" in sources  # (the decoder layers' code)


def test_the_command_prints_the_peak_table(tmp_path, capsys):
    path = write_config(tmp_path, ulysses=2, ring=2, seq_len=1024, device="cuda")
    assert main([str(path), "--ulysses", "2", "--layers", "2", "--top", "5"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("peak of backward 0:")
    assert "| MiB | B/token |" in out and "(the rest)" in out
    assert main([str(tmp_path / "missing.toml")]) == 2
    assert "explain: error:" in capsys.readouterr().err


def test_text_of_a_named_phase(target):
    explained = explain(target, Choice(2, 2, 1, Levers(False)), layers=2)
    assert text(explained, phase="forward 0", top=3).startswith("peak of forward 0:")


def test_the_norm_keeps_no_float32_copy_of_its_input(target, monkeypatch):
    """The planned step (bf16) with usp's RMSNorm against the plain formula through
    autograd: the final norm (outside activation checkpointing) kept a float32 copy of
    its input and the normalised input in bf16 (6 bytes a value) where usp's keeps the
    bf16 input (2): the forward's peak drops by 4 bytes per value of [local tokens,
    hidden], exactly, and the backward's by at least as much."""
    import dataclasses

    import usp.models.norm as norm
    from usp.models.norm import rms_norm_reference

    target = dataclasses.replace(target, job=target.job.with_overrides(seq_len=4096))
    choice = Choice(1, 4, 1, Levers(True))
    ours = measure(target, choice)
    monkeypatch.setattr(norm, "rms_norm", rms_norm_reference)  # what RMSNorm calls
    plain = measure(target, choice)
    saved = (4096 // 4) * target.model.hidden_size * 4
    forward, backward = 0, 1
    assert plain.phases[forward].device - ours.phases[forward].device == saved
    # the backward's peak is in the last layer's recomputed MLP since the loss's backward
    # dropped below it (usp/models/loss.py), where the plain layer norms' float32 copies
    # are live too: measured 10 bytes a value here, at least the final norm's 4
    assert plain.phases[backward].device - ours.phases[backward].device >= saved


def test_attention_head_chunks_lower_the_planned_backward_peak(target):
    """A model whose backward peak is the ring's (16 query / 4 KV heads of dim 64 on a
    ring of 4, bf16 plan): [train] attention_head_chunks 2 and 4 lower that peak
    (measured: 25.67 -> 25.13 -> 19.62 MB; with 2 groups the groups' input copies eat
    most of the saving at this size), and do not raise the forward's (one document is a
    dense sequence: its diagonal block's float32 output is the ring forward's largest
    buffer, 14.25 -> 14.12 MB with head groups)."""
    import dataclasses

    model = target.model.replace(num_attention_heads=16, num_key_value_heads=4, head_dim=64)
    peaks = {}
    for chunks in (1, 2, 4):
        job = target.job.with_train(seq_len=4096)
        planned = measure(dataclasses.replace(target, job=job, model=model),
                          Choice(1, 4, 1, Levers("offload", 256, chunks)))  # fmt: skip
        peaks[chunks] = [p.device for p in planned.phases]
    forward, backward = 0, 1
    assert peaks[4][forward] <= peaks[2][forward] <= peaks[1][forward]
    assert peaks[4][backward] < peaks[2][backward] < peaks[1][backward]
    assert peaks[4][backward] <= 0.8 * peaks[1][backward]


def test_levers_plan_script_measures_each_option(target, tmp_path):
    """benchmarks/levers_plan.py on the tiny config: its row is the planner's own
    measurement, and the longest sequence it finds is a multiple the grid can run."""
    from usp_cases import load_benchmark

    from usp.planner import search
    from usp.planner.measure import measure_scaled

    path = write_config(tmp_path, ulysses=2, ring=2, seq_len=1024, device="cuda")
    script = load_benchmark("levers_plan")
    # a GPU with 4 MiB left for the step after the planner's named overheads
    costs = search.overheads(target, Choice(1, 4, 1), search.Cluster(1, 4, 100.0, 2048.0))
    fixed = sum(i.nbytes for i in costs.device_fixed if i.name != "margin") / 2**30
    memory = (0.004 * (1 + costs.reserve_fraction) + fixed) / 0.99
    table = script.main([str(path), "--seq-lens", "512", "--grid", "1x4",
                         "--gpu-memory-gib", str(memory), "--only", "true:0"])  # fmt: skip
    assert len(table) == 1 and table[0]["activation_checkpointing"] is True
    job = target.job.with_overrides(seq_len=512)
    planned = measure_scaled(dataclasses_replace(target, job), Choice(1, 4, 1, Levers(True)))
    assert table[0][512][0] * 2**30 == planned.peak_device
    longest = table[0]["longest"]
    assert (
        longest > 0 and longest % search.sequence_multiple(Choice(1, 4, 1, Levers(True)), job) == 0
    )


def dataclasses_replace(target, job):
    import dataclasses

    return dataclasses.replace(target, job=job)
