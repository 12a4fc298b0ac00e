"""``[train] offload_optimizer`` and ``offload_parameters`` on 4 gloo ranks.

On the CPU host and device are one memory, so "it trains exactly" alone would also pass
if the levers did nothing. These tests therefore check the offload path itself -- each
optimizer step copies every shard and its gradient to the host, updates the copies
with AdamW's arithmetic while the model's shard is still untouched, then copies back;
the AdamW moments are host tensors distinct from anything the model holds; with
``offload_parameters`` FSDP2's ``CPUOffloadPolicy`` holds every shard -- and that the
result equals an ordinary on-device AdamW bit for bit, step by step (the trainer's own
``TrainStep`` on both), and the whole trainer against one process.
"""

from __future__ import annotations

import io

import pytest
import torch
from train_cases import STEPS, _train_on_ranks, assert_matches_single, base_config
from usp_cases import topology

from usp.models import shard_batch
from usp.train import components, host_optimizer
from usp.train.config import train_config_from_dict
from usp.train.host_optimizer import HostAdamW
from usp.train.parallelize import fully_shard_model
from usp.train.step import TrainStep
from usp.train.trainer import train

TIMEOUT = 240


def _built(config: dict, plan, topo):
    job = train_config_from_dict(config)
    source = components.model_source(job)
    levers = job.train.levers
    model = components.build_model(job, source, plan, levers)  # the preset, from [train] seed
    sharded = fully_shard_model(model, topo, levers=levers, compute_dtype=torch.float32)
    optimizer = components.build_optimizer(job, sharded.module, levers)
    step = TrainStep(sharded.module, optimizer, loss_scale=sharded.loss_scale, grad_clip=0.5)
    return job, sharded.module, optimizer, step


def _batch(plan, job, seed: int):
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(3, 200, (1, job.train.seq_len), generator=gen)
    cu = torch.tensor([0, 24, job.train.seq_len], dtype=torch.int32)
    return shard_batch(plan, tokens, labels=tokens, cu_seqlens=cu, shift=False)


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def _fsdp_params(model):
    for module in model.modules():
        state = getattr(module, "_get_fsdp_state", None)
        group = state()._fsdp_param_group if state is not None else None
        yield from (group.fsdp_params if group is not None else ())


def run_offload_steps(offload_parameters: bool, lora: dict | None = None):
    """Body: the same job with and without the offload levers, stepped side by side
    (``lora``: ``[train] lora`` in both: the host AdamW holds the adapters only, the
    frozen base never leaves its shards unchanged)."""
    topo = topology(2, 2)
    extra = {} if lora is None else {"lora": lora}
    config = base_config(offload_optimizer=True, offload_parameters=offload_parameters, **extra)
    plain_config = base_config(**extra)
    plan = components.build_plan(train_config_from_dict(config), topo)
    job, model, optimizer, step = _built(config, plan, topo)
    _, plain_model, plain_optimizer, plain_step = _built(plain_config, plan, topo)
    assert type(optimizer) is HostAdamW and type(plain_optimizer) is torch.optim.AdamW
    assert optimizer.params_on_host == offload_parameters
    fsdp_params = list(_fsdp_params(model))
    assert fsdp_params and all(p.offload_to_cpu == offload_parameters for p in fsdp_params)
    assert not any(p.offload_to_cpu for p in _fsdp_params(plain_model))

    calls = []  # per update: (the model's shards untouched by it, its tensor is the model's)
    real_adamw = host_optimizer.adamw

    def watched_adamw(params, grads, exp_avgs, exp_avg_sqs, *args, **kwargs):
        (host,) = params
        before = [_local(p).clone() for p in model.parameters()]
        real_adamw(params, grads, exp_avgs, exp_avg_sqs, *args, **kwargs)
        untouched = all(torch.equal(_local(p), b) for p, b in zip(model.parameters(), before))
        in_model = any(host.data_ptr() == _local(p).data_ptr() for p in model.parameters())
        calls.append((untouched, in_model))

    base = {n: _local(p).clone() for n, p in model.named_parameters() if not p.requires_grad}
    host_optimizer.adamw = watched_adamw
    try:
        for seed in (1, 2, 3):
            batch = _batch(plan, job, seed)
            labels = int((batch.labels != -100).sum()) * 4  # (the step's labels: any value)
            step.run([batch], labels)
            plain_step.run([batch], labels)
            for p, q in zip(model.parameters(), plain_model.parameters()):
                assert torch.equal(_local(p), _local(q)), "offloaded AdamW = on-device AdamW"
    finally:
        host_optimizer.adamw = real_adamw
    params = [p for p in model.parameters() if p.requires_grad]
    frozen = [p for p in model.parameters() if not p.requires_grad]
    assert bool(frozen) == (lora is not None)
    assert len(calls) == 3 * len(params), "one host update per trainable parameter and step"
    assert all(p not in optimizer.state for p in frozen)
    named = dict(model.named_parameters())
    assert all(torch.equal(_local(named[n]), before) for n, before in base.items())
    if offload_parameters:  # updated in place, on FSDP's host shards
        assert all(in_model and not untouched for untouched, in_model in calls)
    else:  # on its own host copy; the model's shard changes only at the copy-back
        assert all(untouched and not in_model for untouched, in_model in calls)
    model_ptrs = {_local(p).data_ptr() for p in params}
    for p in params:
        state = optimizer.state[p]
        for key in ("exp_avg", "exp_avg_sq"):
            local = _local(state[key])
            assert local.device == optimizer.host_device
            assert local.data_ptr() not in model_ptrs
            plain_local = _local(plain_optimizer.state[_twin(p, model, plain_model)][key])
            assert torch.equal(local, plain_local), key
        assert hasattr(state["exp_avg"], "to_local") == hasattr(p, "to_local")
    return len(params)


def _twin(param, model, other):
    names = {id(p): n for n, p in model.named_parameters()}
    return dict(other.named_parameters())[names[id(param)]]


@pytest.mark.parametrize("offload_parameters", [False, True])
def test_offloaded_steps_equal_on_device_adamw_bit_for_bit(distributed, offload_parameters):
    counts = distributed.run(run_offload_steps, offload_parameters, world_size=4, timeout=TIMEOUT)
    assert counts[0] > 0 and len(set(counts)) == 1


def test_offloaded_lora_steps_equal_on_device_adamw_bit_for_bit(distributed):
    """LoRA (rank 4 on q_proj and down_proj, dropout 0.1) with both offload levers: the
    host AdamW updates the adapters only (2 per target, 2 targets, 2 layers), bit for bit
    as on-device AdamW, and the frozen base stays as built."""
    lora = {"rank": 4, "targets": ["q_proj", "down_proj"], "dropout": 0.1}
    counts = distributed.run(run_offload_steps, True, lora, world_size=4, timeout=TIMEOUT)
    assert counts == [2 * 2 * 2] * 4


OFFLOADED = base_config(offload_optimizer=True, offload_parameters=True)


@pytest.fixture(scope="module")
def offload_run(distributed, tmp_path_factory):
    """The trainer with both levers on 4 ranks (u2 x r2, FSDP2 with CPUOffloadPolicy,
    the host AdamW), uninterrupted, checkpoints every 2 steps (with the host state)."""
    out = tmp_path_factory.mktemp("offload")
    rows = distributed.run(
        _train_on_ranks, OFFLOADED, 2, 2, str(out), world_size=4, timeout=TIMEOUT
    )
    return rows


def test_offload_trains_like_one_process(offload_run, tmp_path):
    """Against the same job in one process (on-device AdamW, no FSDP): the reference's
    tolerances."""
    rows = offload_run
    assert all(r == rows[0] for r in rows)
    reference = train(
        train_config_from_dict(base_config()), None, output_dir=tmp_path / "one",
        stream=io.StringIO(),
    ).metrics  # fmt: skip
    assert len(rows[0]) == STEPS
    assert_matches_single(rows[0], reference)


def test_a_resumed_offload_run_repeats_the_uninterrupted_one(offload_run, distributed, tmp_path):
    """Stopped after step 3 (its newest checkpoint: step 2), resumed: HostAdamW's state
    comes back from the DCP checkpoint onto the host and steps 3-4 repeat exactly."""
    out = str(tmp_path / "resumed")
    first = distributed.run(
        _train_on_ranks, OFFLOADED, 2, 2, out, False, 3, world_size=4, timeout=TIMEOUT
    )
    assert first[0] == offload_run[0][:3]
    resumed = distributed.run(
        _train_on_ranks, OFFLOADED, 2, 2, out, True, world_size=4, timeout=TIMEOUT
    )
    assert [r[0] for r in resumed[0]] == [3, 4]
    assert resumed[0] == offload_run[0][2:]


def test_offload_parameters_needs_offload_optimizer_and_a_topology(tmp_path):
    from usp.config import ConfigError

    with pytest.raises(ConfigError, match="offload_parameters must be false unless"):
        train_config_from_dict(base_config(offload_parameters=True))
    job = train_config_from_dict(base_config(offload_optimizer=True, offload_parameters=True))
    with pytest.raises(ConfigError, match="a single process without a topology runs without FSDP"):
        train(job, None, output_dir=tmp_path / "one", stream=io.StringIO())


def test_load_state_dict_puts_the_state_on_the_host():
    """torch's Optimizer.load_state_dict casts each state tensor to its parameter's
    device; HostAdamW's keeps it on the host (here a host distinct from the parameter's
    memory: ``meta``), with the step count and the hyperparameters restored."""
    params = [torch.nn.Parameter(torch.randn(4, 3)), torch.nn.Parameter(torch.randn(3))]
    optimizer = HostAdamW([{"params": params[:1]}, {"params": params[1:]}], lr=0.1)
    optimizer.host_device = torch.device("meta")
    saved = {
        "state": {
            i: {
                "step": torch.tensor(7.0),
                "exp_avg": torch.ones_like(p),
                "exp_avg_sq": torch.full_like(p, 2.0),
            }
            for i, p in enumerate(params)
        },  # fmt: skip
        "param_groups": [
            {**{k: v for k, v in g.items() if k != "params"}, "lr": 0.5, "params": [i]}
            for i, g in enumerate(optimizer.param_groups)
        ],
    }
    optimizer.load_state_dict(saved)
    for p in params:
        state = optimizer.state[p]
        assert state["exp_avg"].device.type == "meta" == state["exp_avg_sq"].device.type
        assert state["step"].item() == 7.0 and state["step"].device.type == "cpu"
    assert [g["lr"] for g in optimizer.param_groups] == [0.5, 0.5]
    bad = dict(saved, param_groups=saved["param_groups"][:1])
    with pytest.raises(ValueError, match="group"):
        optimizer.load_state_dict(bad)
