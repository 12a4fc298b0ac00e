"""The planner tests' tiny ``usp train`` config and the plan target it makes (one copy for
tests/planner/*)."""

from usp.models import PRESETS
from usp.planner.footprint import Target
from usp.train.config import load_train_config

TINY = """
[cluster]
nodes = 1
gpus_per_node = {gpus}
[parallel]
ulysses = {ulysses}
ring = {ring}
[attention]
layout = "{layout}"
ring_impl = "{ring_impl}"
backend = "{backend}"
[model]
preset = "tiny"
[model.overrides]
num_hidden_layers = {layers}
{extra_model}
[data]
source = "synthetic"
[train]
steps = 1
global_batch = {global_batch}
seq_len = {seq_len}
device = "{device}"
"""


def write_config(tmp_path, *, gpus=4, layers=2, seq_len=512, global_batch=1,
                 layout="zigzag", ring_impl="p2p", backend="auto", extra_model="",
                 ulysses=1, ring=1, device="cpu"):  # fmt: skip
    """``tmp_path / "plan.toml"``: the tiny model on one node of ``gpus`` ranks."""
    path = tmp_path / "plan.toml"
    path.write_text(
        TINY.format(
            gpus=gpus,
            layers=layers,
            seq_len=seq_len,
            global_batch=global_batch,
            layout=layout,
            ring_impl=ring_impl,
            backend=backend,
            extra_model=extra_model,
            ulysses=ulysses,
            ring=ring,
            device=device,
        )  # fmt: skip
    )
    return path


def target_of(path, world, device="cpu"):
    """What ``usp plan`` plans for ``path`` on one node of ``world`` ranks."""
    return target_of_job(load_train_config(path), world, device)


def target_of_job(job, world, device="cpu"):
    """What ``usp plan`` plans for a parsed job of the tiny preset on one node of
    ``world`` ranks."""
    model = PRESETS["tiny"].replace(**job.model.overrides)
    return Target(job, model, world, world, device)
