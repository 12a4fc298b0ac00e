"""TRL's ``SFTTrainer`` on usp's sequence parallelism (:class:`UspSFTTrainer`).

TRL prepares the data (chat templates, completion masks, its padding-free collator) and
the Trainer runs the steps; :class:`usp.integrations.hf_trainer.UspTrainerMixin` replaces
the loss, the sampler and the sharding. TRL's own loss computes per-token metrics
(``entropy``, ``mean_token_accuracy``) from the full logits, which no SP rank holds:
those two are not logged; ``num_tokens`` is (each replica's tokens once).
"""

from __future__ import annotations

try:
    import trl
except ImportError:  # pragma: no cover - the message is the point
    raise ImportError(
        "usp.integrations.transformers.UspSFTTrainer needs TRL: pip install usp[trl]"
    ) from None

import torch

from usp.errors import ConfigError
from usp.integrations.hf_trainer import UspTrainerMixin


class UspSFTTrainer(UspTrainerMixin, trl.SFTTrainer):
    """``trl.SFTTrainer`` on usp's sequence parallelism (extra keywords ``plan`` and
    ``levers``, as :class:`usp.integrations.transformers.UspTrainer`). Padding-free
    batches (``SFTConfig(padding_free=True)``) keep their documents apart across the SP
    ranks; padded batches are trained as one document per row."""

    def __init__(self, model=None, args=None, *more, **kwargs):
        if kwargs.get("peft_config") is not None:
            raise ConfigError("peft_config is not supported by usp's Trainer integration yet")
        problems = []
        if args is not None and getattr(args, "loss_type", "nll") != "nll":
            problems.append(f'loss_type="{args.loss_type}" (usp computes the "nll" loss)')
        if args is not None and getattr(args, "use_liger_kernel", False):
            problems.append("use_liger_kernel (it replaces the model's forward)")
        if problems:
            raise ConfigError("usp's SFTTrainer integration cannot use " + "; ".join(problems))
        super().__init__(model, args, *more, **kwargs)

    def _usp_router_aux_weight(self, num_items_in_batch) -> float | None:
        """TRL's weight of a mixture-of-experts model's aux loss: ``router_aux_loss_coef``
        (SFTConfig's, else the config's), divided by the gradient accumulation steps when
        the step's label count normalises the loss (TRL's rule)."""
        if not getattr(self, "aux_loss_enabled", False):
            return None
        steps = 1
        if num_items_in_batch is not None and self.model.training:
            steps = self.current_gradient_accumulation_steps
        return self.router_aux_loss_coef / steps

    def _usp_after_loss(self, inputs) -> None:
        """TRL's ``num_tokens`` metric: every replica's tokens once (a padded batch's
        real tokens, a padding-free batch's all)."""
        mode = "train" if self.model.training else "eval"
        aux = getattr(self, "_usp_last_aux", None)
        if aux is not None and getattr(self, "aux_loss_enabled", False):
            self._metrics[mode]["aux_loss"].append(aux.item())  # the whole micro-batch's
        if not self.model.training:
            return
        mask = inputs.get("attention_mask")
        count = inputs["input_ids"].numel() if mask is None else mask.sum()
        count = torch.as_tensor(count, dtype=torch.int64, device=self.args.device)
        self._total_train_tokens += int(self._usp_sum_replicas(count))
        self._metrics["train"]["num_tokens"] = [self._total_train_tokens]
