"""The training loop: :func:`train` runs a parsed config on a :class:`usp.Plan`.

Callable in-process (tests run it on gloo ranks without torchrun); ``usp train`` wraps
it with process-group set-up and teardown (:mod:`usp.train.cli`).

One optimizer step (:class:`usp.train.step.TrainStep`, which ``usp plan`` also runs):

1. the loader hands this dp replica its micro-batches (global, unsharded packed rows)
   and the label count ``N`` of the whole global batch;
2. each micro-batch is sharded for this rank (:func:`usp.models.shard_batch`: ``plan.pack``
   validates the document boundaries once, the SP ranks agree on them) and the model
   returns its loss with ``num_items_in_batch=N`` -- so the micro-batch losses of all
   replicas add up to the step's mean loss and the SUM of all ranks' gradients is its
   exact gradient (FSDP reduces by summation, see :mod:`usp.train.parallelize`);
3. the gradient's global norm is taken (and clipped), the ranks agree that loss and
   norm are finite, AdamW steps, the schedule sets the next learning rate; the step's
   loss is summed over the dp replicas for the log.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import torch
import torch.distributed as dist

from usp.models import model_counts, shard_batch
from usp.models.lora import set_stream_position
from usp.sp.plan import Plan
from usp.train import components, report_to, run_config
from usp.train.checkpoint import (
    TrainState,
)
from usp.train.config import TrainJobConfig
from usp.train.data import DataLoader, PackedDataset, StepBatch
from usp.train.evaluate import HeldOut, evaluate, load_held_out
from usp.train.finish import finish_run
from usp.train.guard import (
    StopSignal,
    TrainingDivergedError,
    agree_on_step,
    agree_on_stop,
    collective_phase,
    diverged_message,
    newest_note,
    parameters_finite,
)
from usp.train.lock import OutputLock, check_output_dir
from usp.train.metrics import (
    MetricsWriter,
    Progress,
    StepTiming,
    device_peak_tflops,
    print_header,
    step_row,
)
from usp.train.parallelize import fully_shard_model
from usp.train.resume import agree_on_checkpoints, load_with_fallback
from usp.train.schedule import WarmupCosine
from usp.train.setup import (
    RunSetup,
    agree_on_setup,
    setup_run,
    user_errors,
)
from usp.train.step import TrainStep


@dataclass
class TrainResult:
    """What a run produced. ``metrics`` holds this run's rows on every rank."""

    output_dir: Path
    metrics: list[dict[str, Any]] = field(default_factory=list)
    evaluations: list[dict[str, Any]] = field(default_factory=list)  # this run's [eval] rows
    start_step: int = 0
    checkpoint: Path | None = None
    export_dir: Path | None = None
    adapter_dir: Path | None = None  # [train] lora: the PEFT adapter (export_dir: merged)
    plot: Path | None = None
    notes: list[str] = field(default_factory=list)
    stopped_by: str | None = None  # the signal that stopped the run (a checkpoint was saved)
    stopped_at: int | None = None  # ... at this step


def _plan_of(job: TrainJobConfig, plan_or_topology):
    if isinstance(plan_or_topology, Plan):
        return plan_or_topology
    return components.build_plan(job, plan_or_topology)  # a Topology, or None: one process


def _rank0(plan) -> bool:
    return plan.topology.rank == 0


def train(
    job: TrainJobConfig,
    plan_or_topology,
    *,
    output_dir: str | Path | None = None,
    resume: bool = False,
    resume_changed: bool = False,
    stop_after: int | None = None,
    stream: TextIO | None = None,
    source: components.ModelSource | None = None,
) -> TrainResult:
    """Run ``job`` on ``plan_or_topology`` (a :class:`usp.Plan`, a Topology, or None for
    one process). Outputs go to ``output_dir`` (default: the config's). ``resume``
    continues from the newest complete checkpoint there that loads (from step 0 if there
    is none); ``resume_changed`` accepts a run that differs from the checkpoint's in what a
    step sees (:mod:`usp.train.resume`). ``stop_after``: leave after that step without a
    final checkpoint or export (tests use it). Progress goes to ``stream`` (stderr) on
    rank 0. The caller owns the plan's topology (nothing is destroyed here).

    Faults (:mod:`usp.train.guard`): another job holding ``output_dir`` is an
    ``OutputLockedError``; a non-finite loss or gradient norm skips the step's update and,
    beyond ``[train] max_skipped_steps``, raises ``TrainingDivergedError`` (nothing
    non-finite is saved); a failed collective raises ``CollectiveFailedError`` naming the
    step; a SIGTERM/SIGINT (handlers installed while this runs in the main thread) stops
    the run after the step in flight with a checkpoint (``result.stopped_by``).
    ``source``: the job's :func:`usp.train.components.model_source` if the caller read
    it already (``usp train`` reads config.json once per rank)."""
    plan = _plan_of(job, plan_or_topology)
    out = Path(output_dir) if output_dir is not None else job.output_dir
    stream = stream or sys.stderr
    lock = None
    try:
        # Every check that can fail on the config or the files runs first; the ranks then
        # agree on the outcome, so an error on one rank (a file missing on one node) stops
        # every rank with the same message instead of leaving the others in a collective.
        error, setup = None, None
        try:
            check_output_dir(out, export=job.train.export)
            if _rank0(plan):  # one job per output directory, before anything is written
                lock = OutputLock.acquire(out)
            setup = setup_run(job, plan, out, resume, resume_changed, source)
        except user_errors() as err:
            error = err
        agree_on_setup(plan, error)
        with StopSignal() as stop:
            return _run(job, plan, out, setup, stream, stop, stop_after, lock)
    finally:
        if lock is not None:
            lock.release()


def _run(job, plan, out, setup: RunSetup, stream, stop, stop_after, lock) -> TrainResult:
    run = _assemble(job, plan, out, setup, stream)
    state, newest = _resume(run)
    result = TrainResult(out, start_step=state.step)
    if run.rank0:
        _print_start(run, state, newest, notes=[lock.note if lock else None, setup.resume_note])
    step, skipped = _train_steps(run, result, state, newest, stop, stop_after)
    if result.stopped_by is not None:
        return result  # a signal stopped the run, with a checkpoint
    if skipped:
        result.notes.append(f"skipped steps (non-finite, not applied): {skipped}")
    if step < job.train.steps:
        return result  # stopped early (stop_after): no final checkpoint, export or plot
    finish_run(run, result, state, newest, step)
    return result


@dataclass
class Run:
    """A run once assembled (:func:`_assemble`): what set-up prepared and the parts
    built from it, which the loop and the end of the run read."""

    job: TrainJobConfig
    plan: Plan
    out: Path
    setup: RunSetup
    stream: TextIO
    dataset: PackedDataset  # the training data, tokenised
    held_out: HeldOut | None  # [eval]'s documents (None without [eval])
    model: torch.nn.Module  # sharded (FSDP2) in a distributed run
    optimizer: torch.optim.Optimizer
    train_step: TrainStep
    loader: DataLoader

    @property
    def device(self) -> torch.device:
        return self.setup.device

    @property
    def rank0(self) -> bool:
        return _rank0(self.plan)

    @property
    def distributed(self) -> bool:
        return not self.plan.topology.single_process and dist.is_initialized()

    def save(self, at: int, newest: Path | None) -> Path:
        """The checkpoint of step ``at`` (refused when the weights are not finite)."""
        job, checkpointer = self.job, self.setup.checkpointer
        with collective_phase(
            f"saving the checkpoint of step {at}", job.train.collective_timeout_s
        ):
            if not parameters_finite(self.model, self.device, self.distributed):
                raise TrainingDivergedError(
                    f"step {at}: the weights are not finite after the optimizer step (an "
                    f"overflow: lr {job.train.lr:g} is far too high?); nothing was saved. "
                    f"{newest_note(checkpointer, newest)}"
                )
            state = TrainState(at, self.loader.position)
            return checkpointer.save(self.model, self.optimizer, state)


def _assemble(job, plan, out, setup: RunSetup, stream) -> Run:
    """The data tokenised, the model built (sharded and filled in a distributed run),
    the optimizer and the loader."""
    topology, device, source = plan.topology, setup.device, setup.source
    # [eval] (None without it): its own documents, never trained (usp.train.evaluate)
    held_out = load_held_out(
        job, setup.eval_inputs, setup.data, topology=topology, cache_root=out / "cache"
    )
    dataset = components.load_dataset(job, setup.data, topology=topology, cache_root=out / "cache")

    levers = job.train.levers  # passed to each part that needs them
    model = components.build_model(job, source, plan, levers)
    if not topology.single_process:
        dtype = components.compute_dtype(job, device)
        sharded = fully_shard_model(model, topology, levers=levers, compute_dtype=dtype)
        model, loss_scale = sharded.module, sharded.loss_scale
        if source.directory is not None:  # built on the meta device: fill the shards now
            components.load_weights(model, source, device, levers, seed=job.train.seed)
    else:
        model, loss_scale = model.to(device), 1.0
    optimizer = components.build_optimizer(job, model, levers)
    train_step = TrainStep(model, optimizer, loss_scale=loss_scale, grad_clip=job.train.grad_clip)
    loader = DataLoader(
        dataset,
        global_batch=job.train.global_batch,
        micro_batch=job.train.micro_batch,
        dp_degree=topology.dp_degree,
        dp_rank=topology.dp_rank,
    )
    return Run(
        job, plan, out, setup, stream, dataset, held_out, model, optimizer, train_step, loader
    )


def _resume(run: Run) -> tuple[TrainState, Path | None]:
    """The newest checkpoint that loads, if any (model, optimizer and data position
    restored): ``(its state, its path)``; ``(step 0, None)`` for a new run."""
    candidates = run.setup.candidates
    agree_on_checkpoints([step for step, _ in candidates])  # e.g. node-local storage
    if not candidates:
        return TrainState(0, 0), None
    with collective_phase("resuming", run.job.train.collective_timeout_s):
        newest, state = load_with_fallback(
            run.setup.checkpointer, candidates, run.model, run.optimizer,
            rank0=run.rank0, stream=run.stream,
        )  # fmt: skip
    run.loader.load_state_dict({"position": state.data_position})
    return state, newest


def _print_start(run: Run, state: TrainState, newest: Path | None, notes) -> None:
    """Rank 0's header: the plan, model, levers, data and batch; the effective config."""
    job, stream = run.job, run.stream
    print_header(job, run.plan, run.setup.source, run.dataset, run.model, state, newest, stream)
    for line in run.held_out.summary(job.eval.every) if run.held_out is not None else []:
        print(f"  eval:  {line}", file=stream, flush=True)
    config_path = run_config.save_effective_config(job, run.out)
    print("\n".join(run_config.startup_lines(job, config_path)), file=stream, flush=True)
    for note in notes:
        if note:
            print(f"  note: {note}", file=stream, flush=True)


def _train_steps(run: Run, result: TrainResult, state, newest, stop, stop_after):
    """The optimizer steps from ``state.step`` on, each logged (metrics.jsonl, progress)
    and evaluated/checkpointed when due. Returns ``(the last step, the skipped steps)``;
    a stop signal saves a checkpoint and sets ``result.stopped_by``."""
    job, plan, out, stream, device = run.job, run.plan, run.out, run.stream, run.device
    train_step, loader, held_out, model = run.train_step, run.loader, run.held_out, run.model
    distributed, rank0 = run.distributed, run.rank0
    checkpointer = run.setup.checkpointer
    schedule = WarmupCosine(
        job.train.lr, job.train.steps, job.train.warmup_steps, job.train.min_lr_ratio
    )
    writer = MetricsWriter(out / "metrics.jsonl", resume_after_step=state.step) if rank0 else None
    writer = report_to.reporting(writer, job, out, start_step=state.step, distributed=distributed)
    for note in writer.notes if writer else []:
        print(f"usp train: warning: {note}", file=stream, flush=True)
    progress = (
        Progress(job.train.steps, state.step, log_interval=job.train.log_interval, stream=stream)
        if rank0
        else None
    )
    peak = device_peak_tflops(job, device)
    counts = model_counts(run.setup.source.config)  # parameter and FLOP counts, for MFU
    world = plan.topology.world_size
    timeout = job.train.collective_timeout_s
    step, skipped = state.step, []
    try:
        while step < job.train.steps and (stop_after is None or step < stop_after):
            started = time.perf_counter()
            lr = schedule.apply(run.optimizer, step)
            batch = loader.next_step()
            with collective_phase(f"step {step + 1}", timeout):
                loss, grad_norm, applied, stop_now, aux_loss = _train_step(
                    train_step, plan, batch, job, device, stop, distributed
                )
            _synchronize(device)
            seconds = time.perf_counter() - started
            step += 1
            row = step_row(
                StepTiming(step, loss, grad_norm, lr, seconds, aux_loss), batch, job, counts, world,
                device,
                peak,
            )  # fmt: skip
            if not applied:
                row["skipped"] = True
                skipped.append(step)
            result.metrics.append(row)
            if writer is not None:
                writer.write(row)
                progress.update(row)
            if held_out is not None and job.eval.due(step, job.train.steps):
                with collective_phase(f"the evaluation after step {step}", timeout):
                    evaluated = evaluate(model, plan, held_out, device).row(step)
                result.evaluations.append(evaluated)
                if writer is not None:
                    writer.write(evaluated)
                    progress.evaluation(evaluated)
            if len(skipped) > job.train.max_skipped_steps:
                raise TrainingDivergedError(
                    diverged_message(job, step, loss, grad_norm, skipped, checkpointer, newest)
                )
            interval = job.train.checkpoint_interval
            if stop_now or (interval and step % interval == 0 and step < job.train.steps):
                result.checkpoint = run.save(step, newest)
                # a signal during the save stops the run here, with this checkpoint, not
                # after another step that the launcher's grace period may not cover
                with collective_phase(f"after saving the checkpoint of step {step}", timeout):
                    stop_now = stop_now or agree_on_stop(stop.name, device, distributed)
                if stop_now:
                    result.stopped_by = stop.name or "a signal on another rank"
                    result.stopped_at = step
                    return step, skipped
    finally:
        if progress is not None:
            progress.close()
        if writer is not None:
            writer.close()
    return step, skipped


def _train_step(train_step: TrainStep, plan, batch: StepBatch, job, device, stop, distributed):
    """One optimizer step (:class:`usp.train.step.TrainStep`) on this dp replica's
    micro-batches. Returns the step's global mean loss and the gradient's global norm
    before clipping (Python floats), whether the update was applied (not when the loss
    or the norm is non-finite on any rank) and whether any rank got a stop signal (one
    agreement all-reduce, before the update)."""
    batches = [
        shard_batch(
            plan,
            micro.input_ids,
            labels=micro.labels,
            cu_seqlens=micro.cu_seqlens,
            shift=False,
            device=device,
        )  # fmt: skip  ([1, S] -> [1, S/P]; plan.pack: the SP ranks agree on the documents)
        for micro in batch.micro_batches
    ]
    # LoRA dropout keys its masks by the tokens' place in the data: this replica's first
    # token (micro-batches follow on, each a row of micro_batch sequences)
    dp_rank = plan.topology.dp_rank
    share = len(batch.micro_batches) * job.train.micro_batch  # this replica's sequences
    set_stream_position(
        train_step.model, (batch.first_sequence + dp_rank * share) * job.train.seq_len
    )
    agreed = {}

    def decide(outcome) -> bool:
        # [loss] or [loss, the router aux losses' sum] (mixture-of-experts models)
        totals = torch.stack([outcome.loss] + [a for a in [outcome.aux_loss] if a is not None])
        topology = plan.topology
        dp = topology.dp_degree
        if dp > 1:
            # every SP rank holds its replica's loss; the replicas' losses add up
            dist.all_reduce(totals, group=topology.dp_group)
        loss, norm, non_finite, stop_now = agree_on_step(
            float(totals[0]), float(outcome.grad_norm), stop.name, device, distributed
        )
        # the aux column: the mean over the step's forwards (micro-batches x replicas)
        aux = float(totals[1]) / (len(batches) * dp) if len(totals) > 1 else None
        agreed.update(loss=loss, norm=norm, stop=stop_now, aux=aux)
        if not non_finite and norm == 0.0 and batch.num_labels > 0:
            # the global norm (the same on every rank): no learning signal from any of the
            # step's label tokens. A model that diverged into saturation (lr far too high)
            # stays there; training on would only report a flat loss and exit 0
            train_step.optimizer.zero_grad(set_to_none=True)
            raise TrainingDivergedError(
                f"the gradient norm is exactly 0 with {batch.num_labels} label tokens in the "
                f"step: the model no longer learns (saturated or dead; lr {job.train.lr:g} too "
                "high?); the update was not applied"
            )
        return not non_finite

    try:
        outcome = train_step.run(batches, batch.num_labels, decide=decide, device=device)
    except RuntimeError as err:  # AdamW's step size itself overflows (lr ~1e38)
        # only torch's own conversion error: a subclass (e.g. Inductor's C++ compile error,
        # whose compiler output may mention an overflow) is not a diverged run
        if type(err) is not RuntimeError or "overflow" not in str(err):
            raise
        lr = train_step.optimizer.param_groups[0]["lr"]
        raise TrainingDivergedError(
            f"the optimizer step overflowed ({err}) at lr {lr:g}:"
            f" [train] lr (now {job.train.lr:g}) is far too high; nothing was saved"
        ) from None
    return agreed["loss"], agreed["norm"], outcome.applied, agreed["stop"], agreed["aux"]


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
