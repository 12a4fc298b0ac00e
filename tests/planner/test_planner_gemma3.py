"""``usp plan`` on Gemma 3 and the MLP tiles of every family: the lever search takes
MLP tiles for every family (Gemma's GeGLU, the experts), tiles lower the planned peak
where an MLP part holds it (GeGLU, clamped-SwiGLU experts, experts with a shared
expert), and a planned step of the gemma3-tiny preset (sliding windows through the
planning kernels) estimates what one real step allocates."""

from __future__ import annotations

import pytest
from planner_cases import write_config

from usp.models import PRESETS, Levers, MistralConfig, model_counts
from usp.planner.footprint import Choice, Target
from usp.planner.measure import measure
from usp.planner.search import lever_options, tiles_mlp
from usp.planner.validate import real_peak
from usp.train.config import load_train_config

pytestmark = pytest.mark.usefixtures("one_thread")  # (tests/conftest.py)


def test_the_lever_search_takes_mlp_tiles_for_every_family():
    for name in ("gemma-3-4b", "gpt-oss-20b", "qwen3-30b-a3b", "qwen3.5-35b-a3b", "tiny"):
        assert tiles_mlp(PRESETS[name]), name
        options = lever_options(PRESETS[name], (1, 8, 1), 8)
        assert any(levers.mlp_tile_tokens for levers in options), name


#: the tiny presets with MLP parts wide enough to hold a step's peak: GeGLU,
#: clamped-SwiGLU experts, SwiGLU experts with a shared expert
WIDE_MLPS = {
    "gemma3-tiny": {"intermediate_size": 2048},
    "gpt-oss-tiny": {"intermediate_size": 512},
    "qwen3.5-moe-tiny": {"moe_intermediate_size": 512, "shared_expert_intermediate_size": 1024},
}


@pytest.mark.parametrize("preset", list(WIDE_MLPS))
def test_mlp_tiles_lower_the_planned_peak(tmp_path, preset):
    """u1 x r4, 1,024 local tokens, checkpointing: tiles of 128 tokens lower the planned
    peak of a step whose peak an MLP part holds (one decoder layer: every layer has the
    same MLP part, and the planner's depth line is tested in tests/planner/test_planner.py)."""
    job = load_train_config(write_config(tmp_path, seq_len=4096))
    target = Target(job, PRESETS[preset].replace(**WIDE_MLPS[preset]), 4, 4, "cpu")
    untiled = measure(target, Choice(1, 4, 1, Levers(True)), layers=1).peak_device
    tiled = measure(target, Choice(1, 4, 1, Levers(True, mlp_tile_tokens=128)), layers=1)
    tiled = tiled.peak_device
    assert tiled < untiled, (tiled, untiled)


def test_gemma3_estimate_matches_a_real_step(tmp_path):
    """ulysses 2 x ring 2 with checkpointing, window 16 < 1024 local tokens: within 5%."""
    job = load_train_config(write_config(tmp_path, seq_len=4096))
    target = Target(job, PRESETS["gemma3-tiny"], 4, 4, "cpu")
    choice = Choice(2, 2, 1, Levers(True))
    estimate = measure(target, choice).peak_device
    real = real_peak(target, choice)
    assert real > 1_000_000
    assert 0.95 <= estimate / real <= 1.05, (estimate, real)


def test_a_mistral_window_is_planned_and_its_step_time_counts_it(tmp_path):
    """A Mistral whose sliding_window (64) is shorter than the sequence (2,048 tokens, u1 x
    r4): planned through the planning kernels' window, and the step time's attention
    counts the pairs each sliding layer sees, less than full causal attention's."""
    from usp.planner.plan import _cluster
    from usp.planner.search import comm_bytes, step_time

    job = load_train_config(write_config(tmp_path, seq_len=2048))
    windowed = MistralConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=65536,
        sliding_window=64,
    )  # fmt: skip
    full = windowed.replace(sliding_window=None)
    choice = Choice(1, 4, 1, Levers(True))
    cluster, _ = _cluster(job, 1, None, None, None, "cpu")
    times = {}
    for config in (windowed, full):
        target = Target(job, config, 4, 4, "cpu")
        assert measure(target, choice).peak_device > 0
        times[config.sliding_window] = step_time(
            target, choice, cluster, comm_bytes(target, choice)
        )
    assert times[64] < times[None]
    square = model_counts(windowed).attention_square([2048])
    assert square == 2 * (64 * 65 / 2 + (2048 - 64) * 64)  # both layers slide
