"""``usp plan``'s step traffic on a Mamba-2 hybrid (granite4h-tiny: Mamba-2, Mamba-2,
attention, Mamba-2): its Mamba-2 layers counted by docs/models.md's formula
(:func:`usp.planner.mixer_traffic.mamba2_traffic`, held against ``CommStats`` in
tests/attention/test_mamba2_usp.py), its one attention layer by attention's."""

from __future__ import annotations

import pytest
from planner_cases import write_config

from usp.models import PRESETS, Levers
from usp.planner.footprint import Choice, Target
from usp.planner.mixer_traffic import mamba2_traffic
from usp.planner.placement import PlacedRow, row_bytes
from usp.planner.timing import comm_bytes
from usp.train.config import load_train_config

pytestmark = pytest.mark.usefixtures("one_thread")  # (tests/conftest.py)


def test_the_step_time_counts_mamba2_state_traffic_and_one_attention_layer(tmp_path):
    job = load_train_config(write_config(tmp_path, seq_len=4096))
    model = PRESETS["granite4h-tiny"]
    choice = Choice(2, 2, 1, Levers(True))  # checkpointing: every forward twice
    sent = comm_bytes(Target(job, model, 4, 4, "cpu"), choice)
    layer = mamba2_traffic(
        batch=1, seqlen=4096, ulysses=2, ring=2, heads=4, head_dim=32, groups=2,
        state_size=16, kernel=4, layout="zigzag", documents=1, item_bytes=4, state_bytes=4,
    )  # fmt: skip
    forward, backward = layer["forward"], layer["backward"]
    assert sent["linear_all_to_all"] == 3 * (2 * forward["all_to_all"]["sent"]
                                             + backward["all_to_all"]["sent"])  # fmt: skip
    assert sent["linear_all_gather"] == 3 * 2 * forward["all_gather"]["sent"]
    assert sent["linear_reduce_scatter"] == 3 * backward["reduce_scatter"]["sent"]
    # one attention layer of four: a quarter of the same model's traffic with every
    # layer attention
    dense = model.replace(layer_types=("full_attention",) * 4)
    all_attention = comm_bytes(Target(job, dense, 4, 4, "cpu"), choice)
    assert 4 * sent["attention_p2p"] == all_attention["attention_p2p"] > 0
    assert not any(kind.startswith("linear_") for kind in all_attention)
    # a placed row: the same per-layer formula (one pass each way) on the split documents
    row = PlacedRow("split", (4096,), (1024,) * 4, (0,) * 4, (0,) * 4)
    placed = row_bytes(row, model, ring=2, ulysses=2, layout="zigzag", ring_impl="p2p",
                       item_bytes=4)  # fmt: skip
    assert placed[0]["all_gather"] == 3 * forward["all_gather"]["sent"]
