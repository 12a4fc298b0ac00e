"""``usp plan``'s shortcuts are exact: the planning tracker against torch's plain one, the
worker pool against the measurements in process, the search's schedule against the
plain order."""

import pytest
import torch
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

from usp.models import PRESETS
from usp.planner.measure import Layout, Target, measure
from usp.planner.tracker import PlanningTracker, returns_no_tensor
from usp.train.config import load_train_config

CONFIG = """
[cluster]
nodes = 1
gpus_per_node = {gpus}
[parallel]
ulysses = 1
ring = 1
[attention]
layout = "zigzag"
[model]
preset = "tiny"
[model.overrides]
num_hidden_layers = {layers}
[data]
source = "synthetic"
[train]
steps = 1
global_batch = {global_batch}
seq_len = {seq_len}
device = "cpu"
"""


def write_config(tmp_path, *, gpus=4, layers=2, seq_len=512, global_batch=1):
    path = tmp_path / "plan.toml"
    path.write_text(
        CONFIG.format(gpus=gpus, layers=layers, seq_len=seq_len, global_batch=global_batch)
    )
    return path


def target_of(path, world, device="cpu"):
    job = load_train_config(path)
    model = PRESETS["tiny"].replace(**job.model.overrides)
    return Target(job, model, world, world, device)


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# ----------------------------------------------------------------------------- tracker
def test_returns_no_tensor_reads_the_schema():
    ops = torch.ops
    assert returns_no_tensor(ops.prim.device.default)
    assert returns_no_tensor(ops.aten.sym_size.int)
    assert returns_no_tensor(ops.aten.is_contiguous.default)
    assert returns_no_tensor(ops.aten._foreach_add_.Scalar)  # in place, returns nothing
    assert not returns_no_tensor(ops.aten.mm.default)
    assert not returns_no_tensor(ops.aten.split.Tensor)  # Tensor[]
    assert not returns_no_tensor(ops.aten._scaled_dot_product_cudnn_attention.default)
    assert not returns_no_tensor(ops.c10d._allgather_base_.default)  # (Tensor, Work)


class CountingTracker(PlanningTracker):
    """The planning tracker, counting the ops that took its fast path."""

    fast = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if returns_no_tensor(func):
            CountingTracker.fast += 1
        return super().__torch_dispatch__(func, types, args, kwargs)


@pytest.mark.parametrize(
    "layout, device, global_batch",
    [
        (Layout(2, 2, 1, True), "cpu", 1),
        (Layout(1, 4, 1, "offload", 64), "cuda", 1),  # bf16, host stand-in, MLP tiles
        (Layout(4, 1, 1, False), "cuda", 2),  # two micro-batches
    ],
)
def test_planning_tracker_footprint_equals_the_plain_trackers(
    tmp_path, layout, device, global_batch
):
    """Every phase's device and host peak and its breakdown, byte for byte."""
    path = write_config(tmp_path, seq_len=1024, global_batch=global_batch)
    target = target_of(path, 4, device)
    CountingTracker.fast = 0
    fast = measure(target, layout, tracker=CountingTracker)
    plain = measure(target, layout, tracker=FSDPMemTracker)
    assert CountingTracker.fast > 100  # the fast path ran (every .device query is one)
    assert fast == plain
    assert fast.peak_device > 0 and len(fast.phases) == 2 * global_batch + 2
    if layout.activation_checkpointing == "offload":
        assert fast.peak_host > 0
