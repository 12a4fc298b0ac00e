"""Each of ``usp plan``'s named overheads against this machine's reality (the GPU check's
``overheads`` step): a figure measured above the planner's is a FAILURE -- the planner
was optimistic there -- and the line names the constant to correct.

    python benchmarks/overheads_check.py --out results/      # CUDA: every item below
    python benchmarks/overheads_check.py --device cpu        # the CPU kernel's workspace only

On one GPU:
- **CUDA context**: ``nvidia-smi``'s memory of this process after CUDA starts, a matmul
  and an SDPA call ran, minus ``torch.cuda.memory_reserved()``
  (``overheads.CUDA_CONTEXT_GIB``);
- **NCCL**: ``nvidia-smi``'s per-process memory before and after a one-rank NCCL world
  ran its first all-reduce (``NCCL_GIB["single"]``; communicators of several ranks need
  several GPUs: reported as not measured);
- **attention kernel workspaces**: ``torch.cuda.max_memory_allocated`` of one backward
  call of each CUDA backend (cudnn, flash, efficient) beyond its inputs and outputs,
  against ``overheads.attention_workspace`` (cuDNN's own engine workspace is allowed
  ``CUDNN_ENGINE_SLACK`` on top);
- **allocator reserve**: ``memory_reserved / max_memory_allocated`` of
  ``benchmarks/plan_check.py``'s step (4 layers of Llama-3.1-8B at 64k tokens, one of 8
  ranks on the fake group), with ``expandable_segments`` (usp train's default) and in a
  second process without (``overheads.ALLOCATOR_RESERVE``);
- **pinned rounding**: ``torch.cuda.host_memory_stats`` after pinning 2^30 + 1 bytes
  (the next power of two expected: ``usp.models.offload.pinned_bytes``);
- **rank process host memory**: this process's VmRSS after all of the above
  (``overheads.RANK_PROCESS_HOST_GIB``).
On the CPU: the CPU flash kernel's workspace from torch.profiler's allocator events.
Exit status 1 when any measured figure exceeds the planner's.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

GIB = 2**30
MIB = 2**20
ROOT = Path(__file__).resolve().parents[1]
#: what cuDNN's own engine workspace (``get_workspace_size``) may add to the documented
#: accumulators (assumption: small)
CUDNN_ENGINE_SLACK = 64 * MIB


def _row(name: str, measured: float | None, planned: float, unit: str, constant: str, note=""):
    ok = measured is None or measured <= planned
    return {"item": name, "measured": measured, "planned": planned, "unit": unit,
            "constant": constant, "ok": ok, "note": note}  # fmt: skip


def _nvidia_smi_mib() -> float | None:
    """This process's GPU memory as ``nvidia-smi`` reports it (MiB), None without it."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
            capture_output=True, text=True, timeout=30,
        ).stdout  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    for line in out.splitlines():
        pid, _, used = line.partition(",")
        if pid.strip() == str(os.getpid()):
            return float(used)
    return None


def _rss_gib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024 / GIB
    return 0.0


# ------------------------------------------------------------------ kernels
def _allocated_beyond(fn) -> int:
    """Bytes ``fn`` held at its peak beyond the tensors it returns (torch.profiler's CPU
    allocator events)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = fn()
    running = peak = 0
    for e in sorted(prof.profiler.kineto_results.events(), key=lambda e: e.start_ns()):
        if e.name() == "[memory]":
            running += e.nbytes()
            peak = max(peak, running)
    return peak - sum(t.numel() * t.element_size() for t in out)


def _cpu_call(seqlen: int, heads: int, kv_heads: int, dim: int) -> tuple[int, int]:
    """The CPU flash kernel's own allocations (forward, backward), float32, usp's layout."""
    import torch

    q = torch.randn(1, seqlen, heads, dim).transpose(1, 2)
    k, v = (torch.randn(1, seqlen, kv_heads, dim).transpose(1, 2) for _ in range(2))
    fwd = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    bwd = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
    out, lse = fwd(q, k, v, 0.0, True, scale=0.1)
    dout = torch.randn_like(out)
    forward = _allocated_beyond(lambda: fwd(q, k, v, 0.0, True, scale=0.1))
    backward = _allocated_beyond(lambda: bwd(dout, q, k, v, out, lse, 0.0, True, scale=0.1))
    return forward, backward


def cpu_workspace_rows(shapes=((1024, 8, 2, 64), (300, 4, 4, 128))) -> list[dict]:
    """The CPU flash kernel's allocations against the planner's formula."""
    import torch

    from usp.planner.overheads import attention_workspace

    rows = []
    for seqlen, heads, kv_heads, dim in shapes:
        measured = dict(zip((False, True), _cpu_call(seqlen, heads, kv_heads, dim)))
        shape = dict(batch=1, seqlen_q=seqlen, seqlen_k=seqlen, heads=heads, kv_heads=kv_heads,
                     head_dim=dim, item_bytes=4, threads=torch.get_num_threads())  # fmt: skip
        for backward in (False, True):
            planned = attention_workspace("cpu", backward=backward, **shape)
            kind = "backward" if backward else "forward"
            rows.append(_row(f"cpu {kind} workspace, S={seqlen} H={heads}/{kv_heads} D={dim}",
                             measured[backward] / MIB, planned / MIB, "MiB",
                             "attention_workspace"))  # fmt: skip
    return rows


def cuda_workspace_rows(seqlen: int = 32768) -> list[dict]:
    """One backward call per CUDA backend (bf16, causal, 32 / 8 heads of dim 128): what
    it allocated beyond its inputs and outputs."""
    import torch

    from usp.kernels.backends import registry

    rows = []
    h, hk, d = 32, 8, 128
    for name in ("cudnn", "flash", "efficient"):
        try:
            rows.append(_cuda_workspace_row(registry.get(name), name, seqlen, h, hk, d))
        except Exception as err:  # noqa: BLE001 (reported; the kernel tests judge backends)
            rows.append(_row(f"{name} backward workspace", None, 0, "MiB", "attention_workspace",
                             f"not measured: {type(err).__name__}: {err}"[:300]))  # fmt: skip
        torch.cuda.empty_cache()
    return rows


def _cuda_workspace_row(backend, name: str, seqlen: int, h: int, hk: int, d: int) -> dict:
    import torch

    from usp.kernels import AttentionSpec
    from usp.planner.overheads import attention_workspace

    spec = AttentionSpec(1, seqlen, seqlen, h, hk, d, torch.bfloat16, torch.device("cuda"),
                         True, None)  # fmt: skip
    q = torch.randn(1, seqlen, h, d, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(1, seqlen, hk, d, device="cuda", dtype=torch.bfloat16) for _ in "kv")
    out, lse = backend.forward(q, k, v, spec, d**-0.5)
    dout = torch.randn_like(out)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    grads = backend.backward(dout, q, k, v, out, lse, spec, d**-0.5)
    torch.cuda.synchronize()
    outputs = sum(g.numel() * g.element_size() for g in grads)
    measured = torch.cuda.max_memory_allocated() - before - outputs
    planned = attention_workspace(name, batch=1, seqlen_q=seqlen, seqlen_k=seqlen, heads=h,
                                  kv_heads=hk, head_dim=d, item_bytes=2, backward=True)  # fmt: skip
    # the wrapper's own LSE copy (the planning kernels make it too: it is in the step)
    slack = 2 * 4 * h * seqlen + (CUDNN_ENGINE_SLACK if name == "cudnn" else 0)
    return _row(f"{name} backward workspace (S={seqlen}, GQA 32/8)", measured / MIB,
                (planned + slack) / MIB, "MiB", "attention_workspace")  # fmt: skip


# ------------------------------------------------------------------ the process
def context_and_nccl_rows() -> list[dict]:
    import torch
    import torch.distributed as dist

    from usp.planner.overheads import CUDA_CONTEXT_GIB, NCCL_GIB

    x = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    (x @ x).sum().item()
    q = torch.randn(1, 8, 1024, 128, device="cuda", dtype=torch.bfloat16)
    torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True).sum().item()
    torch.cuda.synchronize()
    smi = _nvidia_smi_mib()
    reserved = torch.cuda.memory_reserved() / MIB
    context = None if smi is None else (smi - reserved) / 1024
    rows = [_row("CUDA context and libraries", context, CUDA_CONTEXT_GIB, "GiB",
                 "CUDA_CONTEXT_GIB", "" if smi is not None else "nvidia-smi unavailable")]  # fmt: skip
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29531")
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
    before = _nvidia_smi_mib()
    t = torch.ones(1024, device="cuda")
    dist.all_reduce(t)
    torch.cuda.synchronize()
    after = _nvidia_smi_mib()
    nccl = None if before is None or after is None else (after - before) / 1024
    rows.append(_row("NCCL one-rank communicator", nccl, NCCL_GIB["single"], "GiB",
                     'NCCL_GIB["single"]', "communicators of several ranks: not measurable "
                     "on one GPU"))  # fmt: skip
    dist.destroy_process_group()
    return rows


def pinned_rows() -> list[dict]:
    import torch

    from usp.models.offload import pinned_bytes

    def reserved() -> int | None:
        stats = torch.cuda.host_memory_stats()
        keys = [k for k in stats if "reserved_bytes" in k and k.endswith("current")]
        return int(stats[keys[0]]) if keys else None

    before = reserved()
    block = torch.empty(GIB + 1, dtype=torch.uint8, pin_memory=True)
    after = reserved()
    del block
    if before is None or after is None:
        return [_row("pinned block of 2^30 + 1 bytes", None, pinned_bytes(GIB + 1) / MIB,
                     "MiB", "pinned_bytes", "host_memory_stats has no reserved bytes")]  # fmt: skip
    measured = (after - before) / MIB
    return [_row("pinned block of 2^30 + 1 bytes", measured, pinned_bytes(GIB + 1) / MIB, "MiB",
                 "pinned_bytes")]  # fmt: skip


def allocator_rows() -> list[dict]:
    """plan_check's step with expandable segments (this process) and without (a child)."""
    from usp.planner.overheads import ALLOCATOR_RESERVE

    rows = []
    for setting, conf in (("expandable_segments", "expandable_segments:True"),
                          ("fixed_segments", "expandable_segments:False")):  # fmt: skip
        code = (
            "import json, torch; from benchmarks import plan_check; plan_check.main([]); "
            "print(json.dumps([torch.cuda.max_memory_reserved(), "
            "torch.cuda.max_memory_allocated()]))"
        )
        env = {**os.environ, "PYTORCH_CUDA_ALLOC_CONF": conf}
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              env=env, timeout=300, cwd=ROOT)  # fmt: skip
        try:
            reserved, peak = json.loads(done.stdout.strip().splitlines()[-1])
            ratio = reserved / peak - 1
        except (ValueError, IndexError):
            ratio, done_note = None, f"the step failed: {done.stderr[-300:]}"
        else:
            done_note = ""
        rows.append(_row(f"allocator reserve ({setting})", ratio, ALLOCATOR_RESERVE[setting],
                         "of the peak", f'ALLOCATOR_RESERVE["{setting}"]', done_note))  # fmt: skip
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    p.add_argument("--out", type=Path, help="write overheads_check.json here")
    args = p.parse_args(argv)
    import torch

    from usp.planner.overheads import RANK_PROCESS_HOST_GIB

    cuda = torch.cuda.is_available() and args.device != "cpu"
    if args.device == "cuda" and not cuda:
        raise SystemExit("overheads_check: --device cuda but CUDA is not available")
    rows = cpu_workspace_rows()
    if cuda:
        from usp.config.allocator import set_allocator_default

        set_allocator_default()  # as usp train does, before CUDA starts
        rows += context_and_nccl_rows() + cuda_workspace_rows() + pinned_rows()
        rows += allocator_rows()
        rows.append(_row("rank process host memory (VmRSS)", _rss_gib(), RANK_PROCESS_HOST_GIB,
                         "GiB", "RANK_PROCESS_HOST_GIB"))  # fmt: skip
    for r in rows:
        measured = "not measured" if r["measured"] is None else f"{r['measured']:.3f}"
        verdict = "ok" if r["ok"] else f"FAILED: raise {r['constant']}"
        print(f"{r['item']}: measured {measured} {r['unit']}, planned {r['planned']:.3f} "
              f"{r['unit']}: {verdict} {r['note']}".rstrip())  # fmt: skip
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "overheads_check.json").write_text(json.dumps(rows, indent=2) + "\n")
    failed = [r["item"] for r in rows if not r["ok"]]
    if failed:
        print(f"overheads_check: FAILED (the planner is optimistic): {', '.join(failed)}")
        return 1
    print(f"overheads_check: {len(rows)} items within the planner's figures")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
