"""Peak memory of the loss: chunked (``usp.models`` default) against one unchunked pass.

    python benchmarks/loss_memory.py                      # CPU: peak RSS per run
    python benchmarks/loss_memory.py --device cuda --tokens 65536 --dim 4096 --dtype bfloat16
    python benchmarks/loss_memory.py --fake --tokens 131072 --dim 4096 --dtype bfloat16 --chunks 1024

Each configuration runs forward + backward of :func:`usp.models.sp_cross_entropy`
(final hidden states [tokens, dim] x output projection [vocab, dim] -> mean
cross-entropy) in a fresh subprocess. CPU: the growth of the process's peak resident
memory (``ru_maxrss``) over what it held once the inputs existed; CUDA:
``torch.cuda.max_memory_allocated`` over the inputs. Both include the weight gradient
([vocab, dim], the same in every configuration) and the hidden-state gradient.
Prints one line per chunk size, plus the size of the full logits for comparison.

``--fake``: what ``usp plan`` sees instead. The same forward + backward under
``FakeTensorMode`` (no memory, no arithmetic; every label counts) with torch's
``MemTracker`` counting every allocation: its peak in bytes and the host seconds, once
with every chunk run and once inside :func:`usp.models.tiling.representative_tiles`
(memory-periodic loops run their first and last chunk only), after one untimed warm-up
run (fake tensors cache dispatch by shapes), the fastest of 3 runs. The two peaks must
be equal; the script exits non-zero if they are not.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from contextlib import nullcontext

import torch

from usp.models import sp_cross_entropy
from usp.planner.measure import AllLabelledFakeMode

MIB = 2**20


def measure(tokens: int, dim: int, vocab: int, chunk: int | None, dtype: str, device: str) -> dict:
    """One configuration, in this process (called in a subprocess)."""
    torch.manual_seed(0)
    torch_dtype = getattr(torch, dtype)
    hidden = (torch.randn(1, tokens, dim, device=device) * dim**-0.5).to(torch_dtype)
    weight = (torch.randn(vocab, dim, device=device) * dim**-0.5).to(torch_dtype)
    hidden.requires_grad_(), weight.requires_grad_()
    labels = torch.randint(0, vocab, (1, tokens), device=device)
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # bytes (Linux: KiB)
    start = time.perf_counter()
    loss = sp_cross_entropy(hidden, weight, labels, chunk_tokens=chunk)
    loss.backward()
    if device == "cuda":
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base
    return {"chunk": chunk, "peak_mib": peak / MIB, "seconds": time.perf_counter() - start,
            "loss": loss.item()}  # fmt: skip


def measure_fake(tokens: int, dim: int, vocab: int, chunk: int | None, dtype: str, device: str,
                 representative: bool) -> dict:  # fmt: skip
    """Peak bytes (``MemTracker``) and host seconds of fwd+bwd under fake tensors."""
    from torch.distributed._tools.mem_tracker import MemTracker

    from usp.models.tiling import representative_tiles

    torch_dtype = getattr(torch, dtype)
    mode = representative_tiles() if representative else nullcontext()
    with mode, AllLabelledFakeMode():
        hidden = torch.empty(1, tokens, dim, device=device, dtype=torch_dtype, requires_grad=True)
        weight = torch.empty(vocab, dim, device=device, dtype=torch_dtype, requires_grad=True)
        labels = torch.zeros(1, tokens, device=device, dtype=torch.int64)
        tracker = MemTracker()
        start = time.perf_counter()
        with tracker:
            sp_cross_entropy(hidden, weight, labels, chunk_tokens=chunk).backward()
        seconds = time.perf_counter() - start
        peak = tracker.get_tracker_snapshot("peak")
    total = sum(int(snap.get("Total", 0)) for snap in peak.values())
    return {"chunk": chunk, "representative": representative, "peak_bytes": total,
            "seconds": seconds}  # fmt: skip


def main_fake(args) -> None:
    print(f"fake tensors ({args.device}, {args.dtype}): {args.tokens} tokens x dim {args.dim} "
          f"x vocab {args.vocab}, forward + backward under MemTracker")  # fmt: skip
    for chunk in args.chunks.split(","):
        chunk = None if chunk.strip() == "none" else int(chunk)
        label = "unchunked" if chunk is None else f"chunks of {chunk}"
        # warm-up, not reported: the first run at these shapes fills fake tensors' dispatch
        # cache (keyed by shapes), which makes a second run at the same shapes faster
        measure_fake(args.tokens, args.dim, args.vocab, chunk, args.dtype, args.device, False)
        rows = []
        for representative in (False, True):
            runs = [measure_fake(args.tokens, args.dim, args.vocab, chunk, args.dtype,
                                 args.device, representative) for _ in range(3)]  # fmt: skip
            if len({run["peak_bytes"] for run in runs}) != 1:
                raise SystemExit(f"{label}: the peak differs between repeats: {runs}")
            rows.append(min(runs, key=lambda run: run["seconds"]))  # the least disturbed
        for row in rows:
            mode = "representative" if row["representative"] else "every chunk"
            print(f"  {label:>16}, {mode:>14}: peak {row['peak_bytes']:,} bytes "
                  f"({row['peak_bytes'] / MIB:,.0f} MiB), {row['seconds']:6.2f} s")  # fmt: skip
        if rows[0]["peak_bytes"] != rows[1]["peak_bytes"]:
            raise SystemExit(f"{label}: representative tiles changed the peak: {rows}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=2048, help="local tokens (S/P)")
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=128256, help="Llama-3's vocabulary")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--chunks", default="none,1024,256", help="comma list; none = unchunked")
    parser.add_argument("--fake", action="store_true", help="under fake tensors (usp plan)")
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)  # subprocess mode
    args = parser.parse_args()
    if args.fake:
        main_fake(args)
        return
    if args.one is not None:
        chunk = None if args.one == "none" else int(args.one)
        print(
            json.dumps(measure(args.tokens, args.dim, args.vocab, chunk, args.dtype, args.device))
        )
        return
    logits_mib = args.tokens * args.vocab * torch.finfo(getattr(torch, args.dtype)).bits / 8 / MIB
    print(f"{args.device}, {args.dtype}: {args.tokens} tokens x dim {args.dim} x vocab {args.vocab}; "
          f"the full logits alone are {logits_mib:.0f} MiB ({args.dtype}), "
          f"{args.tokens * args.vocab * 4 / MIB:.0f} MiB in float32")  # fmt: skip
    results = []
    for chunk in args.chunks.split(","):
        command = [sys.executable, __file__, *sys.argv[1:], "--one", chunk.strip()]
        out = subprocess.run(command, check=True, capture_output=True, text=True).stdout
        result = json.loads(out.strip().splitlines()[-1])
        results.append(result)
        label = "unchunked" if result["chunk"] is None else f"chunks of {result['chunk']}"
        print(f"  {label:>16}: peak +{result['peak_mib']:8.0f} MiB, {result['seconds']:6.2f} s "
              f"fwd+bwd, loss {result['loss']:.6f}")  # fmt: skip
    losses = {round(r["loss"], 4) for r in results}
    if len(losses) != 1:
        raise SystemExit(f"the chunk sizes disagree on the loss: {sorted(losses)}")


if __name__ == "__main__":
    main()
