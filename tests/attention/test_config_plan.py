"""One way from a config to a Plan (``Plan.from_config``): the ``[attention]`` choices on a
topology that is built, given, or absent (one process); the trainer's ``build_plan`` on
top of it, with one ``verify_calls``."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from usp_cases import topology

import usp
from usp.config import ConfigError
from usp.process_groups import SINGLE_PROCESS
from usp.train.components import TRAIN_VERIFY_CALLS, build_plan
from usp.train.config import train_config_from_dict

CONFIG = (
    "[cluster]\nnodes = 1\ngpus_per_node = 4\n"
    "[parallel]\nulysses = 2\nring = 2\n"
    '[attention]\nlayout = "contiguous"\nring_impl = "allgather"\nbackend = "math"\n'
)


def _choices(plan):
    return (plan.layout, plan.ring_impl, plan.backend, plan.verify_calls)


def _write(tmp_path, text=CONFIG):
    path = tmp_path / "plan.toml"
    path.write_text(text)
    return str(path)


def run_given_topology(path):
    topo = topology(2, 2)
    plan = usp.Plan.from_config(path, topology=topo, verify_calls=True, backend="cpu")
    assert plan.topology is topo
    # the plan's shard and gather agree with the layout it took from the config
    full = torch.arange(16, dtype=torch.float64).reshape(1, 16)
    local = plan.shard(full)
    assert torch.equal(local, full[:, 4 * topo.sp_rank : 4 * topo.sp_rank + 4]), "contiguous"
    assert torch.equal(plan.gather(local), full)
    try:
        usp.Plan.from_config(path, topology=topology(1, 4))
    except ConfigError as err:
        message = str(err)
    else:
        message = "no error"
    dist.barrier()  # the groups stay usable after the refusal
    return _choices(plan), message


def test_plan_from_config_on_a_given_topology(distributed, tmp_path):
    path = _write(tmp_path)
    results = distributed.run(run_given_topology, path, world_size=4)
    assert all(r == results[0] for r in results)
    choices, message = results[0]
    assert choices == ("contiguous", "allgather", "cpu", True)
    assert message == (
        f"{path}: [parallel] says ulysses = 2, ring = 2; the topology given has ulysses 1 x "
        'ring 4 x dp 1. Make [parallel] match it (or set the key to "auto")'
    )


def test_plan_from_config_for_one_process(tmp_path):
    plan = usp.Plan.from_config(_write(tmp_path), topology=None, ring_impl="p2p")
    assert plan.topology is SINGLE_PROCESS and plan.sp_degree == 1
    # one process keeps tokens in order whatever the config says
    assert _choices(plan) == ("contiguous", "p2p", "math", None)
    with pytest.raises(
        usp.PlanError, match='topology must be "build", a usp.process_groups.Topology or None'
    ):
        usp.Plan.from_config(_write(tmp_path), topology="auto")

    # the Gated DeltaNet layers' kernels: [attention] linear_backend / linear_conv_backend
    text = CONFIG + 'linear_backend = "torch"\nlinear_conv_backend = "causal_conv1d"\n'
    plan = usp.Plan.from_config(_write(tmp_path, text), topology=None, linear_conv_backend="torch")
    assert (plan.linear_backend, plan.linear_conv_backend) == ("torch", "torch")
    assert plan.describe().endswith("backend=math, linear_backend=torch, linear_conv_backend=torch")
    kept = plan.with_options(layout="zigzag", backend="cpu")
    assert (kept.linear_backend, kept.linear_conv_backend) == ("torch", "torch")
    assert plan.with_options(linear_backend="fla").linear_backend == "fla"
    assert usp.Plan(None).describe().endswith("backend=auto")  # "auto" is not named
    with pytest.raises(
        usp.PlanError, match="unknown linear_backend 'triton'; valid: auto, torch, fla"
    ):
        usp.Plan(None, linear_backend="triton")
    with pytest.raises(usp.PlanError, match="valid: auto, torch, causal_conv1d"):
        plan.with_options(linear_conv_backend="fla")


JOB = {
    "cluster": {"nodes": 1, "gpus_per_node": 4},
    "parallel": {"ulysses": "auto", "ring": 2},
    "attention": {"layout": "contiguous", "ring_impl": "allgather"},
    "model": {"preset": "tiny"},
    "data": {"source": "synthetic"},
    "train": {"steps": 1, "global_batch": 4, "seq_len": 64},
}


def run_build_plan(job_dict):
    job = train_config_from_dict(job_dict, source="job.toml")
    built = build_plan(job)  # the topology from the config, the model's heads checked
    given = build_plan(job, topology(2, 2))
    result = [
        (p.ulysses_degree, p.ring_degree, *_choices(p))
        for p in (built, given, build_plan(job, None))
    ]
    built.topology.destroy()
    return result


def test_the_trainer_builds_its_plan_one_way(distributed):
    assert TRAIN_VERIFY_CALLS is False
    for result in distributed.run(run_build_plan, JOB, world_size=4, timeout=60):
        assert result == [
            (2, 2, "contiguous", "allgather", "auto", False),  # ulysses auto: 4 heads / ring 2
            (2, 2, "contiguous", "allgather", "auto", False),
            (1, 1, "contiguous", "allgather", "auto", False),
        ]
