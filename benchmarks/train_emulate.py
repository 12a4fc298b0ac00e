"""One rank's whole training step of a Llama-3 model on one device, under the ``fake``
process group.

    python benchmarks/train_emulate.py                        # Llama-3.1-8B, 128k tokens, 2x8 GPUs
    python benchmarks/train_emulate.py --layers 8             # fewer layers, extrapolated
    python benchmarks/train_emulate.py --preset tiny --seqlen 512 --world 4 --ulysses 2 --ring 2

What runs is exactly what ``usp train`` runs on one rank of ``--world`` ranks: the model
built on the meta device and sharded with FSDP2 over the ``dp x sp`` mesh (bf16 compute,
fp32 master weights and reduction on CUDA), this rank's ``seqlen / (ulysses * ring)``
tokens, USP attention, the chunked SP loss, backward with activation checkpointing,
gradient-norm clipping and an AdamW step. PyTorch's ``fake`` backend makes every
collective return at once (FSDP's all-gathers deliver uninitialised memory, which does
not change kernel time), so the time is this rank's compute and memory traffic only; no
communication is measured or modelled here (``benchmarks/emulate.py`` accounts the
attention's bytes).

Reported: step time, tokens/s per GPU (this rank's tokens / step time), MFU (this rank's
share of the model FLOPs, activation recomputation not counted, over the device's bf16
peak) and peak memory. ``--layers L`` builds only ``L`` decoder layers (real shapes) and
extrapolates the step time to the preset's depth by FLOPs, i.e. at the measured FLOP/s;
MFU is reported as measured. Peak memory is the measured one, for ``L`` layers, plus an
estimate for the rest: per extra layer, its FSDP shard of fp32 parameters, gradients and
two Adam moments, and one checkpointed layer input.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

import usp
from usp.models import PRESETS, Levers, Llama, shift_labels, training_flops
from usp.process_groups.fake import fake_world
from usp.train.metrics import peak_tflops
from usp.train.parallelize import fully_shard_model

GIB = 2**30
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def _randomise(model: torch.nn.Module, seed: int) -> None:
    """Values for the sharded parameters after ``to_empty`` (they only need to be finite),
    drawn on the device."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            (p.to_local() if hasattr(p, "to_local") else p).normal_(0.0, 0.02)


def build(args, device: torch.device):
    """Topology, plan, sharded model, optimizer and this rank's batch."""
    topo = usp.build_topology(
        args.ulysses, args.ring, ranks_per_node=args.ranks_per_node, device_type=device.type
    )
    plan = usp.Plan(topo, layout=args.layout, backend=args.backend, verify_calls=False)
    full = PRESETS[args.preset]
    config = full.replace(num_hidden_layers=args.layers or full.num_hidden_layers)
    with torch.device("meta"):
        model = Llama(config, plan)
    levers = Levers(activation_checkpointing=not args.no_activation_checkpointing)
    levers.apply(model)
    sharded = fully_shard_model(model, topo, levers=levers, compute_dtype=DTYPES[args.dtype])
    model.to_empty(device=device)
    _randomise(model, seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, weight_decay=0.1)
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, config.vocab_size, (1, args.seqlen), generator=gen)
    labels = shift_labels(tokens)
    batch = (plan.shard(tokens).to(device), plan.shard(labels).to(device))  # [1, S/P] each
    return topo, model, sharded.loss_scale, optimizer, batch, config, full


def train_step(model, loss_scale, optimizer, batch) -> None:
    input_ids, labels = batch
    loss = model(input_ids, labels=labels)
    (loss * loss_scale).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(args, device: torch.device) -> dict:
    with fake_world(args.world, args.rank, device):
        topo, model, scale, optimizer, batch, config, full = build(args, device)
        try:
            for _ in range(args.warmup):
                train_step(model, scale, optimizer, batch)
            _sync(device)
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            times = []
            for _ in range(args.repeats):
                start = time.perf_counter()
                train_step(model, scale, optimizer, batch)
                _sync(device)
                times.append(time.perf_counter() - start)
            peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
        finally:
            topo.destroy()
    return report(args, device, config, full, min(times), peak)


def report(args, device, config, full, seconds: float, peak_bytes: int | None) -> dict:
    sp = args.ulysses * args.ring
    local_tokens = args.seqlen // sp
    # this rank's share: zigzag gives every SP rank the same causal attention work
    flops = training_flops(config, [args.seqlen]) / sp
    flops_full = training_flops(full, [args.seqlen]) / sp
    seconds_full = seconds * flops_full / flops
    peak_tf = args.peak_tflops or (
        peak_tflops(torch.cuda.get_device_name(device)) if device.type == "cuda" else None
    )
    row = {
        "preset": args.preset,
        "layers_measured": config.num_hidden_layers,
        "layers_full": full.num_hidden_layers,
        "seqlen": args.seqlen,
        "world": args.world,
        "ulysses": args.ulysses,
        "ring": args.ring,
        "rank": args.rank,
        "local_tokens": local_tokens,
        "dtype": args.dtype,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "step_s": seconds,
        "step_s_full": seconds_full,
        "tokens_per_s_per_gpu": local_tokens / seconds_full,
        "tflops_per_s": flops / seconds / 1e12,
        "mfu": flops / seconds / (peak_tf * 1e12) if peak_tf else None,
    }
    if peak_bytes is not None:
        extra_layers = full.num_hidden_layers - config.num_hidden_layers
        per_layer = _layer_bytes(full, args.world, local_tokens)
        row["peak_memory_gib"] = peak_bytes / GIB
        row["peak_memory_gib_full_estimate"] = (peak_bytes + extra_layers * per_layer) / GIB
    return row


def _layer_bytes(config, world: int, local_tokens: int) -> int:
    """Per decoder layer that stays resident: its FSDP shard of fp32 parameters,
    gradients and two Adam moments (16 bytes per parameter), and the checkpointed bf16
    layer input of this rank's tokens."""
    h, hd = config.hidden_size, config.attention_head_dim
    q, kv = config.num_attention_heads * hd, config.num_key_value_heads * hd
    params = h * (q + 2 * kv) + q * h + 3 * h * config.intermediate_size + 2 * h
    return 16 * params // world + 2 * local_tokens * h


def format_row(row: dict) -> str:
    scaled = row["layers_measured"] != row["layers_full"]
    lines = [
        f"{row['preset']}: {row['seqlen']} tokens on {row['world']} ranks "
        f"(ulysses {row['ulysses']} x ring {row['ring']}), rank {row['rank']} holds "
        f"{row['local_tokens']} tokens; {row['dtype']} on {row['device']}, fake process group",
        f"  step time      {row['step_s']:.3f} s with {row['layers_measured']} layers"
        + (
            f" -> {row['step_s_full']:.3f} s at {row['layers_full']} layers (scaled by FLOPs)"
            if scaled
            else ""
        ),
        f"  tokens/s/GPU   {row['tokens_per_s_per_gpu']:,.0f}"
        + (f" (at {row['layers_full']} layers)" if scaled else ""),
        f"  achieved       {row['tflops_per_s']:.3g} TFLOP/s"
        + (f", MFU {100 * row['mfu']:.1f}%" if row["mfu"] is not None else ""),
    ]
    if "peak_memory_gib" in row:
        lines.append(
            f"  peak memory    {row['peak_memory_gib']:.1f} GiB"
            + (
                f" ({row['layers_measured']} layers); about "
                f"{row['peak_memory_gib_full_estimate']:.1f} GiB at {row['layers_full']}"
                if scaled
                else ""
            )
        )
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    cuda = torch.cuda.is_available()
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default="llama3.1-8b" if cuda else "tiny")
    p.add_argument(
        "--layers", type=int, default=None, help="decoder layers to build (default: all)"
    )
    p.add_argument("--seqlen", type=int, default=131072 if cuda else 512, help="global tokens")
    p.add_argument("--world", type=int, default=16 if cuda else 4)
    p.add_argument("--ulysses", type=int, default=8 if cuda else 2)
    p.add_argument("--ring", type=int, default=2)
    p.add_argument("--ranks-per-node", type=int, default=8 if cuda else 4)
    p.add_argument("--rank", type=int, default=0, help="the rank this process plays")
    p.add_argument("--layout", choices=["zigzag", "contiguous"], default="zigzag")
    p.add_argument("--backend", default="auto", help="attention kernel backend")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16" if cuda else "fp32")
    p.add_argument("--no-activation-checkpointing", action="store_true")
    p.add_argument("--device", default="cuda" if cuda else "cpu")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--repeats", type=int, default=3 if cuda else 2)
    p.add_argument("--peak-tflops", type=float, default=None, help="bf16 peak of the device")
    p.add_argument("--json", type=Path, default=None, help="also write the result here")
    args = p.parse_args(argv)
    full = PRESETS[args.preset].num_hidden_layers
    if args.layers is not None and not 1 <= args.layers <= full:
        p.error(f"--layers must be in [1, {full}] for {args.preset}")
    if args.world % (args.ulysses * args.ring):
        p.error(f"--world {args.world} is not a multiple of ulysses * ring")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    device = torch.device(args.device)
    row = measure(args, device)
    print(format_row(row))
    if args.json is not None:
        args.json.write_text(json.dumps(row, indent=2) + "\n")
    return row


if __name__ == "__main__":
    main()
