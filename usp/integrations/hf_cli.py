"""usp's command-line options for a training script built on the Trainer integration
(``examples/hf_trainer.py``, ``examples/trl_sft.py``): the grid, the attention layout
and the memory levers, one set of flags and one meaning for both.

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args()
    plan, levers = plan_from_args(args), levers_from_args(args)
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from usp.cli.args import nonnegative_int, positive_int
from usp.integrations.hf_plan import plan_config
from usp.integrations.hf_setup import launch_plan
from usp.models import DEFAULT_LOSS_CHUNK_TOKENS, Levers
from usp.options import LAYOUTS
from usp.sp.plan import Plan

_CHECKPOINTING = {"off": False, "on": True, "offload": "offload"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the grid (``--ulysses``, ``--ring``, ``--topology``, ``--layout``) and the
    levers (``--activation-checkpointing``, ``--mlp-tile-tokens``,
    ``--attention-head-chunks``, ``--loss-chunk-tokens``) to ``parser``."""
    grid = parser.add_argument_group("usp: sequence parallelism (per data-parallel replica)")
    grid.add_argument("--ulysses", type=positive_int, default=1, help="Ulysses degree (default 1)")
    grid.add_argument("--ring", type=positive_int, default=1, help="ring degree (default 1)")
    grid.add_argument(
        "--topology",
        metavar="FILE",
        help="a usp topology config (its [parallel] and [attention]) instead of the flags",
    )
    grid.add_argument("--layout", choices=LAYOUTS, default="zigzag", help="sequence layout")
    levers = parser.add_argument_group("usp: memory levers (usp.models.Levers)")
    levers.add_argument(
        "--activation-checkpointing",
        choices=list(_CHECKPOINTING),
        default="off",
        help="recompute each decoder layer in backward; offload: keep its input in host memory",
    )
    levers.add_argument(
        "--mlp-tile-tokens",
        type=nonnegative_int,
        default=0,
        help="run each MLP over tiles of N tokens",
    )
    levers.add_argument(
        "--attention-head-chunks",
        type=positive_int,
        default=1,
        help="the ring attends to N groups of KV heads in turn",
    )
    levers.add_argument(
        "--loss-chunk-tokens",
        type=nonnegative_int,
        default=DEFAULT_LOSS_CHUNK_TOKENS,
        help="rows of logits at a time in the loss; 0: the model's full logits "
        f"(default {DEFAULT_LOSS_CHUNK_TOKENS})",
    )


def levers_from_args(args: argparse.Namespace) -> Levers:
    return Levers(
        activation_checkpointing=_CHECKPOINTING[args.activation_checkpointing],
        mlp_tile_tokens=args.mlp_tile_tokens,
        attention_head_chunks=args.attention_head_chunks,
        loss_chunk_tokens=args.loss_chunk_tokens or None,
    )


def plan_from_args(args: argparse.Namespace) -> Plan:
    """The launch's plan (:func:`usp.integrations.hf_setup.launch_plan`); collective
    under torchrun."""
    topology_file = args.topology  # a topology config's path, or None
    if topology_file is not None:
        return launch_plan(topology_file=topology_file)
    return launch_plan(args.ulysses, args.ring, layout=args.layout)


def write_plan_config(
    args: argparse.Namespace,
    path: str,
    *,
    model: str,
    seq_len: int,
    batch_size: int,
    accumulation: int,
) -> str:
    """Write the run these flags describe as a config for ``usp plan``
    (:func:`usp.integrations.hf_plan.plan_config`): ``batch_size`` sequences of
    ``seq_len`` tokens per micro-batch of a replica, ``accumulation`` micro-batches per
    step, the world from torchrun's environment (one node of ``ulysses * ring`` GPUs
    without it; ``usp plan --nodes/--gpus-per-node`` replace it). Rank 0 writes; returns
    the text."""
    world = int(os.environ.get("WORLD_SIZE", args.ulysses * args.ring))
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    dp = max(1, world // (args.ulysses * args.ring))
    text = plan_config(
        model,
        seq_len=seq_len,
        sequences_per_forward=batch_size,
        sequences_per_step=batch_size * dp * accumulation,
        nodes=max(1, world // per_node),
        gpus_per_node=per_node,
        ulysses=args.ulysses,
        ring=args.ring,
        levers=levers_from_args(args),
        layout=args.layout,
    )
    if int(os.environ.get("RANK", "0")) == 0:
        Path(path).write_text(text)
    return text


def plan_config_command(args: argparse.Namespace) -> int:
    """The examples' ``--plan-config FILE``: :func:`write_plan_config` from their flags
    (``--model``, ``--max-length``, ``--batch-size``, ``--gradient-accumulation``), then
    the command that plans it. Returns the exit status."""
    write_plan_config(
        args,
        args.plan_config,
        model=args.model,
        seq_len=args.max_length,
        batch_size=args.batch_size,
        accumulation=args.gradient_accumulation,
    )
    print(f"wrote {args.plan_config}: plan it with usp plan {args.plan_config}")
    return 0
