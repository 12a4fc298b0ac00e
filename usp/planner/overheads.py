"""What a GPU and its host spend beyond the tensors of the measured step.

Fake kernels allocate only their outputs and the fake world has no communicators, so the
planner's device total is the measured step plus named items, each with its source
(``usp plan`` prints them, ``python -m usp.planner.explain`` too; ``--json`` lists them):

device, per rank (CUDA)
  * **attention kernel workspace** -- inside the measured step: the planning kernels
    allocate each call's documented workspace (:func:`attention_workspace`) for the
    duration of the call, so it counts where it is live; shown for the largest call.
  * **NCCL communicators** -- one per process group usp runs a collective on
    (:func:`communicators`; :data:`NCCL_GIB` per kind).
  * **CUDA context and libraries** -- :data:`CUDA_CONTEXT_GIB`.
  * **parameter offload copies** (``offload_parameters``, planned on the CPU stand-in) --
    FSDP2's host-to-device copy of a shard before its all-gather and the reduce-scatter
    output before its copy to the host, which a CPU stand-in never allocates.
  * **allocator reserve** -- a fraction of the peak (:data:`ALLOCATOR_RESERVE`): with
    ``expandable_segments`` (what ``usp train`` sets on CUDA unless
    ``PYTORCH_CUDA_ALLOC_CONF`` says otherwise: :mod:`usp.config.allocator`) or without.
  * **margin** -- :data:`MARGIN_FRACTION` of the GPU, for what no item names.
host, per node
  * the ranks' measured host tensors (offloaded activations, offloaded parameters,
    gradients and AdamW state) plus **pinned rounding** (torch's pinned allocator gives
    each block a power of two: a 3.53 GiB block takes 4 GiB. Offloaded layer inputs are
    held in power-of-two pieces, :func:`usp.models.offload.pinned_pieces`, so only their
    last small piece rounds; FSDP's offloaded shards are one block each; counted per
    tensor of the step, :mod:`usp.planner.measure`);
  * **rank processes** -- :data:`RANK_PROCESS_HOST_GIB` each;
  * **OS, page cache and data pipeline** -- :data:`NODE_RESERVE_FRACTION` of the node
    (at least :data:`NODE_RESERVE_MIN_GIB`).

A planner must never be optimistic: every assumed figure is at the upper end of what its
source reports, and ``benchmarks/gpu_check.sh`` (its ``overheads`` step) measures each
on the first GPU so the next device run corrects them. No torch import here.

"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from usp.config.allocator import expandable_segments

GIB = 2**30

# ------------------------------------------------------------------ the figures
#: GiB of device memory per NCCL communicator of a process group, by what runs on it
#: (NCCL >= 2.19 defaults on H100/H200 NVLink; assumptions at the top of what is reported):
#: - ``collective``: ring/tree channels, a Simple (NCCL_BUFFSIZE, 4 MiB), LL128 and LL
#:   buffer per channel and neighbour: 0.54-0.69 GB measured for one all-reduce
#:   communicator on 4 A100s with NVLink (NVIDIA/nccl#964), rounded up for Hopper's
#:   larger channel count (memory grows linearly with channels: NVIDIA/nccl#986);
#: - ``nvls``: NVLink SHARP buffers of a communicator that runs large all-gathers /
#:   reduce-scatters inside an NVSwitch node (FSDP's): NCCL binds 1 GiB per NVLS buffer
#:   (NVIDIA/nccl-tests#216 logs "NVLS Bind mem ... size 1073741824"); ~2.4 GB reported
#:   per H100 communicator, which NeMo and JAX-Toolbox disable to save memory;
#: - ``peer``: one peer's point-to-point connection, used by Ulysses' all-to-all (every
#:   other rank of the group) and the ring's batched send/recv (its two neighbours):
#:   the first all_to_all_single on 8 H100s added 3.28 GB (7 peers x 32 channels,
#:   NVIDIA/nccl#1685);
#: - ``single``: a one-rank communicator (a one-GPU job's FSDP collectives): a 512 MiB
#:   shared P2P buffer at its first collective (NVIDIA/nccl#2363).
NCCL_GIB = {"collective": 1.0, "nvls": 2.25, "peer": 0.47, "single": 0.5}
#: the NCCL settings that change these figures (named in the report)
NCCL_SETTINGS = (
    "NCCL_NVLS_ENABLE=0 (no NVLS buffers), NCCL_BUFFSIZE (4 MiB per channel and protocol), "
    "NCCL_MAX_NCHANNELS / NCCL_MIN_NCHANNELS (memory grows with channels), "
    "NCCL_MAX_P2P_NCHANNELS (channels per all-to-all and send/recv peer), "
    "NCCL_RUNTIME_CONNECT=0 (connect every algorithm at start-up, not only those used)"
)
#: GiB per process for the CUDA context (lazy module loading, torch's default) and the
#: cuBLAS/cuDNN handles and workspaces: ~0.5-1 GiB on H100 (assumption: the top)
CUDA_CONTEXT_GIB = 1.0
#: the caching allocator's reserve beyond the peak of live tensors, as a fraction of the
#: peak: fragmentation of its segments. With ``expandable_segments`` segments grow in
#: place (2 MiB pages), so freed space is reused whatever the next size; without, a
#: block is carved from fixed-size cudaMalloc segments (assumptions; long-context runs
#: publish reserved memory 10-20% above allocated without it, ALST sets it for that)
ALLOCATOR_RESERVE = {"expandable_segments": 0.05, "fixed_segments": 0.15}
#: what no item names (the allocator's 512-byte rounding of every block, streams' and
#: events' small buffers, NCCL's growth past its estimate): a fraction of the GPU
MARGIN_FRACTION = 0.01
#: GiB of host memory per rank process: torch and CUDA libraries, the driver's host
#: allocations, NCCL's host buffers, the data loader's batches (assumption)
RANK_PROCESS_HOST_GIB = 4.0
#: of each node's memory, for the OS, the page cache the data pipeline reads through
#: and everything else running there: 5%, at least 16 GiB (assumption)
NODE_RESERVE_FRACTION = 0.05
NODE_RESERVE_MIN_GIB = 16.0


# ------------------------------------------------------------------ kernel workspaces
#: bytes per thread the CPU kernel's reduced-precision backward GEMMs allocate for their
#: packing (measured on torch 2.13: 225 KiB for bf16 at 256 x 512 blocks, 0 for fp16)
CPU_GEMM_PACKING = 256 * 1024


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


@dataclass(frozen=True)
class CpuPacking:
    """When torch's CPU flash kernel packs K and V for oneDNN's brgemm (its ``with_pack``
    path: a reduced dtype on a CPU whose oneDNN ISA has the matrix units for it, AMX for
    bf16). It packs a call with at least ``min_len`` queries and keys whose per-thread
    GEMM work is at least ``gemm_ratio`` times the packed K/V (PyTorch's
    ``FlashAttentionKernel.cpp``). Which CPUs pack is decided where torch is loaded:
    :func:`usp.planner.kernels.cpu_packing`."""

    min_len: int
    gemm_ratio: float


#: the packed path's thresholds by dtype (PyTorch's ``cpu_flash_attention``: bf16 from 64
#: tokens and 4x the packed size in GEMM work, fp16 from 16 tokens and 1x)
CPU_PACKING = {"bfloat16": CpuPacking(64, 4.0), "float16": CpuPacking(16, 1.0)}


def attention_workspace(
    backend: str, *, batch: int, seqlen_q: int, seqlen_k: int, heads: int, kv_heads: int,
    head_dim: int, item_bytes: int, backward: bool, threads: int = 1,
    cpu_packing: CpuPacking | None = None,
) -> int:  # fmt: skip
    """Bytes one attention call allocates beyond its inputs and outputs, from the
    backends' documented allocations (PyTorch 2.6-2.13 sources; CUDA ones not measured
    here -- assumptions until ``gpu_check.sh`` measures them):

    - ``flash`` / ``flash_attn`` (FA2, ``mha_bwd`` / ``mha_varlen_bwd``): backward a
      float32 ``dq_accum`` [B, Sq + 128, H, round_up(D, 32)] and ``softmax_d`` [B, H,
      Sq + 128] (dense rounds Sq up to 128, varlen adds 128 per sequence: Sq + 128
      covers both), plus with GQA ``dk_expanded`` and ``dv_expanded`` [B, Sk, H, D] in
      the input dtype (summed into dK, dV afterwards); forward nothing;
    - ``cudnn`` (cuDNN frontend SDPA backward): a float32 ``dQ_accum`` [B, H, Sq, D] and
      ``softmax_sum`` [B, H, Sq] (GQA's full-head dK/dV stay virtual in dense layouts);
      forward nothing beyond cuDNN's own small engine workspace;
    - ``efficient`` (mem-efficient attention; usp repeats K/V to H heads for it):
      backward float32 accumulators for dQ [B, H, Sq, D] and dK, dV [B, H, Sk, D] (the
      kernel keeps dK/dV in registers for small head dims: an overestimate there) and
      the repeated K, V and their H-head gradients [B, Sk, H, D] in the input dtype;
      forward the repeated K, V;
    - ``cpu`` (``_scaled_dot_product_flash_attention_for_cpu``, measured against the real
      kernel's allocations in ``tests/planner/test_planner_overheads.py``): per thread a
      float32 buffer of qs x ks + 2 qs + qs x D (forward) or 2 qs x ks (backward) with qs
      = 256 / 64 / 32 query rows for Sq >= 768 / >= 192 / else and ks = min(512, Sk),
      plus reduced-precision copies qs x ks (forward) or 2 qs x ks (backward) in the
      input dtype for bf16/fp16, and in a reduced-precision backward up to
      :data:`CPU_GEMM_PACKING` per thread for the GEMM's own packing (measured 225 KiB
      for bf16, none for fp16, on an AVX2 CPU; not documented). With ``cpu_packing`` (the
      CPU's oneDNN packs this dtype: AMX) a forward that meets its thresholds also holds
      the packed K [B, Hkv, D', Sk] and V [B, Hkv, Sk', D] (D', Sk': rounded up to even)
      and a per-thread transpose buffer [ks, D] in the input dtype (and for an odd D a
      padded query block per thread): :func:`_cpu_packed_forward`;
    - ``math``: its intermediates are ordinary ops of the step, measured as they are.
    """
    b, sq, sk, h, hk, d = batch, seqlen_q, seqlen_k, heads, kv_heads, head_dim
    if backend in ("flash", "flash_attn"):
        if not backward:
            return 0
        rows = sq + 128
        total = 4 * b * rows * h * _round_up(d, 32) + 4 * b * h * rows
        if hk != h:
            total += 2 * b * sk * h * d * item_bytes
        return total
    if backend == "cudnn":
        return 4 * (b * h * sq * d + b * h * sq) if backward else 0
    if backend == "efficient":
        repeated = 2 * b * sk * h * d * item_bytes if hk != h else 0
        if not backward:
            return repeated
        return 4 * b * h * (sq + 2 * sk) * d + 2 * repeated
    if backend == "cpu":
        qs = 256 if sq >= 768 else 64 if sq >= 192 else 32
        qs, ks = min(qs, sq), min(512, sk)
        reduced = item_bytes < 4
        if backward:
            per_thread = 4 * 2 * qs * ks
            if reduced:
                per_thread += 2 * qs * ks * item_bytes + CPU_GEMM_PACKING
            return threads * per_thread + 4 * qs
        packed = _cpu_packed_forward(b, sq, sk, h, hk, d, qs, ks, threads, cpu_packing)
        ks_even = ks + ks % 2 if packed else ks  # its reduced buffer holds even key blocks
        per_thread = 4 * (qs * ks + 2 * qs + qs * d) + (qs * ks_even * item_bytes if reduced else 0)
        return threads * per_thread + packed * item_bytes
    return 0


def _cpu_packed_forward(b, sq, sk, h, hk, d, qs, ks, threads, packing) -> int:
    """Elements (input dtype) the CPU kernel's packed forward adds, 0 when it does not
    pack: K transposed and V, with odd sizes padded to even (what the brgemm packing
    takes), one transpose buffer per thread, and for an odd head dim a padded query
    block per thread. The decision is the kernel's: both lengths at least
    ``packing.min_len`` and the per-thread GEMM work (query blocks shared over the
    threads, each against every key: the non-causal count, an upper bound for causal
    calls) at least ``packing.gemm_ratio`` x the packed K."""
    if packing is None or min(sq, sk) < packing.min_len:
        return 0
    blocks_per_thread = -(-(b * h * -(-sq // qs)) // threads)
    if blocks_per_thread * qs * sk * d < packing.gemm_ratio * b * hk * sk * d:
        return 0
    d_even = d + d % 2
    v_rows = (sk - 1) // ks * (ks + ks % 2) + _even(sk - (sk - 1) // ks * ks)
    query_pad = threads * qs * d_even if d % 2 else 0
    return b * hk * d_even * sk + b * hk * v_rows * d + threads * ks * d + query_pad


def _even(x: int) -> int:
    return x + x % 2


# ------------------------------------------------------------------ communicators
@dataclass(frozen=True)
class Communicator:
    """One NCCL communicator of a rank: its group, size, what runs on it and the kinds
    of memory it holds (keys of :data:`NCCL_GIB`, one ``"peer"`` per peer)."""

    group: str
    size: int
    kinds: tuple[str, ...]
    uses: str

    @property
    def nbytes(self) -> int:
        return int(sum(NCCL_GIB[k] for k in self.kinds) * GIB)


def communicators(ulysses: int, ring: int, dp: int, *, ranks_per_node: int, nvswitch: bool):
    """The communicators one rank of a ``(ulysses, ring, dp)`` layout creates, from usp's
    groups (:class:`usp.process_groups.Topology`): the world (FSDP's ``dp x sp`` mesh is
    the whole world: its all-gathers and reduce-scatters, the loss, the agreements),
    ring, ulysses, sp and dp. A group spanning the world is the world's communicator
    (torch reuses it); a group of one rank runs no collective (usp skips them), except
    the world of a one-GPU job, on which FSDP still runs its collectives. NVLS buffers:
    the world's, when it has more than one rank in an NVSwitch node (FSDP's large
    collectives select NVLS there; small ones, the loss's, do not, and NCCL >= 2.22
    connects only the algorithms used). Every group also holds collective channels (the
    ring's all-gather implementation, agreements)."""
    world = ulysses * ring * dp
    if world == 1:
        return [Communicator("world", 1, ("single",), "FSDP's collectives on one GPU")]
    kinds = ["collective"] + (["nvls"] if nvswitch and min(ranks_per_node, world) > 1 else [])
    uses = ["FSDP dp x sp", "loss", "agreements"]
    others = []
    for name, size, peers, use in (
        ("ring", ring, 2 if ring > 2 else 1, "K/V send/recv"),
        ("ulysses", ulysses, ulysses - 1, "all-to-all"),
    ):
        if size == 1:
            continue
        if size == world:
            kinds += ["peer"] * peers
            uses.append(use)
        else:
            others.append(Communicator(name, size, ("collective", *["peer"] * peers), use))
    for name, size in (("sp", ulysses * ring), ("dp", dp)):
        if 1 < size < world:
            others.append(Communicator(name, size, ("collective",), "loss sums"))
    return [Communicator("world", world, tuple(kinds), ", ".join(uses)), *others]


# ------------------------------------------------------------------ items and budget
@dataclass(frozen=True)
class Item:
    """One named line of what a rank (``where = "device"`` / ``"host"``) or a node
    (``"node"``) spends. ``added``: False for a figure already inside the measured step
    (shown, not added again)."""

    name: str
    nbytes: int
    source: str
    where: str = "device"
    added: bool = True


def node_reserve(host_memory_gib: float) -> int:
    return int(max(NODE_RESERVE_MIN_GIB, NODE_RESERVE_FRACTION * host_memory_gib) * GIB)


@dataclass(frozen=True)
class Budget:
    """The limits a layout's measured peaks must stay within, from its items: the
    device peak p fits when ``p * (1 + reserve) + fixed <= gpu``; the host peak h of a
    rank (pinned rounding included) when ``ranks * (h + per_rank) + node <= host``."""

    gpu_bytes: int
    device_fixed: int  # added items but the allocator reserve
    reserve_fraction: float
    host_bytes: int  # per node
    host_per_rank: int
    host_node: int
    ranks_per_node: int

    @property
    def device_peak_limit(self) -> float:
        return (self.gpu_bytes - self.device_fixed) / (1 + self.reserve_fraction)

    @property
    def host_peak_limit(self) -> float:
        return (self.host_bytes - self.host_node) / self.ranks_per_node - self.host_per_rank

    def device_total(self, peak: int) -> int:
        return int(peak * (1 + self.reserve_fraction) + self.device_fixed)

    def host_total(self, host_peak: int) -> int:
        return int(self.ranks_per_node * (host_peak + self.host_per_rank) + self.host_node)


def ceil_gib(nbytes: float) -> float:
    """GiB rounded up to 0.1 (a limit shown is never above the real one)."""
    return math.ceil(nbytes / GIB * 10) / 10


@dataclass(frozen=True)
class Overheads:
    """Every named item of one layout on one cluster (see the module docstring), and
    the :class:`Budget` its measured peaks must fit. ``device_fixed``: the device items
    known before measuring; the allocator reserve (a fraction of the peak), the kernel
    workspace, the offload copies and the pinned rounding come from a footprint
    (:meth:`items`, :meth:`budget`)."""

    device_fixed: tuple[Item, ...]
    reserve_fraction: float
    reserve_setting: str  # "expandable_segments" / "fixed_segments" / "" (CPU)
    host_rank: tuple[Item, ...]
    host_node: tuple[Item, ...]
    gpu_bytes: int
    host_bytes: int
    ranks_per_node: int

    def budget(self, extras=None) -> Budget:
        """The limits for a footprint with these ``extras`` (:class:`usp.planner.
        footprint.Extras`; its offload copies are device memory added to the peak)."""
        copies = getattr(extras, "offload_copies", 0)
        return Budget(
            self.gpu_bytes, sum(i.nbytes for i in self.device_fixed) + copies,
            self.reserve_fraction, self.host_bytes, sum(i.nbytes for i in self.host_rank),
            sum(i.nbytes for i in self.host_node), self.ranks_per_node,
        )  # fmt: skip

    def items(self, peak_device: int, extras=None) -> list[Item]:
        """Every line of the report for a footprint with this device peak and ``extras``."""
        lines = []
        workspace = getattr(extras, "workspace", 0)
        if workspace:
            lines.append(Item(
                "attention kernel workspace", workspace,
                f"in the step, allocated by each call; largest: {extras.workspace_call} "
                "(attention_workspace: the backends' documented allocations)", added=False,
            ))  # fmt: skip
        lines += self.device_fixed
        copies = getattr(extras, "offload_copies", 0)
        if copies:
            lines.append(Item(
                "parameter offload copies", copies,
                "FSDP2 CPUOffloadPolicy: the largest float32 shard's copy before its "
                "all-gather + the largest unit's reduce-scatter output (not on the stand-in)",
            ))  # fmt: skip
        if self.reserve_fraction:
            lines.append(Item(
                "allocator reserve", int(peak_device * self.reserve_fraction),
                f"{self.reserve_fraction:.0%} of the peak with {self.reserve_setting} "
                f"({ALLOCATOR_RESERVE['fixed_segments']:.0%} without expandable_segments; "
                "ALLOCATOR_RESERVE, assumed)",
            ))  # fmt: skip
        pinned = getattr(extras, "pinned", 0)
        if pinned:
            lines.append(Item(
                "pinned rounding", pinned,
                "torch's pinned allocator rounds each block up to a power of two "
                "(offloaded parameter and gradient shards; the last small piece of each "
                "offloaded layer input)",
                where="host",
            ))  # fmt: skip
        return lines + list(self.host_rank) + list(self.host_node)


def overheads_for(
    *, device: str, gpu: str, gpu_memory_gib: float, host_memory_gib: float,
    ranks_per_node: int, ulysses: int, ring: int, dp: int, nvswitch: bool,
    environ: Mapping[str, str] | None = None,
) -> Overheads:  # fmt: skip
    """The items of a ``(ulysses, ring, dp)`` layout; ``device`` ``"cpu"``: a CPU rank
    whose "device" is its share of the host (only the margin applies)."""
    gpu_bytes = int(gpu_memory_gib * GIB)
    host_bytes = int(host_memory_gib * GIB)
    margin = Item(
        "margin", int(MARGIN_FRACTION * gpu_bytes),
        f"{MARGIN_FRACTION:.0%} of the device, for what no line names",
    )  # fmt: skip
    if device != "cuda":
        return Overheads((margin,), 0.0, "", (), (), gpu_bytes, host_bytes, ranks_per_node)
    groups = communicators(ulysses, ring, dp, ranks_per_node=ranks_per_node, nvswitch=nvswitch)
    described = "; ".join(
        f"{c.group} of {c.size} ({c.uses}): "
        + " + ".join(f"{n} {k}" if n > 1 else k for k, n in _counted(c.kinds))
        for c in groups
    )
    nccl = Item(
        "NCCL communicators", sum(c.nbytes for c in groups),
        f"{described} (NCCL_GIB per kind, assumed from NVIDIA/nccl#964, #1685, #2363)",
    )  # fmt: skip
    context = Item(
        "CUDA context and libraries", int(CUDA_CONTEXT_GIB * GIB),
        "per process: context, cuBLAS/cuDNN handles and workspaces (assumed)",
    )  # fmt: skip
    setting = "expandable_segments" if expandable_segments(environ) else "fixed_segments"
    host_rank = (Item(
        "rank process", int(RANK_PROCESS_HOST_GIB * GIB),
        "each rank's process: libraries, driver and NCCL host buffers, data loader "
        "(assumed)", where="host",
    ),)  # fmt: skip
    host_node = (Item(
        "OS, page cache and data pipeline", node_reserve(host_memory_gib),
        f"{NODE_RESERVE_FRACTION:.0%} of the node, at least {NODE_RESERVE_MIN_GIB:g} GiB "
        "(assumed)", where="node",
    ),)  # fmt: skip
    return Overheads(
        (nccl, context, margin), ALLOCATOR_RESERVE[setting], setting, host_rank, host_node,
        gpu_bytes, host_bytes, ranks_per_node,
    )  # fmt: skip


def _counted(kinds: tuple[str, ...]) -> list[tuple[str, int]]:
    seen: dict[str, int] = {}
    for kind in kinds:
        seen[kind] = seen.get(kind, 0) + 1
    return list(seen.items())
