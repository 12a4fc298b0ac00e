"""A step's ``metrics.jsonl`` row: loss, gradient norm, learning rate, throughput, MFU
(:mod:`usp.train.metrics.mfu`) and peak memory."""

from __future__ import annotations

import resource
import sys
from dataclasses import dataclass

import torch

GIB = 2**30


@dataclass(frozen=True)
class StepTiming:
    """One finished optimizer step as the log shows it."""

    step: int
    loss: float
    grad_norm: float
    lr: float
    seconds: float
    #: the router's load-balancing loss (before its coefficient), the mean over the
    #: step's forwards; None: the model adds none
    aux_loss: float | None = None


def step_row(timing: StepTiming, batch, job, counts, world, device, peak) -> dict:
    """The ``metrics.jsonl`` row of a step. ``counts``: the model's
    :class:`usp.models.ModelCounts` (for MFU); ``peak``: the device's TFLOP/s or None."""
    tokens = job.train.global_batch * job.train.seq_len
    seconds = timing.seconds
    row = {
        "step": timing.step,
        "loss": timing.loss,
        "grad_norm": timing.grad_norm,
        "lr": timing.lr,
        "tokens": tokens,
        "label_tokens": batch.num_labels,
        "tokens_per_s": tokens / seconds,
        "tokens_per_s_per_gpu": tokens / seconds / world,
        "step_time_s": seconds,
    }
    if timing.aux_loss is not None:  # (loss includes router_aux_loss_coef x each forward's)
        row["aux_loss"] = timing.aux_loss
    if peak is not None:
        flops = counts.training_flops(batch.document_lengths)
        row["mfu"] = flops / seconds / world / (peak * 1e12)
    if device.type == "cuda":
        row["peak_memory_gib"] = torch.cuda.max_memory_allocated(device) / GIB
    else:  # the process's peak resident memory: its tensors plus Python and the libraries
        # (not a tensor count like CUDA's: above `usp plan`'s figure)
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB (bytes on macOS)
        row["peak_memory_gib"] = peak * (1 if sys.platform == "darwin" else 1024) / GIB
    return row
