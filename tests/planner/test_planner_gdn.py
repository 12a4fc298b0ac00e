"""``usp plan`` on Gated DeltaNet (the qwen3.5-tiny preset on one node of 4 CPU ranks): the
planned chunk loop of :mod:`usp.linear.kernel` (a few allocations in place of 7 ops per
chunk) against the loop itself under the same tracker, and the planner's GDN state
traffic against docs/models.md's formula."""

from __future__ import annotations

import pytest
from planner_cases import write_config

from usp.models import PRESETS, Levers
from usp.planner.footprint import SCALING_DEPTHS, Choice, Target, scaling_runs
from usp.planner.measure import measure, measure_scaled
from usp.planner.timing import comm_bytes
from usp.planner.traffic import gdn_traffic
from usp.train.config import load_train_config

pytestmark = pytest.mark.usefixtures("one_thread")  # (tests/conftest.py)


@pytest.mark.parametrize(
    "choice",
    [Choice(1, 4, 1, Levers(False)), Choice(2, 2, 1, Levers(True))],
    ids=["u1r4", "u2r2-checkpointing"],
)
def test_planned_chunk_loop_is_never_below_the_loop(tmp_path, choice):
    """2048 tokens (512 a rank on u1 x r4: 4 chunks of 64 a zigzag piece; 1024 a ring rank
    on u2 x r2: 8; the ring's maps too): every phase's device peak of the planned loop is
    at least the loop's, and at most 10% above (the planned loop keeps one more V a chunk
    and its backward keeps the chunk states to its end: measured 1.000 to 1.075 at 4096
    tokens on these and u1 x r4 with checkpointing, u2 x r2 without). 2048 tokens, not
    4096: the exact loop's chunks halved (the two measurements' ops: 32,459 -> 29,087 on
    u1 x r4, 53,539 -> 43,915 on u2 x r2)."""
    job = load_train_config(write_config(tmp_path, seq_len=2048))
    target = Target(job, PRESETS["qwen3.5-tiny"], 4, 4, "cpu")
    exact = measure(target, choice, representative=False)
    planned = measure(target, choice, representative=True)
    assert len(planned.phases) == len(exact.phases)
    assert exact.peak_device > 10_000_000
    for fast, slow in zip(planned.phases, exact.phases):
        assert slow.device <= fast.device <= 1.10 * slow.device, (fast.device, slow.device)


def test_the_step_time_counts_gdn_state_traffic_and_full_layers_attention(tmp_path):
    """qwen3.5-tiny (linear, linear, full, linear) on u2 x r2: the step's bytes are one
    full-attention layer's attention traffic and three GDN layers' state traffic (the
    formula that tests/attention/test_gdn_usp.py holds against CommStats), per pass."""
    job = load_train_config(write_config(tmp_path, seq_len=4096))
    model = PRESETS["qwen3.5-tiny"]
    target = Target(job, model, 4, 4, "cpu")
    choice = Choice(2, 2, 1, Levers(True))  # checkpointing: every forward twice
    sent = comm_bytes(target, choice)
    layer = gdn_traffic(
        batch=1, seqlen=4096, ulysses=2, ring=2, key_heads=2, heads=4, key_dim=16,
        value_dim=16, kernel=4, layout="zigzag", documents=1, item_bytes=4, gate_bytes=4,
        state_bytes=4,
    )  # fmt: skip
    forward, backward = layer["forward"], layer["backward"]
    assert sent["linear_all_to_all"] == 3 * (2 * forward["all_to_all"]["sent"]
                                             + backward["all_to_all"]["sent"])  # fmt: skip
    assert sent["linear_all_gather"] == 3 * 2 * forward["all_gather"]["sent"]
    assert sent["linear_reduce_scatter"] == 3 * backward["reduce_scatter"]["sent"]
    assert 0 < sent["linear_all_gather"] < sent["attention_p2p"]
    # the ring's part of a GDN layer does not grow with the sequence; attention's does
    longer = comm_bytes(target.at(8192), choice)
    assert longer["linear_all_gather"] == sent["linear_all_gather"]
    assert longer["attention_p2p"] == 2 * sent["attention_p2p"]
    llama = comm_bytes(Target(job, PRESETS["tiny"], 4, 4, "cpu"), choice)
    assert not any(kind.startswith("linear_") for kind in llama)


def test_a_line_per_layer_kind_against_the_full_depth(tmp_path):
    """qwen3.5-tiny at 8 layers (linear x2, full, linear x3, full, linear): the runs are
    the first 2 layers and the last, then with one linear or one full layer before the
    last; every phase within 1% of the full-depth step (measured 1.0018, 0.9976, 1.0014,
    1.0013; the single line through 3 and 4 layers, which counted every deeper layer as
    the 4th's kind: 1.047, 0.988, 1.003, 1.003). A model of one kind keeps 3 and 4."""
    job = load_train_config(write_config(tmp_path, seq_len=1024))
    model = PRESETS["qwen3.5-tiny"].replace(num_hidden_layers=8)
    linear, full = "linear_attention", "full_attention"
    assert scaling_runs(model) == (
        (linear, linear, linear),
        (linear, linear, linear, linear),
        (linear, linear, full, linear),
    )
    assert scaling_runs(PRESETS["tiny"].replace(num_hidden_layers=8)) == SCALING_DEPTHS
    target = Target(job, model, 4, 4, "cpu")
    choice = Choice(2, 2, 1, Levers(True))
    exact = measure(target, choice)
    scaled = measure_scaled(target, choice)
    assert exact.layers == scaled.layers == 8
    for line, step in zip(scaled.phases, exact.phases):
        assert abs(line.device / step.device - 1) < 0.01, (line.device, step.device)
