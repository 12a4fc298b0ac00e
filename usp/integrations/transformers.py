"""HF transformers' ``Trainer`` and TRL's ``SFTTrainer`` on usp's hybrid sequence
parallelism (Ulysses x ring), with FSDP2 and usp's memory levers; no DeepSpeed.

    from usp.integrations.transformers import UspTrainer, launch_plan
    from usp.models import Levers

    plan = launch_plan(ulysses=2, ring=2)        # under torchrun; or topology_file=...
    model = AutoModelForCausalLM.from_pretrained(path)
    trainer = UspTrainer(model=model, args=TrainingArguments(...), train_dataset=data,
                         data_collator=collator, plan=plan,
                         levers=Levers(activation_checkpointing=True))
    trainer.train()
    # TRL: UspSFTTrainer(model=model, args=SFTConfig(padding_free=True, ...), ...),
    # UspGRPOTrainer(model=model, reward_funcs=f, args=GRPOConfig(...), ...) and
    # UspDPOTrainer(model=model, args=DPOConfig(...), ...): docs/post-training.md

What it does (:mod:`usp.integrations.hf_trainer`): USP attention registered and the
model sharded over ``dp x sp`` with summed gradients; batches sampled by data-parallel
replica and sharded per SP rank (padding-free batches by their global documents, the SP
ranks agreeing on every batch's fingerprint); the loss exact over SP, gradient
accumulation and data parallelism; the global loss logged. Limits: see docs/integrations.md.

Needs transformers and accelerate (``pip install usp[trainer]``); ``UspSFTTrainer``,
``UspGRPOTrainer`` and ``UspDPOTrainer`` also TRL (``usp[trl]``), imported when the name
is first used.
"""

from __future__ import annotations

try:
    import transformers
except ImportError:  # pragma: no cover - the message is the point
    raise ImportError(
        "usp.integrations.transformers needs HF transformers and accelerate: "
        "pip install usp[trainer]"
    ) from None
if not hasattr(transformers.Trainer, "_defer_fsdp_gradient_reduction"):
    # the Trainer's path for a model that owns its sharding and gradient reduction
    raise ImportError(
        f"usp.integrations.transformers needs transformers >= 5.24 (found "
        f"{transformers.__version__}): pip install -U 'usp[trainer]'"
    )

from usp.integrations.hf_batches import DataParallelSampler, GlobalBatch, global_batch
from usp.integrations.hf_plan import plan_config
from usp.integrations.hf_setup import (
    PreparedModel,
    UnsupportedModelError,
    attention_chunk,
    feature_problems,
    launch_plan,
    prepare_model,
)
from usp.integrations.hf_trainer import UspTrainerMixin, check_training_arguments


class UspTrainer(UspTrainerMixin, transformers.Trainer):
    """``transformers.Trainer`` on usp's sequence parallelism (:class:`UspTrainerMixin`:
    extra keywords ``plan`` and ``levers``)."""


def __getattr__(name: str):
    if name == "UspSFTTrainer":  # TRL is optional: imported on first use
        from usp.integrations.hf_trl import UspSFTTrainer

        return UspSFTTrainer
    if name == "UspGRPOTrainer":
        from usp.integrations.trl_grpo import UspGRPOTrainer

        return UspGRPOTrainer
    if name == "UspDPOTrainer":
        from usp.integrations.trl_dpo import UspDPOTrainer

        return UspDPOTrainer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "DataParallelSampler",
    "GlobalBatch",
    "PreparedModel",
    "UnsupportedModelError",
    "UspTrainer",
    "UspTrainerMixin",
    "attention_chunk",
    "check_training_arguments",
    "feature_problems",
    "global_batch",
    "launch_plan",
    "plan_config",
    "prepare_model",
]
