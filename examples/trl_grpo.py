"""GRPO with TRL's GRPOTrainer on usp's sequence parallelism.

    torchrun --nproc-per-node 4 examples/trl_grpo.py --model DIR --data prompts.jsonl \\
        --reward rewards.py:score --output-dir runs/grpo --max-steps 100 \\
        --batch-size 8 --num-generations 4 --ulysses 2 --ring 2
    python examples/trl_grpo.py ... --no-usp            # the stock GRPOTrainer, one process

``--data``: JSON lines of TRL prompt records, ``{"prompt": [{"role": "user", "content":
...}]}`` (rendered with the model directory's chat template) or ``{"prompt": "text"}``;
other keys reach the reward function as keyword arguments. ``--reward FILE.py:FUNC``: a
function with TRL's reward-function signature ``FUNC(prompts, completions,
completion_ids, **kwargs) -> list[float]``; without it, a toy reward (completions of
about 24 characters, without repeated letters). ``--batch-size``: completions per
data-parallel replica per step (TRL's ``per_device_train_batch_size``, per replica),
``--num-generations`` completions per prompt; the grid is ``--ulysses x --ring`` SP
ranks per replica, the rest of the world data-parallel. ``--no-usp`` runs the unmodified
GRPOTrainer in one process (sdpa): the reference the usp runs are compared with.

Leaves ``DIR/trainer_state.json`` (TRL's ``log_history``: loss, grad_norm, reward,
kl, entropy, clip ratios, completion lengths ... of every step) and the final model in
``DIR`` (unless ``--no-save-model``).
"""

from __future__ import annotations

import argparse
import importlib.util
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
    parser.add_argument("--data", required=True, help="JSON lines of TRL prompt records")
    parser.add_argument("--reward", metavar="FILE.py:FUNC", help="the reward function")
    parser.add_argument("--output-dir", required=True)
    parser.add_argument("--max-steps", type=int, required=True)
    parser.add_argument("--batch-size", type=int, default=8, help="completions per replica")
    parser.add_argument("--num-generations", type=int, default=4)
    parser.add_argument("--max-completion-length", type=int, default=32)
    parser.add_argument("--loss-type", choices=["grpo", "bnpo", "dr_grpo", "dapo"], default="dapo")
    parser.add_argument("--beta", type=float, default=0.0, help="KL weight (0: no reference)")
    parser.add_argument(
        "--importance-sampling-level", choices=["token", "sequence"], default="token"
    )
    parser.add_argument("--sampling", choices=["sequential", "shuffled"], default="shuffled")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-save-model", action="store_true", help="skip the final save")
    parser.add_argument("--no-usp", action="store_true", help="the stock GRPOTrainer")
    add_arguments(parser)
    return parser.parse_args(argv)


def read_prompts(path: str):
    import datasets

    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    if not rows or not all(isinstance(r.get("prompt"), (str, list)) for r in rows):
        raise SystemExit(f"{path}: every line needs a 'prompt' (a string or a message list)")
    return datasets.Dataset.from_list(rows)


def toy_reward(prompts, completions, **kwargs) -> list[float]:
    """Completions of about 24 characters without repeated letters score best."""
    scores = []
    for completion in completions:
        text = completion[-1]["content"] if isinstance(completion, list) else completion
        repeats = sum(a == b for a, b in zip(text, text[1:]))
        scores.append(-abs(len(text) - 24) / 24 - repeats / max(1, len(text)))
    return scores


def load_reward(spec: str | None):
    if spec is None:
        return toy_reward
    path, _, name = spec.rpartition(":")
    if not path or not name:
        raise SystemExit(f"--reward {spec}: give FILE.py:FUNC")
    module_spec = importlib.util.spec_from_file_location("usp_grpo_reward", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return getattr(module, name)


def grpo_config(args, overrides=None):
    import trl

    options = dict(
        output_dir=args.output_dir,
        max_steps=args.max_steps,
        per_device_train_batch_size=args.batch_size,
        num_generations=args.num_generations,
        max_completion_length=args.max_completion_length,
        loss_type=args.loss_type,
        beta=args.beta,
        importance_sampling_level=args.importance_sampling_level,
        shuffle_dataset=args.sampling == "shuffled",
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
    return trl.GRPOConfig(**options)


def main(argv=None, *, plan=None, overrides=None) -> int:
    """``plan``: an already built ``usp.Plan`` (default: the launch's, from the flags);
    ``overrides``: ``GRPOConfig`` fields set over the flags' (tests)."""
    args = parse_args(argv)
    import transformers
    import trl

    from usp.integrations.hf_cli import levers_from_args, plan_from_args

    tokenizer = transformers.AutoTokenizer.from_pretrained(args.model, padding_side="left")
    model = transformers.AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    common = dict(
        reward_funcs=load_reward(args.reward),
        args=grpo_config(args, overrides),
        train_dataset=read_prompts(args.data),
        processing_class=tokenizer,
    )
    if args.no_usp:
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            raise SystemExit("--no-usp is the one-process reference: run it without torchrun")
        model.set_attn_implementation("sdpa" if model._supports_sdpa else "eager")
        trainer = trl.GRPOTrainer(model=model, **common)
    else:
        from usp.integrations.transformers import UspGRPOTrainer

        plan = plan_from_args(args) if plan is None else plan
        trainer = UspGRPOTrainer(model=model, plan=plan, levers=levers_from_args(args), **common)
    trainer.train()
    if not args.no_save_model:
        trainer.save_model(args.output_dir)
    trainer.save_state()  # DIR/trainer_state.json: log_history, every step's loss and reward
    rewards = [row["reward"] for row in trainer.state.log_history if "reward" in row]
    if trainer.is_world_process_zero():
        print(f"{len(rewards)} steps; reward {rewards[0]:.4f} -> {rewards[-1]:.4f}")
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
