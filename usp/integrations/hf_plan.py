"""``usp plan`` for a Trainer run: the same model, lengths and levers as a ``usp train``
config, which the planner reads as it reads any (``usp plan FILE``).

The planner measures one rank's real training step for every grid and lever; what it
needs from an HF run is the model's ``config.json`` (read through usp's family registry),
the tokens per forward (``micro_batch`` sequences of ``seq_len`` tokens, one packed row:
what a padding-free batch is), the sequences per optimizer step, the levers and the
cluster. :func:`plan_config` writes exactly that.
"""

from __future__ import annotations

import os
from pathlib import Path

from usp.models import Levers


def _value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return str(value)


def plan_config(
    model_path: str | os.PathLike,
    *,
    seq_len: int,
    sequences_per_forward: int,
    sequences_per_step: int,
    nodes: int,
    gpus_per_node: int,
    ulysses: int = 1,
    ring: int = 1,
    levers: Levers | None = None,
    layout: str = "zigzag",
) -> str:
    """The text of a ``usp train`` config for ``usp plan``: the HF checkpoint directory
    ``model_path`` (its ``config.json``; weights are not read), ``seq_len`` tokens per
    sequence (a TRL ``max_length``), ``sequences_per_forward`` per micro-batch of one
    replica (``per_device_train_batch_size``), ``sequences_per_step`` per optimizer step
    over all replicas (``per_device * dp * gradient_accumulation_steps``), the cluster,
    the run's grid (``ulysses x ring``; the planner also ranks every other) and the levers.
    The loss chunk is ``Levers``' default in the planner (not a ``[train]`` key)."""
    levers = Levers() if levers is None else levers
    directory = Path(model_path).expanduser().resolve()
    if not (directory / "config.json").is_file():
        raise FileNotFoundError(f"{directory} has no config.json (an HF checkpoint directory)")
    sections = {
        "cluster": {"nodes": nodes, "gpus_per_node": gpus_per_node},
        "parallel": {"ulysses": ulysses, "ring": ring, "dp": "auto"},
        "attention": {"layout": layout},
        "model": {"path": str(directory)},
        "data": {"source": "synthetic"},
        "train": {
            "steps": 1,
            "seq_len": seq_len,
            "micro_batch": sequences_per_forward,
            "global_batch": sequences_per_step,
            "activation_checkpointing": levers.activation_checkpointing,
            "mlp_tile_tokens": levers.mlp_tile_tokens,
            "attention_head_chunks": levers.attention_head_chunks,
        },
    }
    lines = [
        "# An HF Trainer / TRL run as usp plan sees it (usp.integrations.hf_plan.plan_config):",
        f"#   usp plan {{this file}}   (levers: {levers.describe()})",
    ]
    for name, body in sections.items():
        lines.append(f"\n[{name}]")
        lines += [f"{key} = {_value(value)}" for key, value in body.items()]
    return "\n".join(lines) + "\n"
