"""The memory levers' table from the planner: device and host GiB per rank, per lever.

    python benchmarks/levers_plan.py examples/configs/llama3_8b_1m.toml \\
        --seq-lens 1048576,4194304 --grid 1x8

For every lever set the planner searches on the grid (``usp.planner.search.lever_options``;
``--attention-head-chunks`` sets the head chunks of every row), one rank's step on the grid ``--grid``
(ulysses x ring, dp 1) is measured by the planner (``measure_scaled``: fake tensors, two
shallow depths extrapolated to the model's) at each ``--seq-lens`` length, and the
longest sequence that fits on that grid is searched (``search.max_seq_len``, as ``usp
plan`` does, restricted to the one grid). Fits = the device peak plus the planner's
named overheads (``usp.planner.overheads``) within the config's GPU. The rows are returned by :func:`main` (and printed as markdown).
"""

from __future__ import annotations

import argparse

GIB = 2**30


def _cluster(job, gpu_memory_gib: float | None, host_memory_gib: float | None = None):
    from usp.planner import search

    c = job.topology.cluster
    gpu = search.DEFAULT_GPU if c.gpu == "auto" else c.gpu
    memory = gpu_memory_gib or search.GPU_MEMORY_GIB[gpu]
    host = host_memory_gib or search.DEFAULT_HOST_MEMORY_GIB
    return search.Cluster(c.nodes, c.gpus_per_node, memory, host, gpu=gpu)


def rows(
    config: str,
    seq_lens: list[int],
    grid: tuple[int, int],
    device: str = "cuda",
    gpu_memory_gib: float | None = None,
    head_chunks: int | None = None,
    only: list[tuple] | None = None,
    offload: str | None = None,
    host_memory_gib: float | None = None,
):
    from usp.planner import search
    from usp.planner.footprint import Choice, Target
    from usp.train.components import model_source
    from usp.train.config import load_train_config

    job = load_train_config(config, seq_len=max(seq_lens))
    cluster = _cluster(job, gpu_memory_gib, host_memory_gib)
    model = model_source(job).config
    target = Target(job, model, cluster.world_size, cluster.gpus_per_node, device)
    cache: dict = {}
    out = []
    options = search.lever_options(model, (*grid, 1), cluster.gpus_per_node)
    if head_chunks is not None:
        options = list(dict.fromkeys(o.replace(attention_head_chunks=head_chunks) for o in options))
    for levers in options:
        checkpointing, tile = levers.activation_checkpointing, levers.mlp_tile_tokens
        if only is not None and (checkpointing, tile) not in only:
            continue
        if offload is not None and levers.offload != offload:
            continue
        choice = Choice(grid[0], grid[1], 1, levers)
        row = {"activation_checkpointing": checkpointing, "mlp_tile_tokens": tile,
               "attention_head_chunks": levers.attention_head_chunks,
               "offload": levers.offload}  # fmt: skip
        for s in seq_lens:
            fp = search._footprint_at(target, choice, cache, s)
            row[s] = (fp.peak_device / GIB, fp.peak_host / GIB, fp.breakdown)
        row["longest"] = search.max_seq_len(target, [choice], cluster, cache)[0]
        if row["longest"]:  # what the GPU holds there, line by line (measured already)
            at = search.evaluate(target.at(row["longest"]), choice, cluster, cache)
            row["at_longest"] = [(i.name, i.nbytes / GIB, i.added) for i in at.items()]
            row["at_longest_step_gib"] = at.peak_device_gib
        out.append(row)
    return out


def markdown(table, seq_lens) -> str:
    def tokens(s):
        return f"{s // 2**20}M" if s % 2**20 == 0 else f"{s:,}"

    head = ["activation_checkpointing", "mlp_tile_tokens", "attention_head_chunks", "offload"]
    for s in seq_lens:
        head += [f"{tokens(s)}: device GiB", f"{tokens(s)}: host GiB"]
    lines = ["| " + " | ".join(head + ["longest that fits"]) + " |"]
    lines.append("|" + "---|" * (len(head) + 1))
    for row in table:
        ac = row["activation_checkpointing"]
        cells = ['"offload"' if ac == "offload" else str(ac).lower(), str(row["mlp_tile_tokens"]),
                 str(row["attention_head_chunks"]), row["offload"]]  # fmt: skip
        for s in seq_lens:
            device, host, _ = row[s]
            cells += [f"{device:.1f}", f"{host:.1f}"]
        cells.append(f"{row['longest']:,}" if row["longest"] else "none")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("config")
    p.add_argument("--seq-lens", default="1048576,4194304")
    p.add_argument("--grid", default="1x8", help="ulysses x ring")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--gpu-memory-gib", type=float, help="default: the config's GPU's")
    p.add_argument("--attention-head-chunks", type=int, help="the head chunks of every row")
    p.add_argument("--only", help='options to run, e.g. "offload:8192,true:0" (default: every one)')
    p.add_argument("--offload", choices=["none", "optimizer", "parameters"],
                   help="only the options with this training-state offload")  # fmt: skip
    p.add_argument("--host-memory-gib", type=float, help="per node (default: the planner's)")
    args = p.parse_args(argv)
    seq_lens = [int(s) for s in args.seq_lens.split(",")]
    u, r = (int(x) for x in args.grid.split("x"))
    only = None
    if args.only:
        names = {"true": True, "false": False, "offload": "offload"}
        only = [(names[a], int(t)) for a, t in (o.split(":") for o in args.only.split(","))]
    table = rows(
        args.config, seq_lens, (u, r), args.device, args.gpu_memory_gib,
        args.attention_head_chunks, only, args.offload, args.host_memory_gib,
    )  # fmt: skip
    print(markdown(table, seq_lens))
    for row in table:
        if row.get("at_longest"):
            items = ", ".join(f"{n} {g:.2f}" + ("" if a else " (in the step)")
                              for n, g, a in row["at_longest"])  # fmt: skip
            print(f"at {row['longest']:,}: step {row['at_longest_step_gib']:.2f} GiB; {items}")
        _, _, parts = row[max(seq_lens)]
        print(f"{row['activation_checkpointing']!s:>7} {row['mlp_tile_tokens']:>5}: at "
              f"{max(seq_lens):,}: " + ", ".join(f"{k} {v / GIB:.1f}" for k, v in parts.items() if v))  # fmt: skip
    return table


if __name__ == "__main__":
    main()
