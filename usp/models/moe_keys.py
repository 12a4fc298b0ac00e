"""Mixture-of-experts checkpoints: the per-expert tensors a checkpoint holds
(``mlp.experts.{e}.gate_proj.weight``, as published and as transformers 5 writes them)
and the grouped parameters :class:`usp.models.moe.Experts` holds
(``mlp.experts.gate_up_proj`` [E, 2I, H], ``mlp.experts.down_proj`` [E, H, I]), both
ways (:mod:`usp.models.checkpoint` converts with these).
"""

from __future__ import annotations

import torch
from torch import nn

from usp.models.moe import Experts

#: the checkpoint's per-expert projection names (``mlp.experts.{e}.{name}.weight``)
EXPERT_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
#: the grouped parameters' names in :class:`Experts`
GROUPED_NAMES = ("gate_up_proj", "down_proj")


def expert_key(key: str) -> tuple[str, int, str] | None:
    """``(grouped parameter name, expert, projection)`` of a per-expert checkpoint key
    (``...mlp.experts.3.up_proj.weight`` -> ``(...mlp.experts.gate_up_proj, 3,
    "up_proj")``), else None."""
    parts = key.split(".")
    if (
        len(parts) < 4
        or parts[-1] != "weight"
        or parts[-2] not in EXPERT_PROJECTIONS
        or not parts[-3].isdigit()
        or parts[-4] != "experts"
    ):
        return None
    prefix = ".".join(parts[:-3])
    grouped = "down_proj" if parts[-2] == "down_proj" else "gate_up_proj"
    return f"{prefix}.{grouped}", int(parts[-3]), parts[-2]


def join_expert_tensors(
    pieces: dict[str, dict[int, dict[str, torch.Tensor]]], expected: dict[str, torch.Tensor]
) -> tuple[dict[str, torch.Tensor], list[str]]:
    """Grouped parameters from per-expert tensors (``pieces[grouped name][expert]
    [projection]``): ``(state, problems)``, a problem for each missing or misshapen piece."""
    state, problems = {}, []
    for name, by_expert in pieces.items():
        want = expected[name]
        experts = want.shape[0]
        parts = ("gate_proj", "up_proj") if name.endswith("gate_up_proj") else ("down_proj",)
        missing = [
            f"{name.removesuffix(name.rpartition('.')[2])}{e}.{p}.weight"
            for e in range(experts)
            for p in parts
            if p not in by_expert.get(e, {})
        ]
        extra = [e for e in by_expert if e >= experts]
        if missing or extra:
            problems.extend(missing[:3] + [f"{name}: expert {e} of {experts}" for e in extra])
            continue
        stacked = torch.stack([torch.cat([by_expert[e][p] for p in parts]) for e in range(experts)])
        if stacked.shape != want.shape:
            problems.append(f"{name}: {tuple(stacked.shape)} (config wants {tuple(want.shape)})")
            continue
        state[name] = stacked
    return state, problems


def split_expert_tensors(name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
    """One grouped parameter as the per-expert checkpoint keys transformers reads (and
    the published checkpoints hold); other parameters unchanged."""
    prefix, _, last = name.rpartition(".")
    if not prefix.endswith("experts") or last not in GROUPED_NAMES or tensor.dim() != 3:
        return {name: tensor}
    out = {}
    for expert, weight in enumerate(tensor):
        if last == "down_proj":
            out[f"{prefix}.{expert}.down_proj.weight"] = weight.contiguous()
        else:
            gate, up = weight.chunk(2, dim=0)
            out[f"{prefix}.{expert}.gate_proj.weight"] = gate.contiguous()
            out[f"{prefix}.{expert}.up_proj.weight"] = up.contiguous()
    return out


def per_expert_names(model: nn.Module) -> set[str]:
    """The grouped parameters of ``model`` that checkpoints hold one tensor per expert
    (:attr:`Experts.per_expert_checkpoint`): what :func:`join_expert_tensors` and
    :func:`split_expert_tensors` convert."""
    return {
        f"{prefix}.{name}"
        for prefix, module in model.named_modules()
        if isinstance(module, Experts) and module.per_expert_checkpoint
        for name in GROUPED_NAMES
    }
