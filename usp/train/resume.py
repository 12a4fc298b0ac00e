"""Resuming: which checkpoint every rank loads, and whether the run may continue it.

- :func:`run_record`: what a checkpoint records about the run that wrote it (rank 0,
  into ``usp_meta.json``): the ``[train]`` section, the ``[data]`` section with the data
  files' SHA-256, the resolved document multiple, and the model's RoPE settings.
- :func:`compare_runs`: on resume, the differences. Those that change which data or
  model a step sees (seed, data files or their content, data options, seq_len,
  global_batch, RoPE) are refused unless ``--resume-changed``; the others (lr, schedule,
  steps, intervals, ...) are reported in one line.
- :func:`agree_on_checkpoints`: every rank must see the same complete checkpoints (a
  rank that sees others, e.g. node-local storage, is an error on every rank).
- :func:`load_with_fallback`: load the newest complete checkpoint; if that fails (a file
  that fails its checksum, DCP cannot read it, ...), say so on rank 0 in one line naming
  the cause and load the previous one, and so on; none loads: a CheckpointError.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from typing import Any, TextIO

import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from usp.comm.agreement import Field, agree, stable_hash
from usp.errors import CheckpointError, RankDisagreementError
from usp.models.rope_config import POSITION_FIELDS
from usp.train.checkpoint_integrity import CheckpointDamagedError
from usp.train.checkpoint_shape import CheckpointShapeError
from usp.train.checksums import file_sha256
from usp.train.schedule import WarmupCosine

# [train] keys whose change alters which data a step sees (lora: which model it trains)
REFUSED_TRAIN_KEYS = ("seed", "seq_len", "global_batch", "lora")
# [train] keys the learning-rate schedule is computed from (usp.train.schedule)
SCHEDULE_KEYS = ("lr", "steps", "warmup_steps", "min_lr_ratio")


def run_record(job, model_config, document_multiple: int, files=()) -> dict[str, Any]:
    """The run as a checkpoint records it (JSON-able; reads every data file once).
    ``files``: the data files the run reads (``[data] files`` with globs expanded)."""
    data = dataclasses.asdict(job.data)
    data["files"] = [str(Path(f).resolve()) for f in files]
    data["file_sha256"] = [file_sha256(Path(f)) for f in data["files"]]
    data["document_multiple_used"] = document_multiple
    # as JSON has it (tuples are lists), so that a saved record compares equal to a new one
    train = json.loads(json.dumps(dataclasses.asdict(job.train)))
    rope = {name: getattr(model_config, name, None) for name in POSITION_FIELDS}
    return {"train": train, "data": data, "rope": rope}


def compare_runs(saved: dict[str, Any], now: dict[str, Any]) -> tuple[list[str], list[str]]:
    """``(refused, allowed)``: descriptions of the differences between two run records."""
    refused, allowed = [], []
    for section in ("data", "rope"):
        old, new = saved.get(section, {}), now.get(section, {})
        for key in sorted(set(old) | set(new)):
            if old.get(key) != new.get(key):
                refused.append(f"[{section}] {key}: {_show(old.get(key))} -> {_show(new.get(key))}")
    old, new = saved.get("train", {}), now.get("train", {})
    for key in sorted(set(old) | set(new)):
        if old.get(key) != new.get(key):
            text = f"{key} {_show(old.get(key))} -> {_show(new.get(key))}"
            (refused if key in REFUSED_TRAIN_KEYS else allowed).append(text)
    return refused, allowed


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def check_resume(saved_meta: dict, record: dict, *, path: Path, accept_changes: bool) -> str | None:
    """Refuse a resume whose run changed what a step sees (unless ``accept_changes``);
    returns the note to print about what else changed (None: nothing)."""
    saved = saved_meta.get("run")
    if saved is None:
        return f"{path.name} records no run config (an older usp): changes are not checked"
    refused, allowed = compare_runs(saved, record)
    if refused and not accept_changes:
        raise CheckpointError(
            f"--resume from {path}: this run differs from the one that wrote the checkpoint "
            f"in what a step sees: {'; '.join(refused)}. Restore those settings, write to "
            "another --output directory, or pass --resume-changed to continue knowingly"
        )
    notes = []
    if refused:
        notes.append("accepted with --resume-changed: " + "; ".join(refused))
    if allowed:
        notes.append("changed since the checkpoint: " + ", ".join(allowed))
    schedule = schedule_note(
        saved.get("train", {}), record.get("train", {}), saved_meta.get("step")
    )
    if schedule:
        notes.append(schedule)
    return "; ".join(notes) or None


def schedule_note(saved: dict, now: dict, step) -> str | None:
    """What a change of ``[train]`` lr, steps, warmup_steps or min_lr_ratio does to the
    learning rate of the first resumed step (the schedule is a function of the step and
    these keys, so it is re-planned over the new run): None when none changed."""
    if not isinstance(step, int) or all(saved.get(k) == now.get(k) for k in SCHEDULE_KEYS):
        return None
    try:
        old, new = (
            WarmupCosine(t["lr"], t["steps"], t["warmup_steps"], t["min_lr_ratio"])
            for t in (saved, now)
        )
    except (KeyError, TypeError, ValueError):
        return None
    before = (
        f"the checkpoint's run would have used {old.lr_at(step):.3g}"
        if step < old.total_steps
        else f"the checkpoint's run ended at step {old.total_steps} with {old.lr_at(step - 1):.3g}"
    )
    return (
        f"the learning-rate schedule is re-planned over {new.total_steps} steps: step "
        f"{step + 1} runs at lr {new.lr_at(step):.3g} ({before})"
    )


# ----------------------------------------------------------------------------- ranks
def agree_on_checkpoints(steps: list[int]) -> None:
    """Every rank must see the same complete checkpoints (a collective over the default
    group); otherwise the same :class:`CheckpointError` on every rank."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    fields = [
        Field("the newest complete checkpoint", steps[-1] if steps else -1, _show_step),
        Field("the complete checkpoints", stable_hash(steps)),
    ]
    try:
        agree(dist.group.WORLD, "resume", fields)
    except RankDisagreementError as err:
        raise CheckpointError(
            f"{err}. The ranks see different checkpoints in the output directory: "
            "checkpoints need storage that all nodes share (put --output on a shared file "
            "system)"
        ) from None


def _show_step(step: int) -> str:
    return "none" if step < 0 else f"step_{step:06d}"


def _first_failure(err: BaseException) -> str:
    """One line about a failed load (DCP's exception holds every rank's traceback)."""
    failures = getattr(err, "failures", None)
    if isinstance(failures, dict) and failures:
        err = next(iter(failures.values()))
        if isinstance(err, tuple):  # (exception, traceback) per rank
            err = err[0]
    lines = [line for line in str(err).strip().splitlines() if line.strip()]
    text = lines[-1] if lines else ""
    return f"{type(err).__name__}: {text[:300]}"


def load_with_fallback(checkpointer, candidates, model, optimizer, *, rank0: bool, stream: TextIO):
    """Load the newest of ``candidates`` (``(step, path)``, oldest first) that loads on
    every rank; returns ``(path, TrainState)``. A failed load is reported once (rank 0)
    and the previous checkpoint tried."""
    stream = stream or sys.stderr
    failures = []
    for _, path in reversed(candidates):
        error, agreed = None, False
        logged = checkpointer.dcp_log.records
        try:
            state = checkpointer.load(path, model, optimizer)
        except CheckpointShapeError:
            raise  # another model shape (read before any collective): no fallback can help
        except CheckpointDamagedError as err:  # a file failed its checksum: said on every rank
            error, agreed = err, True
        except CheckpointError as err:  # usp's own message (e.g. an unreadable usp_meta.json)
            error = err
        except (Exception, CheckpointException) as err:  # noqa: BLE001 - any damage
            error = CheckpointError(_first_failure(err))
        if not agreed and dist.is_initialized() and dist.get_world_size() > 1:
            try:
                agree(dist.group.WORLD, f"loading {path.name}", [], error, (CheckpointError,))
            except CheckpointError as err:
                error = err
        if error is None:
            if failures and rank0:
                print(f"usp train: resuming from {path.name} instead", file=stream, flush=True)
            return path, state
        failures.append(path.name)
        if rank0:
            details = (
                f" (DCP's messages: {checkpointer.dcp_log.path})"
                if checkpointer.dcp_log.records > logged
                else ""
            )
            print(
                f"usp train: checkpoint {path} cannot be loaded ({error}){details}; trying the "
                "previous complete checkpoint",
                file=stream,
                flush=True,
            )
    raise CheckpointError(
        f"none of the complete checkpoints loads ({', '.join(failures)}); see the messages "
        "above. Move the damaged ones away, or start again in another --output directory"
    )
