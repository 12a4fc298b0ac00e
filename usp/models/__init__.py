"""Models under USP: nine decoder-only families (Llama, Qwen2/2.5, Qwen3, Mistral,
Qwen3-MoE, gpt-oss, Gemma 3, Qwen3.5, Qwen3.5-MoE) built natively as one decoder stack of
parts, HF checkpoints, HF transformers' attention plug-in (:mod:`usp.models.hf`), the
SP-correct loss, the memory levers and LoRA adapters (:mod:`usp.models.lora`).

    plan = usp.Plan(topology)                                 # or usp.Plan(None)
    model = usp.models.from_pretrained("llama-3.2-1b/", plan, dtype=torch.bfloat16)
    usp.models.Levers(activation_checkpointing=True).apply(model)   # optional
    labels = usp.models.shift_labels(input_ids)               # shift the GLOBAL batch first
    loss = model(plan.shard(input_ids), labels=plan.shard(labels))
    loss.backward()   # sum the gradients over the SP group (FSDP/DDP over dp x sp does it)

The stack (:mod:`usp.models.stack`, :mod:`usp.models.decoder`) is built from parts
(:mod:`usp.models.parts`: norms, token mixers -- :mod:`usp.models.attention`,
:mod:`usp.models.gated_deltanet`, :mod:`usp.models.mamba2`, registered in :mod:`usp.models.mixers` --, MLPs --
:mod:`usp.models.mlp`, :mod:`usp.models.moe`, :mod:`usp.models.gpt_oss_experts`); a family
file (``llama.py``, ..., ``qwen3_5_moe.py``) maps its HF config and checkpoint onto them.
The family registry (:mod:`usp.models.family`) is what the rest of usp asks about a
model. transformers is imported only by :mod:`usp.models.hf`; safetensors only when a
checkpoint is read or written.
"""

from pathlib import Path

from usp.models.batch import ShardedBatch, shard_batch
from usp.models.checkpoint import CheckpointError, checkpoint_dir
from usp.models.config import DecoderConfig, ModelConfigError, read_config_json
from usp.models.counts import ModelCounts, document_cost, model_counts, training_flops
from usp.models.decoder import CausalLM
from usp.models.family import (
    FAMILIES,
    PRESETS,
    ModelFamily,
    config_from_file,
    config_from_hf,
    decoder_layers,
    family_for_hf,
    family_named,
    family_of,
    preset,
)
from usp.models.gemma3 import Gemma3, Gemma3Config
from usp.models.gpt_oss import GptOss, GptOssConfig
from usp.models.granite_hybrid import GraniteHybrid, GraniteHybridConfig
from usp.models.labels import IGNORE_INDEX, shift_labels
from usp.models.levers import LeverError, Levers, levers_of
from usp.models.llama import Llama, LlamaConfig
from usp.models.lora import Lora, LoraError, apply_lora, lora_of
from usp.models.loss import (
    DEFAULT_LOSS_CHUNK_TOKENS,
    count_labels,
    cross_entropy_sum,
    sp_cross_entropy,
    sp_normalise,
)
from usp.models.mistral import Mistral, MistralConfig
from usp.models.plan_inputs import plan_argument
from usp.models.qwen2 import Qwen2, Qwen2Config
from usp.models.qwen3 import Qwen3, Qwen3Config
from usp.models.qwen3_5 import Qwen3_5, Qwen3_5Config
from usp.models.qwen3_5_moe import Qwen3_5Moe, Qwen3_5MoeConfig
from usp.models.qwen3_moe import Qwen3Moe, Qwen3MoeConfig


def from_pretrained(path: str | Path, /, plan=None, **kwargs) -> CausalLM:
    """Load a local HF-format directory as the model of the family its ``config.json``
    names (see :meth:`usp.models.decoder.CausalLM.from_pretrained` for ``kwargs``)."""
    plan = plan_argument(plan, kwargs, "usp.models.from_pretrained")
    config_file = checkpoint_dir(path) / "config.json"
    family = family_for_hf(read_config_json(config_file), source=str(config_file))
    return family.from_pretrained(path, plan, **kwargs)


__all__ = [
    "DEFAULT_LOSS_CHUNK_TOKENS",
    "FAMILIES",
    "IGNORE_INDEX",
    "PRESETS",
    "CausalLM",
    "CheckpointError",
    "DecoderConfig",
    "GptOss",
    "GptOssConfig",
    "GraniteHybrid",
    "GraniteHybridConfig",
    "LeverError",
    "Levers",
    "Llama",
    "LlamaConfig",
    "Lora",
    "LoraError",
    "Mistral",
    "MistralConfig",
    "ModelConfigError",
    "ModelCounts",
    "ModelFamily",
    "Qwen2",
    "Qwen2Config",
    "Qwen3",
    "Qwen3Config",
    "Qwen3Moe",
    "Qwen3MoeConfig",
    "Qwen3_5",
    "Qwen3_5Config",
    "Qwen3_5Moe",
    "Qwen3_5MoeConfig",
    "Gemma3",
    "Gemma3Config",
    "ShardedBatch",
    "apply_lora",
    "config_from_file",
    "config_from_hf",
    "count_labels",
    "cross_entropy_sum",
    "decoder_layers",
    "document_cost",
    "family_for_hf",
    "family_named",
    "family_of",
    "from_pretrained",
    "levers_of",
    "lora_of",
    "model_counts",
    "preset",
    "shard_batch",
    "shift_labels",
    "sp_cross_entropy",
    "sp_normalise",
    "training_flops",
]
