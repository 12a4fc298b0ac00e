"""DPO with TRL's DPOTrainer on usp's sequence parallelism.

    torchrun --nproc-per-node 4 examples/trl_dpo.py --model DIR --data pairs.jsonl \\
        --output-dir runs/dpo --max-steps 100 --batch-size 4 --ulysses 2 --ring 2
    python examples/trl_dpo.py ... --no-usp             # the stock DPOTrainer, one process

``--data``: JSON lines of TRL's conversational preference records, ``{"prompt":
[messages], "chosen": [messages], "rejected": [messages]}``, rendered by the model
directory's chat template. ``--batch-size``: pairs per data-parallel replica per step;
the grid is ``--ulysses x --ring`` SP ranks per replica, the rest of the world
data-parallel; ``--beta``: DPO's temperature. The reference model is a second copy of
``--model`` (TRL's default), prepared like the policy. ``--no-usp`` runs the unmodified
DPOTrainer in one process (sdpa): the reference the usp runs are compared with
(``--sampling sequential``: the stock trainer's shuffled order is its own).

Leaves ``DIR/trainer_state.json`` (TRL's ``log_history``: loss, grad_norm,
rewards/chosen, rewards/rejected, ... of every step) and the final model in ``DIR``
(unless ``--no-save-model``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from usp.errors import UspError


def parse_args(argv=None) -> argparse.Namespace:
    from usp.integrations.hf_cli import add_arguments

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True, help="a local HF causal-LM directory")
    parser.add_argument("--data", required=True, help="JSON lines of preference records")
    parser.add_argument("--output-dir", required=True)
    parser.add_argument("--max-steps", type=int, required=True)
    parser.add_argument("--batch-size", type=int, default=4, help="pairs per replica and step")
    parser.add_argument("--beta", type=float, default=0.1)
    parser.add_argument("--sampling", choices=["sequential", "shuffled"], default="shuffled")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-save-model", action="store_true", help="skip the final save")
    parser.add_argument("--no-usp", action="store_true", help="the stock DPOTrainer")
    add_arguments(parser)
    return parser.parse_args(argv)


def read_pairs(path: str):
    import datasets

    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    keys = ("prompt", "chosen", "rejected")
    if not rows or not all(all(k in r for k in keys) for r in rows):
        raise SystemExit(f"{path}: every line needs 'prompt', 'chosen' and 'rejected'")
    return datasets.Dataset.from_list([{k: r[k] for k in keys} for r in rows])


def dpo_config(args, overrides=None):
    import trl

    options = dict(
        output_dir=args.output_dir,
        max_steps=args.max_steps,
        per_device_train_batch_size=args.batch_size,
        beta=args.beta,
        train_sampling_strategy="random" if args.sampling == "shuffled" else "sequential",
        seed=args.seed,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=not torch.cuda.is_available(),
        bf16=False,  # TRL's default is bf16 autocast: these runs are float32
        activation_checkpointing=False,  # TRL's default is on; usp's lever is the flag
        disable_tqdm=True,
    )
    options.update(overrides or {})
    return trl.DPOConfig(**options)


def main(argv=None, *, plan=None, overrides=None) -> int:
    """``plan``: an already built ``usp.Plan`` (default: the launch's, from the flags);
    ``overrides``: ``DPOConfig`` fields set over the flags' (tests)."""
    args = parse_args(argv)
    import transformers
    import trl

    from usp.integrations.hf_cli import levers_from_args, plan_from_args

    tokenizer = transformers.AutoTokenizer.from_pretrained(args.model)
    model = transformers.AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    common = dict(
        args=dpo_config(args, overrides),
        train_dataset=read_pairs(args.data),
        processing_class=tokenizer,
    )
    if args.no_usp:
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            raise SystemExit("--no-usp is the one-process reference: run it without torchrun")
        model.set_attn_implementation("sdpa" if model._supports_sdpa else "eager")
        trainer = trl.DPOTrainer(model=model, **common)
    else:
        from usp.integrations.transformers import UspDPOTrainer

        plan = plan_from_args(args) if plan is None else plan
        trainer = UspDPOTrainer(model=model, plan=plan, levers=levers_from_args(args), **common)
    trainer.train()
    if not args.no_save_model:
        trainer.save_model(args.output_dir)
    trainer.save_state()  # DIR/trainer_state.json: log_history, every step's loss
    losses = [row["loss"] for row in trainer.state.log_history if "loss" in row]
    if trainer.is_world_process_zero():
        print(f"{len(losses)} steps; loss {losses[0]:.4f} -> {losses[-1]:.4f}")
    return 0


if __name__ == "__main__":
    try:
        status = main()
    except UspError as err:  # a refused model, option or input: the message says what to do
        print(f"error: {err}", file=sys.stderr)
        status = 2
    if dist.is_initialized():
        dist.destroy_process_group()
    sys.exit(status)
