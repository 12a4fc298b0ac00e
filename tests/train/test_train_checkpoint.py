"""Training checkpoints restore the RNG: the state after loading equals the state at save.

Nothing in today's training draws random numbers after the model is built, so a missing
restore would surface only with dropout or sampling; it is checked directly here, in one
process and on 4 gloo ranks whose states differ (every rank gets its own back).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from usp.models import PRESETS, Llama
from usp.train.checkpoint import Checkpointer, TrainState


def _model_and_optimizer():
    torch.manual_seed(0)
    model = Llama(PRESETS["tiny"].replace(num_hidden_layers=1), None)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def save_then_load(directory: str, seed: int):
    """Save with the RNG seeded by ``seed``, draw from it (as training would), load, and
    return (state at save, state after load, a draw after save, the same draw after load)."""
    model, optimizer = _model_and_optimizer()
    checkpointer = Checkpointer(directory, model_config=model.config, keep=2)
    torch.manual_seed(seed)
    torch.rand(3)
    saved_state = torch.get_rng_state()
    path = checkpointer.save(model, optimizer, TrainState(step=5, data_position=40))
    after_save = torch.rand(4)
    torch.manual_seed(seed + 1000)  # anything else
    state = checkpointer.load(path, model, optimizer)
    loaded_state = torch.get_rng_state()
    return saved_state, loaded_state, after_save, torch.rand(4), state


def test_one_process_restores_the_cpu_rng(tmp_path):
    saved, loaded, drawn, redrawn, state = save_then_load(str(tmp_path), seed=11)
    assert state == TrainState(5, 40)
    assert torch.equal(loaded, saved), "the RNG state after loading is the state at save"
    assert torch.equal(redrawn, drawn), "so the draws after resuming repeat"


def run_ranks(directory: str):
    rank = dist.get_rank()
    return save_then_load(directory, seed=100 + rank)


def test_every_rank_gets_its_own_rng_back(distributed, tmp_path):
    results = distributed.run(run_ranks, str(tmp_path), world_size=4, timeout=120)
    for saved, loaded, drawn, redrawn, state in results:
        assert state == TrainState(5, 40)
        assert torch.equal(loaded, saved)
        assert torch.equal(redrawn, drawn)
    states = [r[0] for r in results]
    assert all(not torch.equal(states[0], s) for s in states[1:]), "the ranks' states differ"
