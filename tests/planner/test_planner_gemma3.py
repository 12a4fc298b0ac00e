"""``usp plan`` on Gemma 3: its GeGLU MLPs leave MLP tiles out of the lever search, and a
planned step of the gemma3-tiny preset (sliding windows through the planning kernels)
estimates what one real step allocates."""

from __future__ import annotations

from planner_cases import write_config

from usp.models import PRESETS, Levers
from usp.planner.footprint import Choice, Target
from usp.planner.measure import measure
from usp.planner.search import lever_options, tiles_mlp
from usp.planner.validate import real_peak
from usp.train.config import load_train_config


def test_the_lever_search_leaves_out_mlp_tiles_for_gemma():
    assert not tiles_mlp(PRESETS["gemma-3-4b"]) and tiles_mlp(PRESETS["llama3.1-8b"])
    gemma = lever_options(PRESETS["gemma-3-4b"], (1, 8, 1), 8)
    assert gemma and all(levers.mlp_tile_tokens == 0 for levers in gemma)
    assert any(levers.mlp_tile_tokens for levers in lever_options(PRESETS["tiny"], (1, 4, 1), 4))


def test_gemma3_estimate_matches_a_real_step(tmp_path):
    """ulysses 2 x ring 2 with checkpointing, window 16 < 1024 local tokens: within 5%."""
    job = load_train_config(write_config(tmp_path, seq_len=4096))
    target = Target(job, PRESETS["gemma3-tiny"], 4, 4, "cpu")
    choice = Choice(2, 2, 1, Levers(True))
    estimate = measure(target, choice).peak_device
    real = real_peak(target, choice)
    assert real > 1_000_000
    assert 0.95 <= estimate / real <= 1.05, (estimate, real)
