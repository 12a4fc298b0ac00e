"""One training step of usp.models.Llama under USP (Ulysses x ring), on CPU processes.

    torchrun --nproc-per-node 4 examples/llama_step.py
    torchrun --nproc-per-node 4 examples/llama_step.py --model /path/to/Llama-3.2-1B --device cuda

Without ``--model``, rank 0 writes a tiny random Llama (``usp.models.PRESETS["tiny"]``,
byte vocabulary) as an HF checkpoint into a temporary directory, and every rank loads
it with ``Llama.from_pretrained`` as it would a real one. The batch is a few packed
byte-encoded documents, padded so the layout can place them; labels are shifted on the
global sequence, then everything is sharded (``usp.models.shard_batch``). The loss is
the mean over the whole global sequence on every rank; summing the gradients over the
SP group gives the single-process gradients (a trainer's FSDP/DDP over dp x sp does
that sum). Prints the loss before and after one AdamW step; exits non-zero if the ranks
disagree on the loss or it is not finite.
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import sys
import tempfile

import torch
import torch.distributed as dist

import usp
from usp.models import IGNORE_INDEX, Levers, Llama, shard_batch

DOCUMENTS = [
    "Ulysses trades sequence for heads inside a node.",
    "Ring attention passes key and value blocks across nodes.",
    "Labels are shifted before sharding.",
]


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="examples/configs/cpu_demo.toml")
    parser.add_argument("--model", default=None, help="a local HF Llama directory")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--activation-checkpointing", action="store_true")
    return parser.parse_args()


def byte_batch(plan, vocab_size: int):
    """Packed documents as bytes (ids < 256), each padded to what the layout needs;
    pads carry the ignore index as their label source, so they carry no loss."""
    docs = [torch.tensor(list(text.encode()), dtype=torch.long) % vocab_size for text in DOCUMENTS]
    lengths = torch.tensor([len(d) for d in docs])
    cu = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)]).to(torch.int32)
    padding = usp.pad_documents(cu, plan)
    tokens = torch.cat(docs)[None]  # [1, S_raw]
    ids = padding.apply(tokens, value=0)
    label_source = padding.apply(tokens, value=IGNORE_INDEX)  # targets aligned with tokens
    return shard_batch(plan, ids, labels=label_source, cu_seqlens=padding.cu_seqlens)


def checkpoint_path(args) -> tuple[str, str | None]:
    """(directory to load, temporary directory to delete afterwards)."""
    if args.model:
        return args.model, None
    path = [None]
    if dist.get_rank() == 0:
        path[0] = tempfile.mkdtemp(prefix="usp-llama-")
        torch.manual_seed(0)
        Llama.from_config("tiny").save_pretrained(path[0])
    dist.broadcast_object_list(path, src=0)  # the directory is on this machine's disk
    return path[0], path[0]


def main() -> int:
    args = parse_args()
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    else:
        torch.set_num_threads(1)
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    plan = usp.Plan.from_config(args.config)
    path, temporary = checkpoint_path(args)
    device = plan.default_device()
    model = Llama.from_pretrained(path, plan, device=device)
    Levers(activation_checkpointing=args.activation_checkpointing).apply(model)
    batch = byte_batch(plan, model.config.vocab_size)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    inputs = {k: v.to(device) if torch.is_tensor(v) else v for k, v in batch.model_kwargs().items()}
    input_ids = batch.input_ids.to(device)

    loss = model(input_ids, **inputs)
    loss.backward()
    for param in model.parameters():  # replicated over SP: the true gradient is the sum
        dist.all_reduce(param.grad, group=plan.sp_group)
    optimizer.step()
    with torch.no_grad():
        after = model(input_ids, **inputs)

    losses = [None] * dist.get_world_size()
    dist.all_gather_object(losses, (loss.item(), after.item()))
    failed = len(set(losses)) != 1 or not all(math.isfinite(x) for x in losses[0])
    if dist.get_rank() == 0:
        print(f"{plan.describe()}; {model.config.num_hidden_layers} layers, "
              f"{sum(p.numel() for p in model.parameters())} parameters")  # fmt: skip
        print(f"global tokens {batch.input_ids.shape[1] * plan.sp_degree}, "
              f"{batch.input_ids.shape[1]} per rank")  # fmt: skip
        print(f"loss {losses[0][0]:.4f} -> {losses[0][1]:.4f} after one step "
              f"({'FAILED: ranks disagree' if failed else 'identical on every rank'})")  # fmt: skip
    dist.barrier()
    if temporary and dist.get_rank() == 0:
        shutil.rmtree(temporary)
    dist.destroy_process_group()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
