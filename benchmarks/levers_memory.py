"""Peak memory of the activation levers: the tiled MLP and activation checkpoint offload.

    python benchmarks/levers_memory.py                    # CPU: one MLP at 8192 tokens
    python benchmarks/levers_memory.py --tokens 16384 --dim 1024 --intermediate 3584
    python benchmarks/levers_memory.py --device cuda --layers 4   # adds the offload rows

MLP rows: forward + backward of one Llama SwiGLU MLP (``usp.models.mlp.MLP``) on
``[1, tokens, dim]`` inputs, untiled and with each ``--tiles`` value. The peak is the
largest number of bytes allocated at once during the step above what was allocated
before it, measured independently of usp: on CPU from ``torch.profiler``'s memory events
(every allocation and free, in order), on CUDA ``torch.cuda.max_memory_allocated``.
It includes the weight gradients (the same in every row) and the input gradient.

Offload rows (CUDA only: on a CPU the "host copy" is in the same memory as everything
else): a ``--layers``-layer model at ``--tokens`` tokens with ``activation_checkpointing``
true and "offload"; device peak over forward + backward, and the loss (equal).
"""

from __future__ import annotations

import argparse
import time

import torch

from usp.models import Levers, Llama, LlamaConfig, shift_labels
from usp.models.levers import tile_mlp
from usp.models.mlp import MLP

MIB = 2**20


def profiled_peak(step) -> int:
    """Bytes: the highest live CPU allocation total during ``step()`` above its start,
    from the profiler's memory events (allocations positive, frees negative)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    live = peak = 0
    for event in sorted(events, key=lambda e: e.start_ns()):
        if event.device_type() == torch.autograd.DeviceType.CPU:
            live += event.nbytes()
            peak = max(peak, live)
    return peak


def peak_bytes(step, device: torch.device) -> int:
    if device.type != "cuda":
        return profiled_peak(step)
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    step()
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - base


def mlp_row(args, tile: int, device) -> dict:
    config = LlamaConfig(
        vocab_size=256,
        hidden_size=args.dim,
        intermediate_size=args.intermediate,
        num_hidden_layers=1,
        num_attention_heads=8,
    )
    torch.manual_seed(0)
    mlp = MLP(config).to(device)
    tile_mlp(mlp, tile)
    x = torch.randn(1, args.tokens, args.dim, device=device, requires_grad=True)
    result = {}

    def step():
        out = mlp(x)
        out.square().mean().backward()
        result["grad"] = x.grad.norm().item()

    start = time.perf_counter()
    peak = peak_bytes(step, device)
    return {"tile": tile, "peak": peak, "seconds": time.perf_counter() - start, **result}


def offload_row(args, mode, device) -> dict:
    config = LlamaConfig(
        vocab_size=1024,
        hidden_size=args.dim,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=16,
        num_key_value_heads=8,
    )
    torch.manual_seed(0)
    model = Llama(config).to(device)
    Levers(activation_checkpointing=mode, loss_chunk_tokens=1024).apply(model)
    ids = torch.randint(0, 1024, (1, args.tokens), device=device)
    labels = shift_labels(ids)
    result = {}

    def step():
        loss = model(ids, labels=labels)
        loss.backward()
        result["loss"] = loss.item()

    return {"mode": mode, "peak": peak_bytes(step, device), **result}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=8192, help="local tokens (S/P)")
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--intermediate", type=int, default=1792)
    parser.add_argument("--tiles", default="4096,1024,256", help="comma list of mlp_tile_tokens")
    parser.add_argument("--layers", type=int, default=4, help="offload rows (CUDA)")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    args = parser.parse_args()
    device = torch.device(args.device)
    torch.set_num_threads(max(1, min(torch.get_num_threads(), 2)))
    inter_mib = args.tokens * args.intermediate * 4 / MIB
    print(f"{device.type}: MLP dim {args.dim} x intermediate {args.intermediate} at "
          f"{args.tokens} tokens, float32; one [tokens, intermediate] tensor is "
          f"{inter_mib:.0f} MiB")  # fmt: skip
    rows = [mlp_row(args, 0, device)] + [
        mlp_row(args, int(t), device) for t in args.tiles.split(",")
    ]
    for row in rows:
        label = "untiled" if row["tile"] == 0 else f"tiles of {row['tile']}"
        print(f"  {label:>16}: peak +{row['peak'] / MIB:7.1f} MiB "
              f"({row['peak'] / rows[0]['peak']:.2f}x), {row['seconds']:5.2f} s, "
              f"|dx| {row['grad']:.6g}")  # fmt: skip
    if device.type == "cuda":
        for mode in (True, "offload"):
            row = offload_row(args, mode, device)
            print(f"  activation_checkpointing={mode!s:>7}: device peak "
                  f"+{row['peak'] / MIB:7.1f} MiB, loss {row['loss']:.6f}")  # fmt: skip


if __name__ == "__main__":
    main()
