"""Gradient accumulation: the planned step syncs gradients as the trainer's step does.

A step of ``k`` micro-batches turns FSDP's gradient sync off for all but the last, so
the first ``k - 1`` backwards keep their gradients unsharded (accumulating) and only the
last reduce-scatters. Syncing another micro-batch costs other memory (sharded gradients
early, unsharded ones held through the optimizer), so the planner must do what the
trainer does. Both are observed from outside the steps (no name of either step is used):
per forward of the FSDP root module (one per micro-batch), the sharded gradient bytes
it starts with and the reduce-scatters issued until the next one; and the planner's
memory per phase (:class:`usp.planner.footprint.Footprint`).
"""

from __future__ import annotations

import io
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from planner_cases import target_of_job
from train_cases import base_config
from usp_cases import topology

from usp.planner.footprint import Choice
from usp.planner.measure import measure
from usp.train.components import build_plan
from usp.train.config import train_config_from_dict
from usp.train.trainer import train

pytestmark = pytest.mark.usefixtures("one_thread")  # (tests/conftest.py)

#: FSDP's reduce-scatter entry points in torch.distributed (one call per FSDP unit)
REDUCE_SCATTERS = ("reduce_scatter_tensor", "reduce_scatter_single")


def _local_bytes(tensor) -> int:
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    return local.numel() * local.element_size()


class MicroBatchLog:
    """Rows ``[sharded gradient bytes at its start, reduce-scatters until the next]``, one
    per forward of the outermost FSDP module outside backward (a micro-batch). Reads
    only torch's global module hooks and ``torch.distributed``."""

    def __init__(self):
        self.rows: list[list[int]] = []
        self._depth = 0

    def __enter__(self) -> MicroBatchLog:
        from torch.distributed.fsdp import FSDPModule

        def before(module, args):
            outside_backward = torch._C._current_graph_task_id() == -1
            if self._depth == 0 and isinstance(module, FSDPModule) and outside_backward:
                grads = [p.grad for p in module.parameters() if p.grad is not None]
                self.rows.append([sum(_local_bytes(g) for g in grads), 0])
            self._depth += 1

        def after(module, args, output):
            self._depth -= 1

        def counted(original):
            def reduce_scatter(*args, **kwargs):
                if self.rows:
                    self.rows[-1][1] += 1
                return original(*args, **kwargs)

            return reduce_scatter

        hooks = torch.nn.modules.module
        self._handles = [
            hooks.register_module_forward_pre_hook(before),
            hooks.register_module_forward_hook(after),
        ]
        self._patches = [
            mock.patch.object(dist, name, counted(getattr(dist, name)))
            for name in REDUCE_SCATTERS
            if hasattr(dist, name)
        ]
        for patch in self._patches:
            patch.start()
        return self

    def __exit__(self, *exc) -> None:
        for patch in self._patches:
            patch.stop()
        for handle in self._handles:
            handle.remove()


def accumulating_config(global_batch: int = 2) -> dict:
    """The trainer tests' tiny job on ulysses 2 x ring 2, one step of ``global_batch``
    micro-batches of one sequence (dp 1: that many micro-batches)."""
    config = base_config(steps=1, global_batch=global_batch, micro_batch=1, checkpoint_interval=0)
    assert config["parallel"] == {"ulysses": 2, "ring": 2, "dp": 1}
    return config


def run_trainer_micro_batches(config: dict, out: str) -> list[list[int]]:
    """Body for every rank: one step of ``usp train`` with the log around it."""
    job = train_config_from_dict(config)
    plan = build_plan(job, topology(2, 2))
    with MicroBatchLog() as log:
        train(job, plan, output_dir=out, stream=io.StringIO())
    return log.rows


def planned_micro_batches(config: dict) -> list[list[int]]:
    """The same log around the planner's measured step of the same job (one rank of 4,
    fake process group)."""
    target = target_of_job(train_config_from_dict(config), 4)
    with MicroBatchLog() as log:
        measure(target, Choice(2, 2, 1))
    return log.rows


def test_the_planned_step_syncs_only_the_last_micro_batch_as_the_trainer_does(
    distributed, tmp_path
):
    """Two micro-batches: the first reduce-scatters nothing and leaves no sharded
    gradient behind, the last reduce-scatters once per FSDP unit (the 2 layers and the
    root), in the trainer's real step on 4 gloo ranks and in the planner's step alike."""
    config = accumulating_config()
    trained = distributed.run(
        run_trainer_micro_batches, config, str(tmp_path / "run"), world_size=4, timeout=240
    )
    units = 2 + 1  # one FSDP unit per decoder layer and the root
    assert all(rows == [[0, 0], [0, units]] for rows in trained), trained
    assert planned_micro_batches(config) == trained[0]


def test_planned_memory_of_an_accumulated_step(tmp_path):
    """The planner's memory figures of the same step: the second micro-batch's forward
    holds the first one's gradients unsharded (world x the sharded gradient bytes, on 4
    ranks) and no sharded gradient; after the last micro-batch's sync the optimizer phase
    holds exactly what a one-micro-batch step's holds (sharded gradients only)."""
    choice = Choice(2, 2, 1)
    single = measure(target_of_job(train_config_from_dict(accumulating_config(1)), 4), choice)
    double = measure(target_of_job(train_config_from_dict(accumulating_config(2)), 4), choice)
    sharded = single.phases[-1].breakdown["gradients"]
    assert sharded > 0 and single.phases[-1].breakdown.get("gradients_unsharded", 0) == 0
    # phases: forward 0, backward 0, [forward 1, backward 1,] clip, optimizer
    assert len(double.phases) == len(single.phases) + 2
    second_forward = double.phases[2].breakdown
    assert second_forward.get("gradients", 0) == 0, second_forward
    assert second_forward["gradients_unsharded"] == 4 * sharded, (second_forward, sharded)
    assert double.phases[-1] == single.phases[-1], (double.phases[-1], single.phases[-1])
    assert double.peak_device > single.peak_device  # accumulation holds gradients unsharded
