"""The planner's step-time estimate: FLOPs at the kernels' throughputs, bytes over the
links, an offloaded optimizer's host step (the assumed speeds of
:mod:`usp.planner.hardware`; nothing here is measured)."""

from __future__ import annotations

from dataclasses import dataclass

from usp.models import model_counts
from usp.planner.footprint import Choice, Target
from usp.planner.hardware import (
    ATTENTION_TFLOPS,
    CPU_TFLOPS,
    GEMM_TFLOPS,
    HOST_ADAM_PARAMS_PER_S,
    PCIE_GBPS,
)
from usp.planner.kernels import planning_backend
from usp.planner.mixer_traffic import mamba2_traffic
from usp.planner.traffic import fsdp_traffic, gdn_traffic, step_traffic, traffic_formula
from usp.process_groups.rank_math import RankMap

GB = 1e9
#: transformers' ``layer_types`` name of a Gated DeltaNet layer
LINEAR_ATTENTION = "linear_attention"
#: usp's kind of a Mamba-2 layer (Granite 4 hybrid's ``linear_attention`` layers)
MAMBA = "mamba"


def _spans_nodes(members, ranks_per_node: int) -> bool:
    return len({m // ranks_per_node for m in members}) > 1


def comm_bytes(target: Target, choice: Choice) -> dict[str, int]:
    """Bytes one rank sends per step, by kind (:mod:`usp.planner.traffic`)."""
    model, job = target.model, target.job
    compute = 2 if target.device == "cuda" else 4
    heads = _Heads(model.num_attention_heads, model.num_key_value_heads, model.attention_head_dim)
    row = job.train.micro_batch * job.train.seq_len
    attention = traffic_formula(
        heads, batch=1, seqlen=row, ulysses=choice.ulysses, ring=choice.ring,
        ring_impl=job.topology.attention.ring_impl, item_bytes=compute, acc_bytes=4,
    )  # fmt: skip
    counts = model_counts(model)
    per_layer, other = counts.per_layer, counts.other
    fsdp = fsdp_traffic(
        per_layer, other, model.num_hidden_layers, world=target.world_size,
        compute_bytes=compute, reduce_bytes=4,
    )  # fmt: skip
    linear_layers = linear_layer_count(model)
    linear = None
    if linear_layers:
        linear = gdn_traffic(
            batch=1,
            seqlen=row,
            ulysses=choice.ulysses,
            ring=choice.ring,
            key_heads=model.linear_num_key_heads,
            heads=model.linear_num_value_heads,
            key_dim=model.linear_key_head_dim,
            value_dim=model.linear_value_head_dim,
            kernel=model.linear_conv_kernel_dim,
            layout=job.topology.attention.layout,
            documents=1,
            item_bytes=compute,
            gate_bytes=4,
            state_bytes=4,
        )  # fmt: skip  (the planned row is one document; g, beta and the kernel in float32)
    mamba_layers = mamba2_layer_count(model)
    mixers = []
    if mamba_layers:
        mixers.append((model_mamba2_traffic(model, row, choice, job.topology.attention.layout,
                                            compute), mamba_layers))  # fmt: skip
    return step_traffic(
        attention,
        fsdp,
        layers=model.num_hidden_layers - linear_layers - mamba_layers,
        micro_batches=job.gradient_accumulation(choice.dp),
        recompute=bool(choice.levers.activation_checkpointing),
        linear=linear,
        linear_layers=linear_layers,
        mixers=mixers,
    )


def linear_layer_count(model) -> int:
    """The model's Gated DeltaNet layers (``layer_types`` ``"linear_attention"``: Qwen3.5);
    0 for a model without."""
    return list(getattr(model, "layer_types", None) or ()).count(LINEAR_ATTENTION)


def mamba2_layer_count(model) -> int:
    """The model's Mamba-2 layers (``layer_types`` ``"mamba"``: Granite 4 hybrid); 0 for
    a model without."""
    return list(getattr(model, "layer_types", None) or ()).count(MAMBA)


def model_mamba2_traffic(model, seqlen: int, choice, layout: str, item_bytes: int,
                         documents: int = 1) -> dict:  # fmt: skip
    """One Mamba-2 layer's traffic (:func:`usp.planner.mixer_traffic.mamba2_traffic`) for a
    row of ``seqlen`` tokens in ``documents`` documents; dt, the scan's output, the conv
    tails and the state maps in float32."""
    return mamba2_traffic(
        batch=1, seqlen=seqlen, ulysses=choice.ulysses, ring=choice.ring,
        heads=model.mamba_n_heads, head_dim=model.mamba_d_head, groups=model.mamba_n_groups,
        state_size=model.mamba_d_state, kernel=model.mamba_d_conv, layout=layout,
        documents=documents, item_bytes=item_bytes, state_bytes=4,
    )  # fmt: skip


@dataclass(frozen=True)
class _Heads:
    heads: int
    kv_heads: int
    head_dim: int


def step_time(target: Target, choice: Choice, cluster, sent: dict[str, int]) -> float:
    """Estimated seconds per optimizer step on one rank: FLOPs at the kernels'
    throughput plus communication over the links. Matmuls (x4/3 with activation
    checkpointing's recompute, x1 + 2/3 more for a tiled MLP's) overlap FSDP's
    collectives (prefetch); attention overlaps the p2p ring (double buffering); the
    Ulysses all-to-alls and the allgather ring's collectives are serial; an offloaded
    optimizer's host step follows the backward (:func:`host_step_time`)."""
    model, job = target.model, target.job
    counts = model_counts(model)
    row = job.train.micro_batch * job.train.seq_len
    rows = job.gradient_accumulation(choice.dp)
    sp = choice.sp
    gemm = 6 * counts.matmul * row * rows / sp
    attention = counts.attention_flops(counts.attention_square([row])) * rows / sp
    if choice.levers.activation_checkpointing:
        gemm, attention = gemm * 4 / 3, attention * 4 / 3
    if choice.levers.mlp_tile_tokens:
        gemm *= 1.2  # the MLP's forward once more (it is ~2/3 of a layer's matmuls)
    if target.device == "cuda":
        backend = planning_backend("cuda", job.topology.attention.backend)
        gemm_s = gemm / (GEMM_TFLOPS * 1e12)
        attention_s = attention / (ATTENTION_TFLOPS.get(backend, 144.0) * 1e12)
    else:
        gemm_s, attention_s = gemm / (CPU_TFLOPS * 1e12), attention / (CPU_TFLOPS * 1e12)
    links = _links(choice, cluster, job)
    seconds = {kind: sent.get(kind, 0) / (links[kind] * GB) for kind in links}
    exposed = seconds["attention_all_to_all"] + seconds["attention_all_gather"]
    exposed += seconds["attention_reduce_scatter"]
    exposed += seconds["linear_all_to_all"] + seconds["linear_all_gather"]
    exposed += seconds["linear_reduce_scatter"]  # (Gated DeltaNet: serial with its kernel)
    return (
        max(gemm_s, seconds["fsdp_all_gather"] + seconds["fsdp_reduce_scatter"])
        + max(attention_s, seconds["attention_p2p"])
        + exposed
        + host_step_time(target, choice)
    )


def host_step_time(target: Target, choice: Choice) -> float:
    """Seconds an offloaded optimizer adds to a step on one rank (0 without offload;
    assumptions of :mod:`usp.planner.hardware`): AdamW on the host over the rank's
    parameter shard at :data:`HOST_ADAM_PARAMS_PER_S`, plus its copies over PCIe at
    :data:`PCIE_GBPS`, not overlapped: ``offload_optimizer`` copies the float32 shard
    and its gradient to the host and the shard back (12 bytes per parameter);
    ``offload_parameters`` copies each shard to the device for its all-gathers
    (forward and backward: 8 bytes) and each gradient to the host (4 bytes)."""
    levers = choice.levers
    if not levers.offload_optimizer or target.device != "cuda":
        return 0.0
    shard = model_counts(target.model).total / target.world_size  # parameters per rank
    copied = 12 * shard
    return shard / HOST_ADAM_PARAMS_PER_S + copied / (PCIE_GBPS * GB)


def _links(choice: Choice, cluster, job) -> dict[str, float]:
    """GB/s of the link each kind crosses for rank 0: a group that spans nodes is bound
    by its inter-node hop."""
    parallel = job.topology.parallel
    n = cluster.gpus_per_node
    rank_map = RankMap(
        cluster.world_size, n, choice.ulysses, choice.ring, choice.dp, parallel.placement,
        parallel.allow_cross_node_ulysses,
    )  # fmt: skip

    def speed(members) -> float:
        return cluster.inter_node_gbps if _spans_nodes(members, n) else cluster.intra_node_gbps

    ring = speed(rank_map.ring_group_of(0))
    fsdp = speed(range(cluster.world_size))
    return {
        "attention_all_to_all": speed(rank_map.ulysses_group_of(0)),
        "attention_p2p": ring,
        "attention_all_gather": ring,
        "attention_reduce_scatter": ring,
        "linear_all_to_all": speed(rank_map.ulysses_group_of(0)),
        "linear_all_gather": ring,
        "linear_reduce_scatter": ring,
        "fsdp_all_gather": fsdp,
        "fsdp_reduce_scatter": fsdp,
    }
