"""One optimizer step: what ``usp train`` runs for every step and ``usp plan`` runs under
fake tensors to measure it (there is no other copy of this arithmetic).

1. Every micro-batch (a :class:`usp.models.ShardedBatch`: this rank's shard of one
   global packed row, from :func:`usp.models.shard_batch`) runs forward with
   ``num_items_in_batch`` = the label count of the whole optimizer step (all dp
   replicas), so the micro-batch losses of all replicas add up to the step's mean loss,
   and backward (the loss times ``loss_scale``); FSDP's gradient reduction runs on the
   last micro-batch only (:func:`usp.train.parallelize.set_gradient_sync`). A
   mixture-of-experts model's router aux losses (part of each loss) are summed apart too.
2. The gradient's global norm is taken and clipped to ``grad_clip`` (0: not clipped).
3. ``decide(outcome)`` says whether the optimizer steps (the trainer: every rank agrees
   the loss and the norm are finite; the planner: always), then the gradients are
   zeroed.

:meth:`TrainStep.phases` yields the name of each phase as it ends (``forward i``,
``backward i``, ``clip``, ``optimizer``): the planner snapshots memory there.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from usp.models import ShardedBatch
from usp.train.parallelize import set_gradient_sync


@dataclass
class StepOutcome:
    """What a step leaves, filled in as its phases run."""

    loss: torch.Tensor  # float64 scalar: this rank's sum of the micro-batch losses
    #: float64 scalar: the sum of the micro-batches' router aux losses (before the
    #: coefficient; the same on the SP ranks of a replica); None: the model adds none
    aux_loss: torch.Tensor | None = None
    grad_norm: torch.Tensor | None = None  # the global norm before clipping
    applied: bool = False  # whether the optimizer stepped


def clip_gradients(model: nn.Module, max_norm: float) -> torch.Tensor:
    """The gradient's global norm (before clipping) after clipping it to ``max_norm``
    (``inf``: no clipping); FSDP's DTensor norm as a plain tensor."""
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm


class TrainStep:
    """One optimizer step of ``model`` (FSDP-wrapped or plain) with ``optimizer``.

    ``loss_scale``: multiplies each loss before ``backward`` (1 when FSDP sums the SP
    ranks' gradients itself, see :func:`usp.train.parallelize.fully_shard_model`).
    ``grad_clip``: the global norm to clip to (0: none). ``clip``: how the norm is taken
    and clipped (default :func:`clip_gradients`; the planner's fake-tensor variant
    differs only in what it allocates)."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        loss_scale: float = 1.0,
        grad_clip: float = 0.0,
        clip: Callable[[nn.Module, float], torch.Tensor] = clip_gradients,
    ):
        self.model, self.optimizer = model, optimizer
        self.loss_scale = loss_scale
        self.max_norm = grad_clip if grad_clip > 0 else math.inf
        self.clip = clip

    def phases(
        self,
        batches: Sequence[ShardedBatch],
        num_labels: int,
        outcome: StepOutcome,
        *,
        decide: Callable[[StepOutcome], bool] | None = None,
    ) -> Iterator[str]:
        """Run the step (see the module docstring), filling ``outcome``; yields each
        phase's name as it ends."""
        last = len(batches) - 1
        # a mixture-of-experts model with the aux loss on (usp.models CausalLM.adds_aux_loss)
        aux_on = bool(getattr(self.model, "adds_aux_loss", False))
        for i, batch in enumerate(batches):
            set_gradient_sync(self.model, i == last)
            kwargs = batch.model_kwargs()
            if aux_on:  # the model returns its router aux loss beside the loss
                kwargs["return_aux_loss"] = True
            loss = self.model(batch.input_ids, **kwargs, num_items_in_batch=num_labels)
            if aux_on:
                loss, aux = loss
                aux = aux.to(torch.float64)
                outcome.aux_loss = aux if outcome.aux_loss is None else outcome.aux_loss + aux
            yield f"forward {i}"
            (loss * self.loss_scale if self.loss_scale != 1.0 else loss).backward()
            outcome.loss += loss.detach().to(torch.float64)
            del loss
            yield f"backward {i}"
        outcome.grad_norm = self.clip(self.model, self.max_norm)
        yield "clip"
        outcome.applied = decide is None or decide(outcome)
        if outcome.applied:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        yield "optimizer"

    def run(
        self,
        batches: Sequence[ShardedBatch],
        num_labels: int,
        *,
        decide: Callable[[StepOutcome], bool] | None = None,
        device: torch.device | None = None,
    ) -> StepOutcome:
        """The whole step at once; the loss is summed on ``device`` (no host sync)."""
        outcome = StepOutcome(torch.zeros((), dtype=torch.float64, device=device))
        for _ in self.phases(batches, num_labels, outcome, decide=decide):
            pass
        return outcome
