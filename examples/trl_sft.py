"""Supervised fine-tuning with TRL's SFTTrainer on usp's sequence parallelism.

    torchrun --nproc-per-node 4 examples/trl_sft.py --model DIR --data chats.jsonl \\
        --output-dir runs/sft --max-steps 100 --ulysses 2 --ring 2
    python examples/trl_sft.py --model DIR --data chats.jsonl --output-dir runs/one \\
        --max-steps 100                                    # the same run in one process

``--data``: JSON lines, each ``{"messages": [{"role": "user", "content": ...},
{"role": "assistant", "content": ...}, ...]}``, rendered by the model directory's
tokenizer and its chat template (TRL's data preparation). Batches are padding-free
(``SFTConfig(padding_free=True)``: the conversations of a micro-batch flattened into one
row, their boundaries kept across the SP ranks); ``--padded`` pads rows instead.
Records with ``"images"`` (image files, relative to the data file) are TRL's
vision-language data: the model directory is then a vision-language model with its
processor (``AutoModelForImageTextToText``, ``AutoProcessor``), batches are padded rows
(TRL's vision collator) and usp places the images (``usp.models.hf.shard_multimodal``).
The grid is ``--ulysses x --ring`` SP ranks per data-parallel replica, the rest of the
world data-parallel; ``--batch-size`` conversations per replica per micro-batch. The
levers are ``usp.models.Levers`` (``--activation-checkpointing``, ``--mlp-tile-tokens``,
``--attention-head-chunks``, ``--loss-chunk-tokens``). ``--no-usp`` runs the unmodified
SFTTrainer (one process, sdpa; eager for a model without it, e.g. gpt-oss): the
reference the usp runs are compared with; a stock model whose attention lets flattened
conversations see each other (gpt-oss's eager attention in transformers 5.24-5.25) is
refused padding-free, naming ``--padded`` (a one-forward probe decides; usp's padding-free
run keeps them apart).

Leaves ``DIR/trainer_state.json`` (the loss and grad norm of every step in
``log_history``) and the final model in ``DIR``. ``--plan-config FILE`` writes the run
as a config for ``usp plan FILE`` (``--max-length`` tokens per conversation) and exits.
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
    parser.add_argument("--data", required=True, help="JSON lines with chat messages")
    parser.add_argument("--output-dir", required=True)
    parser.add_argument("--max-steps", type=int, required=True)
    parser.add_argument("--batch-size", type=int, default=2, help="chats per replica and step")
    parser.add_argument("--gradient-accumulation", type=int, default=1)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--optim", choices=["adamw_torch", "sgd"], default="adamw_torch")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-length", type=int, default=1024, help="for --plan-config")
    parser.add_argument("--sampling", choices=["random", "sequential"], default="random")
    parser.add_argument("--padded", action="store_true", help="pad rows (not padding-free)")
    parser.add_argument("--bf16", action="store_true", help="bf16 autocast (float32 weights)")
    parser.add_argument("--no-save-model", action="store_true", help="skip the final save")
    parser.add_argument("--no-usp", action="store_true", help="the stock SFTTrainer (one process)")
    parser.add_argument("--plan-config", metavar="FILE", help="write a usp plan config; exit")
    add_arguments(parser)
    return parser.parse_args(argv)


def read_chats(path: str):
    """The data set, and whether it is vision-language data (records with images)."""
    import datasets

    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    if not rows or not all(isinstance(r.get("messages"), list) for r in rows):
        raise SystemExit(f"{path}: every line needs a 'messages' list")
    if not any("images" in r for r in rows):
        return datasets.Dataset.from_list([{"messages": r["messages"]} for r in rows]), False
    from PIL import Image

    folder = Path(path).parent
    records = [
        {"messages": r["messages"],
         "images": [Image.open(folder / name).convert("RGB") for name in r.get("images", [])]}
        for r in rows
    ]  # fmt: skip
    return datasets.Dataset.from_list(records), True


def sft_config(args, vision: bool = False):
    """``vision``: TRL's vision-language data (padded rows, no truncation)."""
    import trl

    return trl.SFTConfig(
        output_dir=args.output_dir,
        max_steps=args.max_steps,
        per_device_train_batch_size=args.batch_size,
        gradient_accumulation_steps=args.gradient_accumulation,
        learning_rate=args.lr,
        seed=args.seed,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        optim=args.optim,
        train_sampling_strategy=args.sampling,
        padding_free=not (args.padded or vision),
        activation_checkpointing=False,  # TRL's default is on; usp's lever is the flag
        # TRL: no truncation when padding-free, nor of an image's tokens
        max_length=args.max_length if args.padded and not vision else None,
        bf16=args.bf16,
        use_cpu=not torch.cuda.is_available(),
        disable_tqdm=True,
        include_num_input_tokens_seen="non_padding",  # in log_history, every replica's once
    )


def reference_attention(model) -> str:
    """The attention of the ``--no-usp`` reference: sdpa where transformers offers it for
    the model, else eager (gpt-oss: its sinks have no sdpa path)."""
    return "sdpa" if getattr(model, "_supports_sdpa", False) else "eager"


def attends_across_documents(model) -> float:
    """How far the model's stock attention lets one flattened conversation see another in
    a padding-free row (position_ids restarting per conversation, as TRL's collator gives
    them): the largest logit difference of a second conversation with and without a
    first one before it (0: kept apart). A tiny forward, no gradients."""
    gen = torch.Generator().manual_seed(0)
    vocab = model.config.get_text_config().vocab_size
    first, second = (torch.randint(0, vocab, (1, n), generator=gen) for n in (5, 4))
    positions = torch.cat([torch.arange(5), torch.arange(4)])[None]
    training = model.training
    model.eval()
    try:
        with torch.no_grad():
            alone = model(input_ids=second, use_cache=False).logits
            flat = model(input_ids=torch.cat([first, second], 1), position_ids=positions,
                         use_cache=False).logits[:, 5:]  # fmt: skip
    finally:
        model.train(training)
    return float((flat - alone).abs().max())


def main(argv=None, *, plan=None) -> int:
    """``plan``: an already built ``usp.Plan`` (default: the launch's, from the flags)."""
    args = parse_args(argv)
    if args.plan_config:
        from usp.integrations.hf_cli import plan_config_command

        return plan_config_command(args)
    import transformers
    import trl

    from usp.integrations.hf_cli import levers_from_args, plan_from_args

    dataset, vision = read_chats(args.data)
    if vision:  # a vision-language model and its processor (tokenizer and image processor)
        tokenizer = transformers.AutoProcessor.from_pretrained(args.model)
        auto = transformers.AutoModelForImageTextToText
    else:
        tokenizer = transformers.AutoTokenizer.from_pretrained(args.model)
        auto = transformers.AutoModelForCausalLM
    model = auto.from_pretrained(args.model, dtype=torch.float32)
    if args.no_usp:
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            raise SystemExit("--no-usp is the one-process reference: run it without torchrun")
        model.set_attn_implementation(reference_attention(model))
        leak = 0.0 if args.padded else attends_across_documents(model)
        if leak > 1e-4:  # the stock padding-free reference would be wrong, not usp's run
            raise SystemExit(
                f"--no-usp: the stock {model.config.model_type} "
                f"({model.config._attn_implementation} attention) lets a flattened "
                f"conversation attend to the one before it in a padding-free batch (logits "
                f"differ by {leak:.3g}), so it is no reference; add --padded (usp's "
                "padding-free run equals the padded reference)"
            )
        trainer = trl.SFTTrainer(
            model=model, args=sft_config(args, vision), train_dataset=dataset,
            processing_class=tokenizer,
        )  # fmt: skip
    else:
        from usp.integrations.transformers import UspSFTTrainer

        plan = plan_from_args(args) if plan is None else plan
        trainer = UspSFTTrainer(
            model=model,
            args=sft_config(args, vision),
            train_dataset=dataset,
            processing_class=tokenizer,
            plan=plan,
            levers=levers_from_args(args),
        )
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
    except UspError as err:  # a refused model or input: the message says what to do
        print(f"error: {err}", file=sys.stderr)
        status = 2
    if dist.is_initialized():
        dist.destroy_process_group()
    sys.exit(status)
