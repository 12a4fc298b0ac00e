"""The end of a finished ``usp train`` run (:func:`finish_run`): the last checkpoint, the
HF export (with the LoRA adapter beside it), ``loss.png``; what was skipped goes into the
result's notes. ``run`` and ``result`` are :mod:`usp.train.trainer`'s ``Run`` and
``TrainResult``."""

from __future__ import annotations

from usp.train import components
from usp.train.checkpoint import export_hf
from usp.train.metrics import plot_loss
from usp.train.setup import has_safetensors


def finish_run(run, result, state, newest, step: int) -> None:
    """The end of a finished run: the last checkpoint, the HF export, loss.png."""
    job, out, source = run.job, run.out, run.setup.source
    checkpointer = run.setup.checkpointer
    if step > state.step:  # (interval checkpoints never fall on the last step)
        result.checkpoint = run.save(step, newest)
    else:  # resumed a finished run: its last checkpoint stands
        result.checkpoint = newest
    if checkpointer.saves and run.rank0:
        result.notes.append(checkpointer.saves_note())
    if job.train.export and not has_safetensors():
        result.notes.append("no HF export: safetensors is not installed (pip install safetensors)")
    elif job.train.export:
        adapter_dir = out / "adapter" if job.train.lora is not None else None
        exported = export_hf(
            run.model,
            source.config,
            out / "hf",
            dtype=components.compute_dtype(job, run.device),  # bf16 on CUDA, as HF ships these
            copy_from=source.directory,
            adapter_dir=adapter_dir,  # [train] lora: the PEFT adapter; hf/ holds the merge
        )
        result.export_dir = None if exported is None else out / "hf"  # as the user named it
        result.adapter_dir = None if exported is None else adapter_dir
    if run.rank0:
        note = plot_loss(out / "metrics.jsonl", out / "loss.png")
        if note is None:
            result.plot = out / "loss.png"
        else:
            result.notes.append(f"no loss.png: {note}")
