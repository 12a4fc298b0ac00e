"""LoRA's exports: a PEFT adapter directory and the merged weights.

* :func:`save_peft_adapter` writes ``adapter_config.json`` and
  ``adapter_model.safetensors`` as PEFT's ``save_pretrained`` lays them out (keys
  ``base_model.model.<module>.lora_A.weight`` / ``lora_B.weight``, float32 unless the
  adapters are wider), so ``peft.PeftModel.from_pretrained(hf_base, directory)`` applies
  them to the transformers model of the base checkpoint. Writing needs only
  safetensors; peft is needed only to load the adapter into transformers.
* :func:`merged_state` folds the adapters into the base weights
  (``W + alpha / rank * B @ A``, computed in float32 at least) and drops them: a plain
  HF checkpoint of the adapted model.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from usp.models.checkpoint import CheckpointError, _safetensors, _write_atomic
from usp.models.lora import ADAPTER_NAMES, Lora, is_adapter

ADAPTER_CONFIG_FILE = "adapter_config.json"
ADAPTER_WEIGHTS_FILE = "adapter_model.safetensors"
#: the prefix PEFT's state dict puts before the base model's own names
PEFT_PREFIX = "base_model.model."


def split_adapters(state: dict[str, torch.Tensor]):
    """``(base, adapters)``: the state without the adapter keys, and module name ->
    ``(A [rank, in], B [out, rank])``."""
    base = {k: v for k, v in state.items() if not is_adapter(k)}
    modules = sorted({k.rpartition(".")[0] for k in state if is_adapter(k)})
    adapters = {}
    for module in modules:
        try:
            adapters[module] = tuple(state[f"{module}.{name}"] for name in ADAPTER_NAMES)
        except KeyError as missing:
            raise CheckpointError(
                f"module {module} has only one of lora_A/lora_B ({missing})"
            ) from None
    return base, adapters


def merged_state(state: dict[str, torch.Tensor], lora: Lora) -> dict[str, torch.Tensor]:
    """The base weights with the adapters folded in, each in its own dtype (the sum is
    taken in float32, or in the wider of the weight's and the adapters' dtypes)."""
    base, adapters = split_adapters(state)
    merged = dict(base)
    for module, (a, b) in adapters.items():
        weight = base[f"{module}.weight"]
        dtype = torch.promote_types(torch.promote_types(weight.dtype, a.dtype), torch.float32)
        delta = (b.to(dtype) @ a.to(dtype)) * lora.scale  # [out, rank] @ [rank, in]
        merged[f"{module}.weight"] = (weight.to(dtype) + delta).to(weight.dtype)
    return merged


def peft_config(lora: Lora, base_model: str | None) -> dict:
    """``adapter_config.json``: PEFT's LoRA fields for these settings (the rest of
    PEFT's fields keep their defaults when it loads the file)."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": lora.rank,
        "lora_alpha": lora.alpha,
        "lora_dropout": lora.dropout,
        "target_modules": list(lora.targets),
        "bias": "none",
        "fan_in_fan_out": False,
        "init_lora_weights": True,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
        "inference_mode": True,
    }


def save_peft_adapter(
    directory: str | Path,
    state: dict[str, torch.Tensor],
    lora: Lora,
    *,
    base_model: str | Path | None = None,
) -> Path:
    """Write the adapters of ``state`` (full tensors: a model's state dict, adapter keys
    ``<module>.lora_A`` / ``.lora_B``) as a PEFT adapter into ``directory``.
    ``base_model``: the base checkpoint's directory (``base_model_name_or_path``; None
    for a preset, whose base weights exist only in usp)."""
    _, st = _safetensors()
    _, adapters = split_adapters(state)
    if not adapters:
        raise CheckpointError("the state holds no LoRA adapters to export")
    tensors = {}
    for module, (a, b) in adapters.items():
        for name, value in zip(ADAPTER_NAMES, (a, b)):
            dtype = torch.promote_types(value.dtype, torch.float32)
            tensors[f"{PEFT_PREFIX}{module}.{name}.weight"] = value.detach().to("cpu", dtype)
    out = Path(directory).expanduser().resolve()
    if out.exists() and not out.is_dir():
        raise CheckpointError(f"{out} exists and is not a directory")
    out.mkdir(parents=True, exist_ok=True)
    config = peft_config(lora, None if base_model is None else str(base_model))
    _write_atomic(
        out / ADAPTER_CONFIG_FILE, lambda tmp: tmp.write_text(json.dumps(config, indent=2) + "\n")
    )
    _write_atomic(
        out / ADAPTER_WEIGHTS_FILE,
        lambda tmp: st.save_file(
            {k: v.contiguous() for k, v in tensors.items()}, str(tmp), metadata={"format": "pt"}
        ),
    )
    return out
