"""Every family's tiny checkpoints, written by transformers, with their float64 reference
and the grids they run on: the one list tests/models/test_families.py checks alike (one
process, 4 gloo ranks, the export).

A case names the checkpoint's writer, transformers' float64 model of it (its float32
internals replaced by float64 ones where it has them: model_cases, gemma3_cases,
qwen3_5_cases), what usp's model needs beyond loading (work settings only: GDN chunks),
and its 4-rank runs ``(ulysses, ring, layout, attention_head_chunks)``; the 4-rank check
launches each ``group`` once.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import gemma3_cases
import granite_cases
import qwen3_5_cases
from model_cases import load_hf_reference, write_family_checkpoint

#: the load-balancing coefficient of the MoE cases: large, so that the aux term moves the
#: gradients visibly
AUX_COEF = 0.5
#: gpt-oss with explicit kinds: full, then two layers sliding over 5 keys
OSS_LAYER_TYPES = ["full_attention", "sliding_attention", "sliding_attention"]
U2R2 = (2, 2, "zigzag", 1)
U1R4 = (1, 4, "contiguous", 1)


def small_chunks(model, chunk: int = 3):
    """Several GDN / Mamba-2 kernel chunks per document (work, not results)."""
    for module in model.modules():
        if type(module).__name__ in ("GatedDeltaNet", "Mamba2Mixer"):
            module.chunk_size = chunk
    return model


def _same(model):
    return model


@dataclass(frozen=True)
class CheckpointCase:
    family: str
    write: Callable[[Path], Path]
    load_reference: Callable = load_hf_reference  # (directory, dtype=float64) -> model
    prepare: Callable = _same  # usp's model -> the model to check
    grids: tuple[tuple[int, int, str, int], ...] = ()
    group: str = ""  # the 4-rank launch it runs in


def _family(family: str, seed: int = 7, **changes) -> dict:
    def write(directory: Path) -> Path:
        return write_family_checkpoint(directory, family, seed=seed, **changes)

    return {"family": family, "write": write}


def _gemma3(case: str) -> dict:
    def write(directory: Path) -> Path:
        return Path(gemma3_cases.write_checkpoint(directory, case, seed=3))

    return {"family": "gemma3", "write": write}


def _qwen3_5(case: str) -> dict:
    def write(directory: Path) -> Path:
        if case == "moe":
            return Path(qwen3_5_cases.write_moe_checkpoint(directory, seed=3))
        return Path(qwen3_5_cases.write_checkpoint(directory, case, seed=3))

    return {"family": "qwen3_5_moe" if case == "moe" else "qwen3_5", "write": write}


def _granite(case: str) -> dict:
    def write(directory: Path) -> Path:
        return Path(granite_cases.write_checkpoint(directory, case, seed=3))

    return {"family": "granitemoehybrid", "write": write}


_GEMMA3 = dict(load_reference=gemma3_cases.load_reference, grids=(U2R2, U1R4), group="gemma3")
_QWEN3_5 = dict(load_reference=qwen3_5_cases.load_reference, prepare=small_chunks,
                group="qwen3_5")  # fmt: skip
_GRANITE = dict(load_reference=granite_cases.load_reference, prepare=small_chunks,
                group="granitemoehybrid")  # fmt: skip
_AUX = dict(output_router_logits=True, router_aux_loss_coef=AUX_COEF, num_hidden_layers=3)

CASES: dict[str, CheckpointCase] = {
    "llama": CheckpointCase(**_family("llama"), grids=(U2R2,), group="llama"),
    "qwen2": CheckpointCase(**_family("qwen2"), grids=(U2R2,), group="qwen2"),
    "qwen3": CheckpointCase(**_family("qwen3"), grids=(U2R2,), group="qwen3"),
    "mistral": CheckpointCase(**_family("mistral"), grids=(U2R2,), group="mistral"),
    # windows of 8 keys, shorter than the sequences and than the documents
    "mistral-window": CheckpointCase(
        **_family("mistral", seed=8, sliding_window=8), grids=(U2R2, U1R4), group="mistral"
    ),
    # Qwen2 with use_sliding_window: layer 1 slides (max_window_layers 1), layer 0 is full
    "qwen2-window": CheckpointCase(
        **_family("qwen2", seed=8, use_sliding_window=True, sliding_window=8, max_window_layers=1),
        grids=(U2R2, U1R4),
        group="qwen2",
    ),
    "qwen3_moe": CheckpointCase(**_family("qwen3_moe")),
    "gpt_oss": CheckpointCase(**_family("gpt_oss")),
    # the load-balancing loss on; qwen3_moe: layer 0 dense, 1 and 2 sparse
    "qwen3_moe-aux": CheckpointCase(
        **_family("qwen3_moe", seed=11, **_AUX),
        grids=(U2R2, (1, 4, "zigzag", 1)),
        group="qwen3_moe",
    ),  # fmt: skip
    "gpt_oss-aux": CheckpointCase(
        **_family("gpt_oss", seed=12, **_AUX, layer_types=OSS_LAYER_TYPES, sliding_window=5),
        grids=(U2R2, (1, 4, "contiguous", 2)),  # sinks under head sharding, head chunks
        group="gpt_oss",
    ),
    "gemma3-tied": CheckpointCase(**_gemma3("tied"), **_GEMMA3),
    "gemma3-capped": CheckpointCase(**_gemma3("capped"), **_GEMMA3),
    "qwen3_5-tied": CheckpointCase(**_qwen3_5("tied"), grids=(U2R2,), **_QWEN3_5),
    "qwen3_5-biased": CheckpointCase(**_qwen3_5("biased"), grids=(U1R4,), **_QWEN3_5),
    # its 2 GDN key heads repeated for 4 ranks
    "qwen3_5_moe": CheckpointCase(**_qwen3_5("moe"), grids=((4, 1, "zigzag", 1),), **_QWEN3_5),
    "granite-rope": CheckpointCase(**_granite("rope"), grids=(U2R2,), **_GRANITE),
    "granite-nope": CheckpointCase(**_granite("nope"), grids=(U1R4,), **_GRANITE),
}
#: the 4-rank launches: group -> its cases
GROUPS: dict[str, list[str]] = {}
for _name, _case in CASES.items():
    if _case.grids:
        GROUPS.setdefault(_case.group, []).append(_name)
