"""usp next to its peers: one rank of the same sequence-parallel attention job, side by side.

    python benchmarks/peers.py [--out results/]                 # the default comparison
    python benchmarks/peers.py --seqlen 262144 --sp 8 --grids 1x8 2x4 --out results/

In one process, under PyTorch's ``fake`` process group (``emulate.fake_world``: this
process is rank 0 of a world of P ranks, collectives return at once), each peer runs the
forward and backward of causal attention on the same shapes and the same tokens per rank:

- ``usp``: ``usp.usp_attention`` (zigzag layout) on every requested (ulysses, ring) grid.
- ``torch-cp``: PyTorch's native context parallel, ``context_parallel(mesh, buffers=...)``
  around ``F.scaled_dot_product_attention`` (its SDPA ring, head-tail load balancing =
  zigzag), for every SDPA backend and rotate method (``set_rotate_method``) asked for.
  Its dispatch has no CPU kernel; on CPU the row says so and is skipped.
- ``torch-cp-ring`` (CPU only): the ring ``context_parallel`` dispatches to, torch's
  private ``_templated_ring_attention`` forward and backward, driven directly with the
  CPU flash kernel: the same algorithm, balancing, rotation and merge, without the
  DTensor dispatch. It is what can run of torch CP on CPU.
- ``ring-flash-attn``: ``ring_flash_attn.zigzag_ring_flash_attn_func`` (needs flash-attn,
  so CUDA).
- ``yunchang``: ``LongContextAttention(ring_impl_type="zigzag", attn_type=FA)`` on every
  grid (needs flash-attn for a backward, so CUDA).

A peer that cannot run here gives a row marked ``skipped`` with the reason; a peer that
raises gives a row marked ``failed`` with the error, and the script exits non-zero.

Per row: forward + backward time of the rank (median of ``--repeats`` after
``--warmup``), efficiency = (monolithic / P) / per-rank time, where monolithic is one
attention call over the whole sequence with the same kernel class (usp: the same usp
backend; torch: the same SDPA backend, K/V expanded the same way; ring-flash-attn and
yunchang: ``flash_attn_func``); peak memory (CUDA only); and the bytes this rank sends,
counted for every peer alike by intercepting the collectives it issues (a
``TorchDispatchMode`` over the ``c10d`` and functional-collective ops), with usp's own
``Topology.comm_stats`` next to it as a check.

Nothing here measures real communication: see ``emulate.py`` and benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as `python benchmarks/peers.py`: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import emulate  # noqa: E402
from benchmarks.peer_cases import PEERS, Peer, Setup  # noqa: E402
from benchmarks.peer_results import fmt, markdown, run_peer, setup_text  # noqa: E402


# ------------------------------------------------------------------ which rows
def ring_peers(args, sp: int) -> list[Peer]:
    """The peers that only know a ring: one ring of all P ranks."""
    rows = []
    if "torch-cp" in args.peers:
        for kernel in args.torch_backends:
            rows += [Peer("torch-cp", 1, sp, rotate, kernel) for rotate in args.torch_rotates]
    if "torch-cp-ring" in args.peers:
        rows += [Peer("torch-cp-ring", 1, sp, rotate, "flash") for rotate in args.torch_rotates]
    if "ring-flash-attn" in args.peers:
        rows.append(Peer("ring-flash-attn", 1, sp, "zigzag", "flash-attn"))
    return rows


def peers_of(args, sp: int) -> list[Peer]:
    """usp and yunchang on every grid; the ring-only peers next to the 1 x P grid (first
    when that grid is not asked for)."""
    rows = [] if (1, sp) in args.grids else ring_peers(args, sp)
    for u, r in args.grids:
        if "usp" in args.peers:
            for impl in args.usp_ring_impls if r > 1 else ["-"]:
                rows.append(Peer("usp", u, r, impl, args.usp_backend))
        if (u, r) == (1, sp):
            rows += ring_peers(args, sp)
        if "yunchang" in args.peers:
            rows.append(Peer("yunchang", u, r, "zigzag", "flash-attn"))
    return rows


def default_grids(sp: int, cuda: bool) -> list[tuple[int, int]]:
    """The pure ring (what torch CP and ring-flash-attn do) and one hybrid grid: ulysses 4
    on a GPU (a Llama-3 GQA group), 2 on CPU (the tiny preset has 2 KV heads)."""
    ulysses = math.gcd(sp, 4 if cuda else 2)
    return [(1, sp)] + ([(ulysses, sp // ulysses)] if ulysses > 1 else [])


def parse_args(argv, device: torch.device):
    cuda = device.type == "cuda"
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--preset", choices=sorted(emulate.PRESETS), default="llama3-8b" if cuda else "tiny"
    )
    p.add_argument(
        "--seqlen", type=int, default=131072 if cuda else 512, help="tokens of the sequence"
    )
    p.add_argument("--sp", type=int, default=8 if cuda else 4, help="sequence-parallel ranks P")
    p.add_argument(
        "--grids",
        type=emulate.parse_grid,
        nargs="+",
        default=None,
        help="usp/yunchang (ulysses, ring) grids as UxR (default: 1xP and one hybrid)",
    )
    p.add_argument("--peers", nargs="+", choices=PEERS, default=None)
    p.add_argument("--usp-backend", default="cudnn" if cuda else "cpu")
    p.add_argument(
        "--usp-ring-impls", nargs="+", choices=["p2p", "allgather"], default=["p2p", "allgather"]
    )
    p.add_argument(
        "--torch-backends",
        nargs="+",
        choices=["cudnn", "flash", "efficient"],
        default=["cudnn", "flash"] if cuda else ["flash"],
        help="SDPA backends for torch-cp (CPU: the CPU flash kernel)",
    )
    p.add_argument(
        "--torch-rotates",
        nargs="+",
        choices=["allgather", "alltoall"],
        default=["allgather", "alltoall"],
    )
    p.add_argument("--dtype", choices=sorted(emulate.DTYPES), default="bf16" if cuda else "fp32")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument(
        "--ranks-per-node", type=int, default=None, help="for usp's topology (default min(8, P))"
    )
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=5 if cuda else 3)
    p.add_argument("--monolithic-repeats", type=int, default=3)
    p.add_argument("--max-monolithic-tokens", type=int, default=65536)
    p.add_argument("--out", type=Path, default=None, help="directory for peers.json and peers.md")
    args = p.parse_args(argv)
    if args.peers is None:  # the CPU stand-in only where the real torch-cp cannot run
        args.peers = [n for n in PEERS if not (cuda and n == "torch-cp-ring")]
    if args.grids is None:
        args.grids = default_grids(args.sp, cuda)
    for u, r in args.grids:
        if u * r != args.sp:
            p.error(f"grid {u}x{r}: ulysses * ring = {u * r} != --sp {args.sp}")
    return args


def main(argv: list[str] | None = None) -> list[dict]:
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    args = parse_args(argv, device)
    setup = Setup(
        preset=args.preset,
        seqlen=args.seqlen,
        sp=args.sp,
        dtype=args.dtype,
        batch=args.batch,
        ranks_per_node=args.ranks_per_node or min(8, args.sp),
        device=device,
        warmup=args.warmup,
        repeats=args.repeats,
        monolithic_repeats=args.monolithic_repeats,
        max_monolithic_tokens=args.max_monolithic_tokens,
    )
    rows, references = [], {}
    for peer in peers_of(args, setup.sp):
        row = run_peer(peer, setup, references)
        shown = fmt(row.get("fwd_bwd_ms"))
        print(f"{peer.label()}: {row['status']} {shown} ms {row['reason'] or ''}", flush=True)
        rows.append(row)
    text = markdown(setup, rows)
    print(text)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        payload = {"setup": setup_text(setup, rows), "rows": rows}
        (args.out / "peers.json").write_text(json.dumps(payload, indent=1, default=str))
        (args.out / "peers.md").write_text(text + "\n")
    return rows


if __name__ == "__main__":
    sys.exit(1 if any(r["status"] == "failed" for r in main()) else 0)
