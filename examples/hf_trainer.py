"""Fine-tune an HF causal LM with transformers' Trainer on usp's sequence parallelism.

    torchrun --nproc-per-node 4 examples/hf_trainer.py --model DIR --data train.jsonl \\
        --output-dir runs/hf --max-steps 100 --ulysses 2 --ring 2
    python examples/hf_trainer.py --model DIR --data train.jsonl --output-dir runs/one \\
        --max-steps 100                                    # the same run in one process

``--data``: JSON lines, each ``{"text": "..."}`` (tokenised with the model directory's
tokenizer, at most ``--max-length`` tokens) or ``{"input_ids": [...]}``. Rows are padded
on the right (each row becomes one document under usp; a padded position carries no
loss) with the tokenizer's pad token, or its EOS token when it has none (Meta's Llama-3
tokenizers; as TRL does), or, with ``--padding-free``, flattened by
``DataCollatorWithFlattening``.
The grid is ``--ulysses x --ring`` SP ranks per data-parallel replica, the rest of the
world data-parallel; ``--batch-size`` rows per replica per micro-batch. The levers
(``--activation-checkpointing``, ``--mlp-tile-tokens``, ``--attention-head-chunks``,
``--loss-chunk-tokens``) are ``usp.models.Levers``. ``--no-usp`` runs the unmodified
Trainer (one process, sdpa; eager for a model without it, e.g. gpt-oss): the
reference the usp runs are compared with.

``--eval-data FILE`` (the same formats): its loss (``eval_loss``) every ``--eval-steps``
and at the end. Leaves ``DIR/trainer_state.json`` (the loss and grad norm of every step
in ``log_history``) and the final model in ``DIR``. ``--plan-config FILE`` writes the
run as a config for ``usp plan FILE`` (same model, lengths and levers) and exits.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from usp.errors import ConfigError, UspError


def parse_args(argv=None) -> argparse.Namespace:
    from usp.integrations.hf_cli import add_arguments

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True, help="a local HF causal-LM directory")
    parser.add_argument("--data", required=True, help="JSON lines with text or input_ids")
    parser.add_argument("--output-dir", required=True)
    parser.add_argument("--max-steps", type=int, required=True)
    parser.add_argument("--batch-size", type=int, default=1, help="rows per replica and step")
    parser.add_argument("--gradient-accumulation", type=int, default=1)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--optim", choices=["adamw_torch", "sgd"], default="adamw_torch")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-length", type=int, default=1024, help="tokens per text row")
    parser.add_argument("--sampling", choices=["random", "sequential"], default="random")
    parser.add_argument("--padding-free", action="store_true", help="DataCollatorWithFlattening")
    parser.add_argument("--eval-data", help="JSON lines evaluated every --eval-steps (loss)")
    parser.add_argument("--eval-steps", type=int, default=0, help="0: at the end only")
    parser.add_argument("--bf16", action="store_true", help="bf16 autocast (float32 weights)")
    parser.add_argument("--no-save-model", action="store_true", help="skip the final save")
    parser.add_argument("--no-usp", action="store_true", help="the stock Trainer (one process)")
    parser.add_argument("--plan-config", metavar="FILE", help="write a usp plan config; exit")
    add_arguments(parser)
    return parser.parse_args(argv)


def read_rows(path: str) -> list[dict]:
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    if not rows or not all("text" in r or "input_ids" in r for r in rows):
        raise SystemExit(f"{path}: every line needs a 'text' or an 'input_ids' field")
    return rows


def build_dataset(rows: list[dict], tokenizer, max_length: int):
    import datasets

    if all("input_ids" in r for r in rows):
        return datasets.Dataset.from_list([{"input_ids": r["input_ids"]} for r in rows])
    if tokenizer is None:
        raise SystemExit("text rows need a tokenizer in the model directory")
    texts = datasets.Dataset.from_list([{"text": r["text"]} for r in rows])
    return texts.map(
        lambda row: tokenizer(row["text"], truncation=True, max_length=max_length),
        remove_columns=["text"],
    )


def build_collator(args, tokenizer):
    import transformers

    if args.padding_free:
        return transformers.DataCollatorWithFlattening()
    if tokenizer is None:
        return transformers.default_data_collator
    tokenizer.padding_side = "right"
    if tokenizer.pad_token is None:  # Meta's Llama-3 tokenizers have none
        if tokenizer.eos_token is None:
            raise ConfigError(
                f"the tokenizer of {args.model} has neither a pad nor an EOS token to pad "
                "rows with: give it a pad_token, or use --padding-free"
            )
        tokenizer.pad_token = tokenizer.eos_token  # as TRL does
    return RightPadded(transformers.DataCollatorWithPadding(tokenizer))


class RightPadded:
    """Rows padded on the right, labels the tokens with ``-100`` on the padded positions
    (by the attention mask, not the pad id: a pad token that is also the EOS token
    keeps its real occurrences' labels)."""

    def __init__(self, pad):
        self.pad = pad

    def __call__(self, features):
        batch = self.pad(features)
        batch["labels"] = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
        return batch


def load_tokenizer(path: str):
    import transformers

    try:
        return transformers.AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError):
        return None


def training_arguments(args, per_replica: int):
    import transformers

    evaluation = {}
    if args.eval_data:
        evaluation = {"per_device_eval_batch_size": per_replica}
        if args.eval_steps:
            evaluation.update(eval_strategy="steps", eval_steps=args.eval_steps)
    return transformers.TrainingArguments(
        output_dir=args.output_dir,
        max_steps=args.max_steps,
        per_device_train_batch_size=per_replica,
        gradient_accumulation_steps=args.gradient_accumulation,
        learning_rate=args.lr,
        seed=args.seed,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        optim=args.optim,
        train_sampling_strategy=args.sampling,
        bf16=args.bf16,
        use_cpu=not torch.cuda.is_available(),
        disable_tqdm=True,
        include_num_input_tokens_seen="non_padding",  # in log_history, every replica's once
        **evaluation,
    )


def reference_attention(model) -> str:
    """The attention of the ``--no-usp`` reference: sdpa where transformers offers it for
    the model, else eager (gpt-oss: its sinks have no sdpa path)."""
    return "sdpa" if getattr(model, "_supports_sdpa", False) else "eager"


def main(argv=None, *, plan=None) -> int:
    """``plan``: an already built ``usp.Plan`` (default: the launch's, from the flags)."""
    args = parse_args(argv)
    if args.plan_config:
        from usp.integrations.hf_cli import plan_config_command

        return plan_config_command(args)
    import transformers

    from usp.integrations.hf_cli import levers_from_args, plan_from_args

    tokenizer = load_tokenizer(args.model)
    dataset = build_dataset(read_rows(args.data), tokenizer, args.max_length)
    held_out = None
    if args.eval_data:
        held_out = build_dataset(read_rows(args.eval_data), tokenizer, args.max_length)
    collator = build_collator(args, tokenizer)
    model = transformers.AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    if args.no_usp:
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            raise SystemExit("--no-usp is the one-process reference: run it without torchrun")
        model.set_attn_implementation(reference_attention(model))
        trainer = transformers.Trainer(
            model=model,
            args=training_arguments(args, args.batch_size),
            train_dataset=dataset,
            eval_dataset=held_out,
            data_collator=collator,
        )
    else:
        from usp.integrations.transformers import UspTrainer

        plan = plan_from_args(args) if plan is None else plan
        trainer = UspTrainer(
            model=model,
            args=training_arguments(args, args.batch_size),
            train_dataset=dataset,
            eval_dataset=held_out,
            data_collator=collator,
            plan=plan,
            levers=levers_from_args(args),
        )
    trainer.train()
    if held_out is not None:
        trainer.evaluate()  # eval_loss in log_history
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
    except UspError as err:  # a refused model or input: the message says what to do
        print(f"error: {err}", file=sys.stderr)
        status = 2
    if dist.is_initialized():
        dist.destroy_process_group()
    sys.exit(status)
