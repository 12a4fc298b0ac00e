"""What the planner assumes about the machines, and the largest job it can represent
(no torch import: ``usp plan``'s command line reads these before torch loads).

Every figure says where it comes from; those marked *assumption* were not measured on
the hardware they describe (``benchmarks/gpu_check.sh`` measures what one GPU can).
"""

from __future__ import annotations

import os

#: device memory in GiB by GPU name (``[cluster] gpu``); what ``nvidia-smi`` reports
GPU_MEMORY_GIB = {"H200": 140.0, "H100": 79.6, "A100": 79.2}
DEFAULT_GPU = "H200"
#: GPUs whose nodes join their GPUs through NVSwitch (NVLink SHARP, "NVLS", is on by
#: default there: NCCL reserves memory for it, :mod:`usp.planner.overheads`)
NVSWITCH_GPUS = ("H200", "H100")
#: host memory per node in GiB when neither the config nor the command line says
DEFAULT_HOST_MEMORY_GIB = 2048.0
#: link bandwidths in GB/s (1e9 bytes/s) per direction, when the config does not say:
#: NVLink 4 on H100/H200 (~450 GB/s measured per direction of the 900 GB/s total) and
#: one 400 Gb/s InfiniBand NIC per GPU (50 GB/s)
DEFAULT_INTRA_NODE_GBPS = 450.0
DEFAULT_INTER_NODE_GBPS = 50.0
#: host <-> device copies per GPU, GB/s per direction: PCIe Gen5 x16 is 64 GB/s raw;
#: pinned copies reach ~50, and 8 GPUs of a node share its CPU sockets' memory system
#: (assumption: half of it)
PCIE_GBPS = 25.0
#: AdamW on the host, parameters per second per rank process: torch's single-tensor
#: AdamW touches ~28 bytes per float32 parameter (read parameter, gradient and two
#: moments, write three); at ~10 GB/s of memory bandwidth per rank (a node's ~300 GB/s
#: over 8 ranks, at most a third of it reached by torch's CPU kernels) that is ~0.35e9/s
#: (assumption; ``benchmarks/host_adam.py`` measured 0.17e9/s on one core of this
#: project's shared 2-core machine: benchmarks/README.md, *Host AdamW*)
HOST_ADAM_PARAMS_PER_S = 0.35e9

#: TFLOP/s per attention backend, forward + backward, causal, bf16 (H200 measurements
#: of shared/DESIGN.md, at 128k tokens; flash_attn assumed equal to torch's FA2)
ATTENTION_TFLOPS = {"cudnn": 542.0, "flash": 325.0, "flash_attn": 325.0, "efficient": 144.0}
#: the matmuls (projections, MLP, output head) in bf16 on an H200: an assumption (two
#: thirds of the 989 TFLOP/s dense peak, what large cuBLAS GEMMs reach), not measured here
GEMM_TFLOPS = 660.0
#: every kernel on a CPU device: a rough figure, not measured (CPU plans are for demos)
CPU_TFLOPS = 0.5

# ------------------------------------------------------------------ what can be planned
#: the longest packed row (micro_batch x seq_len tokens) the step can take: document
#: boundaries are int32 (``cu_seqlens``, as every varlen attention kernel takes them)
MAX_ROW_TOKENS = 2**31 - 1
#: the largest world the search enumerates: it tries every divisor of the world as dp
#: and builds each candidate's rank map (a Python list of the world's ranks)
MAX_WORLD = 2**16
#: the most memory per GPU or per node, GiB: the search's byte arithmetic is exact in
#: float64 below 2**53 bytes (8 PiB); 1 PiB leaves room for sums of several terms
MAX_MEMORY_GIB = float(2**20)
#: ``usp plan --jobs`` at most: worker processes beyond the CPUs only share them
MAX_JOBS = max(1, os.cpu_count() or 1)


def default_jobs() -> int:
    """``usp plan``'s default ``--jobs``: two workers where there are two CPUs."""
    return max(1, min(2, os.cpu_count() or 1))
