"""Models under USP: a native Llama-3-family model, HF checkpoints, HF transformers'
attention plug-in (:mod:`usp.models.hf`), and the SP-correct loss.

    plan = usp.Plan(topology)                                 # or usp.Plan(None)
    model = usp.models.Llama.from_pretrained("llama-3.2-1b/", plan, dtype=torch.bfloat16)
    labels = usp.models.shift_labels(input_ids)               # shift the GLOBAL batch first
    loss = model(plan.shard(input_ids), labels=plan.shard(labels))
    loss.backward()   # sum the gradients over the SP group (FSDP/DDP over dp x sp does it)

transformers is imported only by :mod:`usp.models.hf`; safetensors only when a
checkpoint is read or written.
"""

from usp.models.batch import ShardedBatch, shard_batch
from usp.models.checkpoint import CheckpointError
from usp.models.config import LlamaConfig, ModelConfigError
from usp.models.labels import IGNORE_INDEX, shift_labels
from usp.models.llama import Llama
from usp.models.loss import (
    DEFAULT_LOSS_CHUNK_TOKENS,
    count_labels,
    cross_entropy_sum,
    sp_cross_entropy,
    sp_normalise,
)
from usp.models.presets import PRESETS, preset

__all__ = [
    "DEFAULT_LOSS_CHUNK_TOKENS",
    "IGNORE_INDEX",
    "PRESETS",
    "ShardedBatch",
    "CheckpointError",
    "Llama",
    "LlamaConfig",
    "ModelConfigError",
    "count_labels",
    "cross_entropy_sum",
    "preset",
    "shard_batch",
    "shift_labels",
    "sp_cross_entropy",
    "sp_normalise",
]
