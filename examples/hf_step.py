"""One training step of HF transformers' LlamaForCausalLM with USP attention plugged in.

    torchrun --nproc-per-node 4 examples/hf_step.py
    torchrun --nproc-per-node 4 examples/hf_step.py --model /path/to/Llama-3.2-1B --device cuda

The model is built as transformers builds it, then ``usp.models.hf.register(plan,
model=model)`` puts USP attention into transformers' ``AttentionInterface``, checks the
model (under SP, one that mixes tokens outside attention is refused before anything
runs) and switches it to USP attention. It is called with this rank's shard of the
tokens, their global ``position_ids``,
``use_cache=False`` and, for packed documents, ``usp_packed=plan.pack(cu_seqlens)``
(``ShardedBatch.hf_kwargs()`` gives all four). The loss comes from
``usp.models.hf.sp_loss`` (never HF's ``labels=``: it shifts inside the shard and
averages per rank). Without ``--model``, rank 0 writes a tiny random Llama checkpoint
to a temporary directory first. Prints the loss before and after one AdamW step, and
the chunked ``causal_lm_loss`` next to ``sp_loss`` (equal up to rounding); exits
non-zero if the ranks disagree on the loss or the two losses differ.
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
import usp.models.hf as usp_hf
from usp.models import IGNORE_INDEX, Llama, shard_batch

DOCUMENTS = [
    "Any model that calls attention through transformers' AttentionInterface works.",
    "Position ids are global; the KV cache is off.",
]


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="examples/configs/cpu_demo.toml")
    parser.add_argument("--model", default=None, help="a local HF causal-LM directory")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    return parser.parse_args()


def byte_batch(plan, vocab_size: int):
    """Packed byte-encoded documents, padded for the layout (pads carry no loss)."""
    docs = [torch.tensor(list(text.encode()), dtype=torch.long) % vocab_size for text in DOCUMENTS]
    lengths = torch.tensor([len(d) for d in docs])
    cu = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)]).to(torch.int32)
    padding = usp.pad_documents(cu, plan)
    tokens = torch.cat(docs)[None]
    ids = padding.apply(tokens, value=0)
    label_source = padding.apply(tokens, value=IGNORE_INDEX)
    return shard_batch(plan, ids, labels=label_source, cu_seqlens=padding.cu_seqlens)


def checkpoint_path(args) -> tuple[str, str | None]:
    if args.model:
        return args.model, None
    path = [None]
    if dist.get_rank() == 0:
        path[0] = tempfile.mkdtemp(prefix="usp-hf-")
        torch.manual_seed(0)
        Llama.from_config("tiny").save_pretrained(path[0])
    dist.broadcast_object_list(path, src=0)
    return path[0], path[0]


def main() -> int:
    import transformers

    args = parse_args()
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    else:
        torch.set_num_threads(1)
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    plan = usp.Plan.from_config(args.config)
    path, temporary = checkpoint_path(args)
    device = plan.default_device()
    model = transformers.AutoModelForCausalLM.from_pretrained(path)
    name = usp_hf.register(plan, model=model)  # checks the model, switches it to USP attention
    model.to(device).train()
    batch = byte_batch(plan, model.config.vocab_size)
    kwargs = {k: v.to(device) if torch.is_tensor(v) else v for k, v in batch.hf_kwargs().items()}
    labels = batch.labels.to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)

    loss = usp_hf.sp_loss(model(**kwargs).logits, labels, plan)
    loss.backward()
    for param in model.parameters():  # replicated over SP: the true gradient is the sum
        dist.all_reduce(param.grad, group=plan.sp_group)
    optimizer.step()
    with torch.no_grad():
        after = usp_hf.sp_loss(model(**kwargs).logits, labels, plan)
        chunked = usp_hf.causal_lm_loss(model, batch, plan, chunk_tokens=16)

    losses = [None] * dist.get_world_size()
    dist.all_gather_object(losses, (loss.item(), after.item()))
    failed = (
        len(set(losses)) != 1
        or not all(math.isfinite(x) for x in losses[0])
        or abs(chunked.item() - after.item()) > 1e-4 * abs(after.item())
    )
    if dist.get_rank() == 0:
        print(f"{plan.describe()}; transformers {transformers.__version__}, "
              f"attn_implementation={name!r}")  # fmt: skip
        print(f"loss {losses[0][0]:.4f} -> {losses[0][1]:.4f} after one step; chunked "
              f"causal_lm_loss {chunked.item():.4f} ({'FAILED' if failed else 'OK'})")  # fmt: skip
    dist.barrier()
    if temporary and dist.get_rank() == 0:
        shutil.rmtree(temporary)
    dist.destroy_process_group()
    return 1 if failed else 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except usp.UspError as err:  # a refused model or input: the message says what to do
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
