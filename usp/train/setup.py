"""A run's set-up before the model exists (:func:`setup_run`), the errors that mean "fix
the config or the files" (:func:`user_errors`) and the ranks' agreement on them
(:func:`agree_on_setup`): a bad input ends with the same message on every rank."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from usp.comm.agreement import agree
from usp.config import ConfigError
from usp.models import CheckpointError as ModelCheckpointError
from usp.models import ModelConfigError
from usp.process_groups import HeadLayoutError, TopologyError
from usp.sp.sharding import ShardingError
from usp.train import components, report_to
from usp.train.checkpoint import Checkpointer, CheckpointError
from usp.train.checkpoint_shape import CheckpointShapeError
from usp.train.config import AUTO, TrainJobConfig
from usp.train.data import DataError
from usp.train.data.build import DataInputs
from usp.train.evaluate import prepare_held_out
from usp.train.guard import TrainingDivergedError
from usp.train.lock import OutputLockedError
from usp.train.resume import check_resume, run_record


def has_safetensors() -> bool:
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


@dataclass(frozen=True)
class RunSetup:
    """What :func:`setup_run` checked and prepared, before the model exists."""

    device: torch.device
    source: components.ModelSource  # the model's config (and checkpoint directory)
    data: DataInputs  # the training data, checked; tokenised when the run assembles
    eval_inputs: DataInputs | None  # [eval]'s held-out documents (None without [eval])
    checkpointer: Checkpointer
    candidates: list[tuple[int, Path]]  # complete checkpoints (step, path), oldest first
    resume_note: str | None  # what a resume changes against the checkpoint (rank 0)


def setup_run(
    job: TrainJobConfig, plan, out: Path, resume: bool, resume_changed: bool, source=None
) -> RunSetup:
    """Everything a run checks and prepares before the model is built, on every rank:
    the device, the model's config, the data (tokenised later), the held-out set, the
    run record and the checkpoints a resume may load (the newest readable one checked
    against this config). A user error here is agreed by :func:`agree_on_setup`."""
    _check_numpy_for_checkpoints()
    device = components.resolve_device(job, plan)
    source = components.model_source(job) if source is None else source
    components.check_compile(job, source, plan)  # a family that cannot compile yet
    components.check_kernels(job, source, plan, device)  # a forced kernel not here
    document_multiple = components.check_lengths(job, plan)
    job.gradient_accumulation(plan.topology.dp_degree)  # checks the batch arithmetic
    dataset = components.prepare_data(job, source, document_multiple)  # tokenised in _run
    eval_inputs = prepare_held_out(job, dataset)  # [eval]: None without it
    rank0 = plan.topology.rank == 0
    if rank0:  # the libraries [train] report_to needs (rank 0 writes; the ranks agree)
        report_to.check_available(job.train.report_to)
    record = run_record(job, source.config, document_multiple, dataset.files) if rank0 else None
    checkpointer = Checkpointer(
        out / "checkpoints",
        model_config=source.config,
        keep=job.train.keep_checkpoints,
        run=record,
    )
    candidates = checkpointer.complete()  # the ranks agree on them once set-up agreed
    if candidates and not resume:
        raise CheckpointError(
            f"{out} already holds checkpoints (newest: {candidates[-1][1].name}); pass --resume "
            "to continue that run, or choose another --output directory"
        )
    note = None
    for _, path in reversed(candidates):  # the newest readable one decides (before loading)
        try:
            meta = checkpointer.read_meta(path)  # another model shape fails here
        except CheckpointShapeError:
            raise
        except CheckpointError:
            continue  # damaged: the load falls back past it and says so
        if rank0:
            note = check_resume(meta, record, path=path, accept_changes=resume_changed)
        break
    if source.directory is not None and not has_safetensors():
        raise job.error(
            f"[model] path {source.directory}: reading an HF checkpoint needs the safetensors "
            "package: pip install safetensors"
        )
    if job.train.offload_parameters and plan.topology.single_process:
        raise job.error(
            "[train] offload_parameters = true offloads FSDP2's parameter shards, and a single "
            "process without a topology runs without FSDP; launch with torchrun (one GPU: "
            "usp train --nproc-per-node 1 CONFIG), or set offload_parameters = false"
        )
    if job.train.dtype not in (AUTO, "float32") and plan.topology.single_process:
        raise job.error(
            f"[train] dtype = {job.train.dtype!r}: a single process without a topology runs in "
            "float32; launch with torchrun for mixed precision"
        )
    return RunSetup(device, source, dataset, eval_inputs, checkpointer, candidates, note)


def user_errors() -> tuple[type[BaseException], ...]:
    """Errors that mean "fix the config or the files" (reported without a traceback)."""
    return (
        ConfigError,
        DataError,
        CheckpointError,
        TopologyError,
        HeadLayoutError,
        ShardingError,
        ModelCheckpointError,
        ModelConfigError,
        OutputLockedError,
        TrainingDivergedError,
        CheckpointShapeError,
    )


def agree_on_setup(plan, error: BaseException | None) -> None:
    """Raise the first failing rank's error on every rank (one tiny all-gather)."""
    if plan.topology.single_process or not dist.is_initialized():
        if error is not None:
            raise error
        return
    agree(dist.group.WORLD, "usp train set-up", [], error, user_errors())
