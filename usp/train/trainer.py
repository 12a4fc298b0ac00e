"""The training loop: :func:`train` runs a parsed config on a :class:`usp.Plan`.

Callable in-process (tests run it on gloo ranks without torchrun); ``usp train`` wraps
it with process-group set-up and teardown (:mod:`usp.train.cli`).

One optimizer step:

1. the loader hands this dp replica its micro-batches (global, unsharded packed rows)
   and the label count ``N`` of the whole global batch;
2. per micro-batch: ``plan.pack`` validates the document boundaries once (the SP ranks
   agree on them), ``plan.shard`` takes this rank's tokens and labels, and the model
   returns its loss with ``num_items_in_batch=N`` -- so the micro-batch losses of all
   replicas add up to the step's mean loss and the SUM of all ranks' gradients is its
   exact gradient (FSDP reduces by summation, see :mod:`usp.train.parallelize`);
3. the gradient's global norm is taken (and clipped), AdamW steps, the schedule sets the
   next learning rate; the step's loss is summed over the dp replicas for the log.
"""

from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import torch
import torch.distributed as dist

from usp.train import components
from usp.train.checkpoint import Checkpointer, CheckpointError, TrainState, export_hf
from usp.train.config import AUTO, TrainJobConfig
from usp.train.data import DataLoader, StepBatch
from usp.train.metrics import (
    MetricsWriter,
    Progress,
    peak_tflops,
    plot_loss,
    training_flops,
)
from usp.train.parallelize import fully_shard_model, set_gradient_sync
from usp.train.schedule import WarmupCosine

GIB = 2**30


@dataclass
class TrainResult:
    """What a run produced. ``metrics`` holds this run's rows on every rank."""

    output_dir: Path
    metrics: list[dict[str, Any]] = field(default_factory=list)
    start_step: int = 0
    checkpoint: Path | None = None
    export_dir: Path | None = None
    plot: Path | None = None
    notes: list[str] = field(default_factory=list)


def _plan_of(job: TrainJobConfig, plan_or_topology):
    from usp.plan import Plan

    if isinstance(plan_or_topology, Plan):
        return plan_or_topology
    a = job.topology.attention
    if plan_or_topology is None:  # one process: no ring, so no ring implementation
        return Plan(None, layout=a.layout, backend=a.backend)
    return Plan(plan_or_topology, layout=a.layout, ring_impl=a.ring_impl, backend=a.backend)


def _rank0(plan) -> bool:
    return plan.topology is None or plan.topology.rank == 0


def train(
    job: TrainJobConfig,
    plan_or_topology,
    *,
    output_dir: str | Path | None = None,
    resume: bool = False,
    stop_after: int | None = None,
    stream: TextIO | None = None,
) -> TrainResult:
    """Run ``job`` on ``plan_or_topology`` (a :class:`usp.Plan`, a Topology, or None for
    one process). Outputs go to ``output_dir`` (default: the config's). ``resume``
    continues from the newest complete checkpoint there (from step 0 if there is none).
    ``stop_after``: leave after that step without a final checkpoint or export (what a
    preemption looks like; tests use it). Progress goes to ``stream`` (stderr) on rank 0.
    The caller owns the plan's topology (nothing is destroyed here)."""
    plan = _plan_of(job, plan_or_topology)
    topology = plan.topology
    out = Path(output_dir) if output_dir is not None else job.output_dir
    stream = stream or sys.stderr
    rank0 = _rank0(plan)

    # ---------------------------------------------------------------- checks, then build
    # Every check that can fail on the config or the files runs first; the ranks then agree
    # on the outcome, so an error on one rank (a file missing on one node) stops every
    # rank with the same message instead of leaving the others in a collective.
    error, setup = None, None
    try:
        setup = _setup(job, plan, out, resume)
    except user_errors() as err:
        error = err
    _agree_on_setup(plan, error)
    device, source, dataset, checkpointer, newest = setup

    model = components.build_model(job, source, plan)
    if topology is not None:
        dtype = components.compute_dtype(job, device)
        sharded = fully_shard_model(model, topology, compute_dtype=dtype)
        model, loss_scale = sharded.module, sharded.loss_scale
        if source.directory is not None:  # built on the meta device: fill the shards now
            components.load_weights(model, source, device)
    else:
        model, loss_scale = model.to(device), 1.0
    optimizer = components.build_optimizer(job, model)
    schedule = WarmupCosine(
        job.train.lr, job.train.steps, job.train.warmup_steps, job.train.min_lr_ratio
    )
    loader = DataLoader(
        dataset,
        global_batch=job.train.global_batch,
        micro_batch=job.train.micro_batch,
        dp_degree=1 if topology is None else topology.dp_degree,
        dp_rank=0 if topology is None else topology.dp_rank,
    )

    state = TrainState(0, 0)
    if newest is not None:
        state = checkpointer.load(newest, model, optimizer)
        loader.load_state_dict({"position": state.data_position})
    result = TrainResult(out, start_step=state.step)
    if rank0:
        out.mkdir(parents=True, exist_ok=True)
        _print_header(job, plan, source, dataset, model, state, newest, stream)

    # ---------------------------------------------------------------- the loop
    writer = MetricsWriter(out / "metrics.jsonl", resume_after_step=state.step) if rank0 else None
    progress = (
        Progress(job.train.steps, state.step, log_interval=job.train.log_interval, stream=stream)
        if rank0
        else None
    )
    peak = _peak_tflops(job, device)
    world = 1 if topology is None else topology.world_size
    step = state.step
    try:
        while step < job.train.steps and (stop_after is None or step < stop_after):
            started = time.perf_counter()
            lr = schedule.apply(optimizer, step)
            batch = loader.next_step()
            loss, grad_norm = _train_step(model, optimizer, plan, batch, loss_scale, job, device)
            _synchronize(device)
            seconds = time.perf_counter() - started
            step += 1
            row = _row(
                step, loss, grad_norm, lr, batch, seconds, job, source.config, world, device, peak
            )
            result.metrics.append(row)
            if writer is not None:
                writer.write(row)
                progress.update(row)
            interval = job.train.checkpoint_interval
            if interval and step % interval == 0 and step < job.train.steps:
                result.checkpoint = checkpointer.save(
                    model, optimizer, TrainState(step, loader.position)
                )
    finally:
        if progress is not None:
            progress.close()
        if writer is not None:
            writer.close()
    if step < job.train.steps:
        return result  # stopped early (stop_after): no final checkpoint, export or plot

    # ---------------------------------------------------------------- the end
    if step > state.step:  # (interval checkpoints never fall on the last step)
        result.checkpoint = checkpointer.save(model, optimizer, TrainState(step, loader.position))
    else:  # resumed a finished run: its last checkpoint stands
        result.checkpoint = newest
    if job.train.export and not _has_safetensors():
        result.notes.append("no HF export: safetensors is not installed (pip install safetensors)")
    elif job.train.export:
        exported = export_hf(
            model,
            source.config,
            out / "hf",
            dtype=components.compute_dtype(job, device),  # bf16 on CUDA, as HF ships Llama
            copy_from=source.directory,
        )
        result.export_dir = None if exported is None else out / "hf"  # as the user named it
    if rank0:
        note = plot_loss(out / "metrics.jsonl", out / "loss.png")
        if note is None:
            result.plot = out / "loss.png"
        else:
            result.notes.append(f"no loss.png: {note}")
    return result


def _has_safetensors() -> bool:
    try:
        import safetensors.torch  # noqa: F401 - what usp.models reads and writes with
    except ImportError:
        return False
    return True


def _check_numpy_for_checkpoints() -> None:
    """DCP's object collectives (torch 2.13) turn tensors into bytes through numpy; without
    it the first checkpoint would fail after all the training before it."""
    if not dist.is_initialized():
        return
    try:
        torch.zeros(1).numpy()
    except RuntimeError:
        raise CheckpointError(
            "usp train saves checkpoints with torch.distributed.checkpoint, whose collectives "
            "need numpy in a distributed run: pip install numpy"
        ) from None


def _setup(job: TrainJobConfig, plan, out: Path, resume: bool):
    _check_numpy_for_checkpoints()
    device = components.resolve_device(job, plan)
    source = components.model_source(job)
    document_multiple = components.check_lengths(job, plan)
    dp = 1 if plan.topology is None else plan.topology.dp_degree
    job.gradient_accumulation(dp)  # checks the batch arithmetic
    _, dataset = components.build_dataset(job, source, document_multiple)
    checkpointer = Checkpointer(
        out / "checkpoints", model_config=source.config, keep=job.train.keep_checkpoints
    )
    newest = checkpointer.newest()
    if newest is not None and not resume:
        raise CheckpointError(
            f"{out} already holds checkpoints (newest: {newest.name}); pass --resume to continue "
            "that run, or choose another --output directory"
        )
    if newest is not None:
        checkpointer.read_meta(newest)  # another model shape fails here, before any loading
    if source.directory is not None and not _has_safetensors():
        raise job.error(
            f"[model] path {source.directory}: reading an HF checkpoint needs the safetensors "
            "package: pip install safetensors"
        )
    if job.train.dtype not in (AUTO, "float32") and plan.topology is None:
        raise job.error(
            f"[train] dtype = {job.train.dtype!r}: a single process without a topology runs in "
            "float32; launch with torchrun for mixed precision"
        )
    return device, source, dataset, checkpointer, newest


def user_errors() -> tuple[type[BaseException], ...]:
    """Errors that mean "fix the config or the files" (reported without a traceback)."""
    from usp.config import ConfigError
    from usp.models import CheckpointError as ModelCheckpointError
    from usp.models import ModelConfigError
    from usp.process_groups import HeadLayoutError, TopologyError
    from usp.sharding import ShardingError
    from usp.train.data import DataError

    return (
        ConfigError,
        DataError,
        CheckpointError,
        TopologyError,
        HeadLayoutError,
        ShardingError,
        ModelCheckpointError,
        ModelConfigError,
    )


def _agree_on_setup(plan, error: BaseException | None) -> None:
    """Raise the first failing rank's error on every rank (one tiny all-gather)."""
    if plan.topology is None or not dist.is_initialized():
        if error is not None:
            raise error
        return
    from usp.comm.agreement import agree

    agree(dist.group.WORLD, "usp train set-up", [], error, user_errors())


def _train_step(model, optimizer, plan, batch: StepBatch, loss_scale, job, device):
    """Forward/backward over the micro-batches, clip, AdamW; returns the step's global
    mean loss and the gradient's global norm before clipping (Python floats)."""
    total = torch.zeros((), dtype=torch.float64, device=device)  # summed on the device: no sync
    last = len(batch.micro_batches) - 1
    for i, micro in enumerate(batch.micro_batches):
        packed = plan.pack(micro.cu_seqlens, device=device)
        input_ids = plan.shard(micro.input_ids, packed=packed).to(device)  # [1, S] -> [1, S/P]
        labels = plan.shard(micro.labels, packed=packed).to(device)
        set_gradient_sync(model, i == last)
        loss = model(
            input_ids, labels=labels, cu_seqlens=packed, num_items_in_batch=batch.num_labels
        )
        (loss * loss_scale if loss_scale != 1.0 else loss).backward()
        total += loss.detach().to(torch.float64)
    max_norm = job.train.grad_clip if job.train.grad_clip > 0 else math.inf
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    if hasattr(grad_norm, "full_tensor"):  # a DTensor under FSDP
        grad_norm = grad_norm.full_tensor()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    topology = plan.topology
    if topology is not None and topology.dp_degree > 1:
        # every SP rank holds its replica's loss; the replicas' losses add up
        dist.all_reduce(total, group=topology.dp_group)
    return float(total), float(grad_norm)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _peak_tflops(job: TrainJobConfig, device: torch.device) -> float | None:
    if job.train.peak_tflops != AUTO:
        return float(job.train.peak_tflops)
    if device.type != "cuda":
        return None
    return peak_tflops(torch.cuda.get_device_name(device))


def _row(step, loss, grad_norm, lr, batch, seconds, job, config, world, device, peak) -> dict:
    tokens = job.train.global_batch * job.train.seq_len
    row = {
        "step": step,
        "loss": loss,
        "grad_norm": grad_norm,
        "lr": lr,
        "tokens": tokens,
        "label_tokens": batch.num_labels,
        "tokens_per_s": tokens / seconds,
        "tokens_per_s_per_gpu": tokens / seconds / world,
        "step_time_s": seconds,
    }
    if peak is not None:
        flops = training_flops(config, batch.document_lengths)
        row["mfu"] = flops / seconds / world / (peak * 1e12)
    if device.type == "cuda":
        row["peak_memory_gib"] = torch.cuda.max_memory_allocated(device) / GIB
    else:  # the process's peak resident memory: its tensors plus Python and the libraries
        import resource  # (not a tensor count like CUDA's: above `usp plan`'s figure)

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB (bytes on macOS)
        row["peak_memory_gib"] = peak * (1 if sys.platform == "darwin" else 1024) / GIB
    return row


def _print_header(job, plan, source, dataset, model, state, newest, stream) -> None:
    params = sum(p.numel() for p in model.parameters())
    t = job.train
    dp = 1 if plan.topology is None else plan.topology.dp_degree
    accumulation = job.gradient_accumulation(dp)
    what = source.directory or f'preset "{job.model.preset}"'
    lines = [
        f"usp train: {job.source or 'config'}",
        f"  plan:  {plan.describe()}",
        f"  model: {what}, {params / 1e6:.2f}M parameters, {source.config.num_hidden_layers} layers",
        f"  data:  {len(dataset.documents)} documents ({job.data.source}), packed into "
        f"sequences of {t.seq_len} tokens",
        f"  batch: {t.global_batch} sequences/step = dp {dp} x micro_batch {t.micro_batch} x "
        f"accumulation {accumulation}",
    ]
    if newest is not None:
        lines.append(f"  resuming from {newest} (step {state.step})")
    print("\n".join(lines), file=stream, flush=True)
