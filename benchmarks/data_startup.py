"""Start-up time and per-rank memory of reading a JSONL corpus: every rank tokenising it
(``--mode memory``: what ``usp train`` did before the cache; ``--mode before`` runs the
pre-cache code from git if given with ``--old-module``) against tokenise-once
(``--mode cache``: rank 0 tokenises into the cache, every rank maps it; run it twice to
see a resume, which only maps).

    python benchmarks/data_startup.py --generate /tmp/corpus.jsonl --mb 50
    torchrun --nproc-per-node 4 benchmarks/data_startup.py --data /tmp/corpus.jsonl \
        --mode cache --cache /tmp/usp-cache

Each rank prints one JSON line: seconds to a packed dataset, and the growth of its memory
(over the process after ``import usp``) once every token has been touched (``rss``;
``anon``: private memory; ``pss``: shared pages split among the processes mapping
them), in MiB.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import random
import string
import sys
import time
from pathlib import Path

import torch


def generate(path: Path, megabytes: float, seed: int = 0) -> None:
    rng = random.Random(seed)
    target = int(megabytes * 1e6)
    with open(path, "w") as f:
        written = 0
        while written < target:
            words = " ".join(
                "".join(rng.choices(string.ascii_lowercase, k=rng.randint(2, 9)))
                for _ in range(rng.randint(100, 500))
            )
            line = json.dumps({"prompt": words, "completion": " " + words[:40]}) + "\n"
            f.write(line)
            written += len(line)


def memory_mib() -> dict[str, float]:
    fields = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "RssAnon"):
                fields[key] = int(value.split()[0]) / 1024
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            if line.startswith("Pss:"):
                fields["Pss"] = int(line.split()[1]) / 1024
    return {"rss": fields["VmRSS"], "anon": fields["RssAnon"], "pss": fields.get("Pss", -1)}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--generate", type=Path)
    p.add_argument("--mb", type=float, default=50)
    p.add_argument("--data", type=Path)
    p.add_argument("--mode", choices=("before", "memory", "cache"), default="cache")
    p.add_argument("--old-module", type=Path, help="the pre-cache usp/train/data.py")
    p.add_argument("--cache", type=Path, default=Path("/tmp/usp-data-cache"))
    p.add_argument("--seq-len", type=int, default=4096)
    args = p.parse_args()
    if args.generate:
        generate(args.generate, args.mb)
        print(f"wrote {args.generate} ({args.generate.stat().st_size / 1e6:.1f} MB)")
        return
    torch.set_num_threads(1)
    import torch.distributed as dist

    import usp

    topology = None
    if "RANK" in os.environ:
        dist.init_process_group("gloo")
        topology = usp.build_topology(dist.get_world_size(), 1)
    rank = 0 if topology is None else topology.rank
    if topology is not None:
        dist.barrier()
    baseline = memory_mib()
    started, cpu = time.perf_counter(), time.process_time()
    if args.mode == "before":
        spec = importlib.util.spec_from_file_location("old_data", args.old_module)
        old = importlib.util.module_from_spec(spec)
        sys.modules["old_data"] = old
        spec.loader.exec_module(old)
        docs = old.read_jsonl([args.data], old.ByteTokenizer())
        dataset = old.PackedDataset(
            docs, seq_len=args.seq_len, document_multiple=8, pad_id=0, seed=0
        )
        touched = sum(int(d.tokens.sum()) for d in dataset.documents)
        count = len(docs)
    else:
        from usp.train.data import ByteTokenizer, PackedDataset
        from usp.train.data.build import DataInputs, build_corpus

        inputs = DataInputs(
            ByteTokenizer(),
            (args.data,),
            seq_len=args.seq_len,
            long_documents="truncate",
            document_multiple=8,
            seed=0,
            shuffle=True,
        )
        root = args.cache if args.mode == "cache" else None
        built = build_corpus(inputs, topology=topology, cache_root=root)
        dataset = PackedDataset(
            built.corpus, seq_len=args.seq_len, document_multiple=8, pad_id=0, seed=0
        )
        touched = int(built.corpus.tokens.sum()) + int(built.corpus.target.sum())
        count = len(built.corpus)
    dataset.sequence(0)
    seconds, cpu = time.perf_counter() - started, time.process_time() - cpu
    if topology is not None:
        dist.barrier()
    row = {"mode": args.mode, "rank": rank, "documents": count, "seconds": round(seconds, 2)}
    row["cpu_seconds"] = round(cpu, 2)
    row.update({k: round(v - baseline[k], 1) for k, v in memory_mib().items()})
    print(json.dumps(row), flush=True)
    del touched
    if topology is not None:
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
