"""Learning-rate schedule: linear warmup, then cosine decay to a floor.

The schedule is a pure function of the number of optimizer steps already taken, so its
whole state is that number (saved in checkpoints) and a resumed run sets exactly the
learning rates the uninterrupted run would have set.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class WarmupCosine:
    """``lr_at(step)`` is the learning rate of optimizer step ``step + 1``.

    Warmup: ``lr * (step + 1) / warmup_steps`` for the first ``warmup_steps`` steps (the
    first step does not waste its update at zero). Then cosine from ``lr`` down to
    ``lr * min_lr_ratio`` at the last of ``total_steps``. A warmup longer than the run
    (a short trial run with ``--steps``) simply does not finish.
    """

    lr: float
    total_steps: int
    warmup_steps: int = 0
    min_lr_ratio: float = 0.1

    def __post_init__(self) -> None:
        if self.total_steps < 1:
            raise ValueError(f"total_steps must be >= 1, got {self.total_steps}")
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {self.warmup_steps}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")

    def lr_at(self, step: int) -> float:
        if step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        decay_steps = self.total_steps - self.warmup_steps
        if decay_steps <= 1:
            return self.lr
        progress = min(1.0, (step - self.warmup_steps) / (decay_steps - 1))
        floor = self.min_lr_ratio
        return self.lr * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress)))

    def apply(self, optimizer: torch.optim.Optimizer, step: int) -> float:
        """Set every parameter group's learning rate for optimizer step ``step + 1``."""
        lr = self.lr_at(step)
        for group in optimizer.param_groups:
            group["lr"] = lr
        return lr
