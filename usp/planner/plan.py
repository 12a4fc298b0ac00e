""":func:`plan`: a config and a cluster in, a ranked :class:`PlanResult` out (what
``usp plan`` prints)."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch

from usp.config import AUTO, ConfigError
from usp.errors import HeadLayoutError
from usp.models import model_counts
from usp.models.config import read_config_json
from usp.models.hf_multimodal_checks import encoder_sub_configs
from usp.planner import search
from usp.planner.footprint import Target
from usp.planner.hardware import (
    ATTENTION_TFLOPS,
    CPU_TFLOPS,
    GEMM_TFLOPS,
    MAX_MEMORY_GIB,
    MAX_ROW_TOKENS,
    MAX_WORLD,
)
from usp.planner.kernels import planning_backend
from usp.planner.overheads import NCCL_SETTINGS
from usp.planner.placement import Machine, mix_steps, mix_totals
from usp.planner.pool import Measurements
from usp.planner.report import PlanResult, measurement_line, progress_intro
from usp.train.components import build_dataset, model_source
from usp.train.config import load_train_config


def _cluster(job, nodes, gpus_per_node, gpu_memory_gib, host_memory_gib, device):
    c = job.topology.cluster
    nodes = nodes or c.nodes
    gpus = gpus_per_node or c.gpus_per_node
    if nodes == AUTO or gpus == AUTO:
        raise job.error(
            f"[cluster] nodes = {nodes!r}, gpus_per_node = {gpus!r}: the plan needs numbers; "
            "give --nodes and --gpus-per-node"
        )
    gpu = search.DEFAULT_GPU if c.gpu == AUTO else c.gpu
    host = host_memory_gib or search.DEFAULT_HOST_MEMORY_GIB
    if gpu_memory_gib is None and device == "cuda":
        if gpu not in search.GPU_MEMORY_GIB:
            known = ", ".join(search.GPU_MEMORY_GIB)
            raise job.error(
                f"[cluster] gpu = {gpu!r}: its memory is not known here (known: {known}); "
                "give --gpu-memory-gib"
            )
        gpu_memory_gib = search.GPU_MEMORY_GIB[gpu]
    if device == "cpu":  # a CPU rank's "device" is its share of the host
        gpu_memory_gib = gpu_memory_gib or host / gpus
        gpu = "cpu"
    intra = search.DEFAULT_INTRA_NODE_GBPS if c.intra_node_gbps == AUTO else c.intra_node_gbps
    inter = search.DEFAULT_INTER_NODE_GBPS if c.inter_node_gbps == AUTO else c.inter_node_gbps
    _check_representable(job, nodes, gpus, gpu_memory_gib, host)
    return search.Cluster(nodes, gpus, gpu_memory_gib, host, intra, inter, gpu), gpu


def _check_representable(job, nodes: int, gpus: int, gpu_memory_gib, host_memory_gib) -> None:
    """A :class:`ConfigError` for a job past what the search can represent
    (:mod:`usp.planner.hardware`): the command line checks its flags the same way before
    torch loads (:mod:`usp.planner.cli`); this catches the file's and ``--set``'s."""
    row = job.train.micro_batch * job.train.seq_len
    if row > MAX_ROW_TOKENS:
        raise job.error(
            f"[train] micro_batch({job.train.micro_batch}) x seq_len({job.train.seq_len}) = "
            f"{row:,} tokens per packed row; the plan takes at most {MAX_ROW_TOKENS:,} "
            "(document boundaries are int32)"
        )
    if nodes * gpus > MAX_WORLD:
        raise job.error(
            f"{nodes} node(s) x {gpus} GPUs = {nodes * gpus:,} ranks; the plan enumerates "
            f"at most {MAX_WORLD:,}"
        )
    for name, value in (("GPU", gpu_memory_gib), ("host", host_memory_gib)):
        if value is not None and value > MAX_MEMORY_GIB:
            raise job.error(
                f"{name} memory {value:g} GiB is past what the plan represents "
                f"(at most {MAX_MEMORY_GIB:g} GiB)"
            )


def plan(
    config: str,
    *,
    seq_len: int | None = None,
    nodes: int | None = None,
    gpus_per_node: int | None = None,
    gpu_memory_gib: float | None = None,
    host_memory_gib: float | None = None,
    device: str | None = None,
    started: float | None = None,
    jobs: int = 1,
    sets: Sequence[str] = (),
    progress: Callable[[str], None] | None = None,
    lengths: Sequence[int] | str | None = None,
) -> PlanResult:
    """Measure and rank every layout of ``config`` (see :mod:`usp.planner.search`), the
    measurements in ``jobs`` worker processes (1: in this one; the result is the same,
    see :mod:`usp.planner.pool`). ``sets``: ``--set SECTION.KEY=VALUE`` settings applied
    to the file; ``progress`` is told, line by line, what is measured (n of m). Raises a
    :class:`usp.errors.UspError` for a config, a cluster or a model no layout can serve;
    a result without a fitting candidate is returned (``best`` is None). ``lengths``: a
    length mix (document lengths, or ``"data"``: the config's own training data) whose
    rows the best layout's step time is estimated on, for both token placements
    (:func:`length_mix`)."""
    started = time.perf_counter() if started is None else started
    # the flags as overrides of the file: one given by a --set too is refused
    job = load_train_config(
        config, sets=sets, seq_len=seq_len, nodes=nodes, gpus_per_node=gpus_per_node
    )
    device = device or (job.train.device if job.train.device != AUTO else "cuda")
    source = model_source(job)
    model = source.config
    cluster, gpu = _cluster(job, nodes, gpus_per_node, gpu_memory_gib, host_memory_gib, device)
    job = _with_cluster(job, cluster)
    notes: list[str] = []
    choices = search.choices(model, cluster, job)
    if not choices:
        raise HeadLayoutError(
            f"{config}: no (ulysses, ring, dp) serves {model.num_attention_heads} heads / "
            f"{model.num_key_value_heads} KV heads on {cluster.nodes} node(s) x "
            f"{cluster.gpus_per_node} with global_batch {job.train.global_batch}"
        )
    runnable = [
        choice
        for choice in choices
        if job.train.seq_len % search.sequence_multiple(choice, job) == 0
    ]
    skipped = len(choices) - len(runnable)
    if skipped:
        notes.append(
            f"{skipped} layout(s) skipped: seq_len {job.train.seq_len} is not a multiple of "
            "what their grid needs (ring * lcm(2, ulysses) for zigzag, ring * ulysses for "
            "contiguous)"
        )
    if not runnable:
        raise ConfigError(
            f"{config}: seq_len {job.train.seq_len} suits no grid on this cluster; use a "
            f"multiple of {2 * cluster.world_size}"
        )
    target = Target(job, model, cluster.world_size, cluster.gpus_per_node, device)
    if progress is not None:
        progress(progress_intro(target, runnable, jobs))
    with Measurements(target, jobs, progress=_measurement_lines(progress)) as measured:
        # what the longest-sequence search waits for first, then every other candidate
        # (workers measure those while the search waits for its next lengths)
        for choice in search.frontier_candidates(runnable) + runnable:
            measured.want(choice, target.seq_len)
        longest, longest_layout = search.max_seq_len(target, runnable, cluster, measured)
        candidates = [search.evaluate(target, choice, cluster, measured) for choice in runnable]
        at_longest = None
        if longest_layout is not None:  # (measured already: the search's last fit)
            at_longest = search.evaluate(target.at(longest), longest_layout, cluster, measured)
    ranked = search.rank(candidates)
    if device == "cuda" and not torch.cuda.is_available():
        notes.append(
            "host memory: this torch has no CUDA, so the CUDA step ran on CPU fake tensors; "
            "the offload's host copies were kept apart (on the meta device) and count as host"
        )
    notes.append(
        "fits = the measured step's device peak plus the named overheads (kernel "
        "workspaces in the step; NCCL communicators, CUDA context, allocator reserve and a "
        "margin added) within the GPU's memory, and the node's ranks with their host "
        "overheads within its host memory (usp.planner.overheads; listed below the table)"
    )
    if device == "cuda":
        notes.append(f"NCCL's figures change with {NCCL_SETTINGS}")
    cap = (
        search.longest_plannable(target, search.sequence_multiple(longest_layout, job))
        if longest_layout
        else 0
    )
    if longest and longest == cap:
        notes.append(
            f"the longest sequence is at least {longest:,}: the search stops there (a packed "
            "row's document boundaries are int32)"
        )
    notes += encoder_notes(source.directory)
    counts = model_counts(model)
    if counts.experts:
        notes.append(
            f"mixture of experts: memory holds all {counts.total / 1e9:.2f}B parameters "
            f"(every expert, sharded by FSDP2 like the rest); the step time's FLOPs count the "
            f"{counts.active / 1e9:.2f}B one token uses. Fake tensors cannot know the "
            "routing: the experts are measured under the most uneven one (every token on "
            "the same top_k experts) with every expert's weight gradient held, never below "
            "any routing (usp.models.moe_planning); mlp_tile_tokens tiles their routed rows"
        )
    mix = None
    if lengths is not None and ranked and ranked[0].fits:
        mix = length_mix(job, source, ranked[0].choice, cluster, device, lengths)
    return PlanResult(
        length_mix=mix,
        config=config,
        model_name=job.model.preset or str(source.directory),
        parameters=counts.total,
        active_parameters=counts.active,
        seq_len=job.train.seq_len,
        cluster=cluster,
        device=device,
        gpu=gpu,
        candidates=ranked,
        max_seq_len=longest,
        max_seq_choice=longest_layout,
        at_longest=at_longest,
        notes=notes,
        seconds=time.perf_counter() - started,
    )


def encoder_notes(directory) -> list[str]:
    """What a plan of the checkpoint ``directory`` (None: a preset) leaves out: a
    vision-language model's encoders (usp's family is its text decoder)."""
    if directory is None:
        return []
    encoders = encoder_sub_configs(read_config_json(directory / "config.json"))
    if not encoders:
        return []
    return [
        f"vision-language model ({', '.join(encoders)}): the plan counts its text decoder "
        "only; the encoder's memory and time per rank (its weights, and with "
        "usp.models.hf.shard_multimodal each rank encoding about 1/(ulysses*ring) of a "
        "batch's images or frames) are not counted yet"
    ]


def _measurement_lines(progress: Callable[[str], None] | None):
    """The pool's per-measurement hook, as lines for ``progress`` (None: none)."""
    if progress is None:
        return None
    return lambda *measured: progress(measurement_line(*measured))


def _with_cluster(job, cluster):
    """The job with the planned cluster's shape as its ``[cluster]``."""
    return job.with_overrides(nodes=cluster.nodes, gpus_per_node=cluster.gpus_per_node)


def nothing_fits(result: PlanResult) -> str:
    """The message for a plan without a fitting candidate."""
    if result.max_seq_len:
        return (
            f"no layout fits {result.seq_len:,} tokens per sequence on this cluster; the "
            f"longest that fits is {result.max_seq_len:,} (plan that with --seq-len)"
        )
    return (
        f"no layout fits {result.seq_len:,} tokens per sequence on this cluster, nor any "
        "shorter one tried; use more GPUs (--nodes), or a smaller model"
    )


def length_mix(job, source, choice, cluster, device: str, lengths) -> dict:
    """The length mix packed into rows of ``[train] seq_len`` on ``choice``'s grid
    (:func:`usp.planner.placement.mix_steps`), both token placements: bytes a rank sends
    per row, the busiest rank's tokens and work, and the estimated seconds of an
    optimizer step (a row's mean x the rows one replica trains on per step). The
    saved traffic is the split-only traffic of ``"documents"``."""
    if isinstance(lengths, str):  # "data": the training data's own documents
        _, dataset = build_dataset(job, source, 1)  # the documents' own lengths (tokenised here)
        lengths = [int(n) for n in dataset.documents.lengths() if n > 0]
    a = job.topology.attention
    cuda = device == "cuda"
    speed = CPU_TFLOPS
    machine = Machine(
        gpus_per_node=cluster.gpus_per_node, intra_node_gbps=cluster.intra_node_gbps,
        inter_node_gbps=cluster.inter_node_gbps,
        gemm_tflops=GEMM_TFLOPS if cuda else speed,
        attention_tflops=(
            ATTENTION_TFLOPS.get(planning_backend("cuda", a.backend), 144.0) if cuda else speed
        ),
    )  # fmt: skip
    steps = mix_steps(
        lengths, model=source.config, ulysses=choice.ulysses, ring=choice.ring,
        seq_len=job.train.seq_len, layout=a.layout, ring_impl=a.ring_impl,
        item_bytes=2 if cuda else 4, machine=machine,
    )  # fmt: skip
    rows_per_step = job.train.global_batch // choice.dp
    out = {"document_count": len(lengths), "rows": len(steps), "grid": (choice.ulysses, choice.ring),
           "configured": job.topology.parallel.token_placement}  # fmt: skip
    for placement, t in mix_totals(steps).items():
        out[placement] = {
            "bytes_per_rank_per_row": t["bytes_mean"] / len(steps),
            "tokens_max": t["tokens_max"],
            "work_max_over_mean": t["work_max_over_mean"],
            "step_s": t["step_s"] / len(steps) * rows_per_step,
        }
    return out
