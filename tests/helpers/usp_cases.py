"""Shared helpers for USP tests: bodies run on every rank by the harness, inputs, and
importing the benchmarks."""

from __future__ import annotations

import importlib
import types

import torch
from dist_harness import worker_cached
from reference import reference_attention, relative_error

import usp
from benchmarks import emulate


def topology(
    ulysses: int, ring: int, placement: str = "ulysses-in-node", ranks_per_node: int | None = None
):
    """Cached per worker. "ring-in-node" tests put the ring inside a node on purpose,
    so their Ulysses groups cross nodes."""
    key = ("topology", ulysses, ring, placement, ranks_per_node)
    return worker_cached(
        key,
        lambda: usp.build_topology(
            ulysses,
            ring,
            placement=placement,
            ranks_per_node=ranks_per_node,
            allow_cross_node_ulysses=placement == "ring-in-node",
            emulate_nodes=ranks_per_node is not None,  # the harness runs on one host
        ),
    )


def heads_check_plan(ulysses: int = 8, sp: int = 8, ranks_per_node: int = 8):
    """What a mixer's construction-time heads check reads of a multi-process plan (the
    Ulysses and SP degrees, the ranks per node), without a process group; the degrees
    are attributes a test may change."""
    rank_map = types.SimpleNamespace(ranks_per_node=ranks_per_node)
    topology = types.SimpleNamespace(single_process=False, rank_map=rank_map)
    return types.SimpleNamespace(topology=topology, ulysses_degree=ulysses, sp_degree=sp)


def global_inputs(seq_len, heads, kv_heads, head_dim=16, batch=2, seed=0):
    gen = torch.Generator().manual_seed(seed)
    shape_q, shape_kv = (batch, seq_len, heads, head_dim), (batch, seq_len, kv_heads, head_dim)
    return [
        torch.randn(s, generator=gen, dtype=torch.float64)
        for s in (shape_q, shape_kv, shape_kv, shape_q)
    ]


def reference_with_grads(q, k, v, dout, causal, mask=None):
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    out, _ = reference_attention(q, k, v, causal=causal, mask=mask)
    return [out.detach(), *torch.autograd.grad(out, (q, k, v), dout)]


def usp_run(topo, inputs, *, dtype, layout, causal, ring_impl, extra=None, traffic=None):
    """Shard the global inputs, run usp_attention forward and backward; returns this
    rank's [out, dq, dk, dv] in ``dtype``. ``traffic``: a dict that receives the
    topology's ``CommStats`` snapshots of the forward and of the backward ("forward",
    "backward")."""
    q, k, v, dout = inputs
    local = [
        usp.shard_sequence(t, topo, layout=layout).to(dtype).requires_grad_() for t in (q, k, v)
    ]
    topo.comm_stats.reset()
    out = usp.usp_attention(
        *local, topo, causal=causal, layout=layout, ring_impl=ring_impl, **(extra or {})
    )
    forward = topo.comm_stats.snapshot()
    topo.comm_stats.reset()
    out.backward(usp.shard_sequence(dout, topo, layout=layout).to(dtype))
    if traffic is not None:
        traffic.update(forward=forward, backward=topo.comm_stats.snapshot())
    actual = [out.detach(), *(t.grad for t in local)]
    if any(a.dtype != dtype for a in actual):
        raise AssertionError(f"dtype changed: {[a.dtype for a in actual]}")
    return actual


def usp_errors(topo, inputs, expected, *, layout, **run):
    """:func:`usp_run`, gathered and compared with ``expected`` (relative errors of out,
    dq, dk, dv); ``run``: usp_run's keywords."""
    actual = usp_run(topo, inputs, layout=layout, **run)
    full = [usp.gather_sequence(a, topo, layout=layout) for a in actual]
    return {n: relative_error(a, e) for n, a, e in zip(("out", "dq", "dk", "dv"), full, expected)}


def stated_traffic(heads, kv_heads, *, ulysses, ring, ring_impl, dtype, seq_len, head_dim=16,
                   batch=2):  # fmt: skip
    """What ``benchmarks.emulate.traffic_formula`` states one :func:`usp_run` moves on
    :func:`global_inputs` of these sizes (float32 dK/dV accumulators)."""
    return emulate.traffic_formula(
        emulate.AttentionShape(heads, kv_heads, head_dim),
        batch=batch,
        seqlen=seq_len,
        ulysses=ulysses,
        ring=ring,
        ring_impl=ring_impl,
        item_bytes=dtype.itemsize,
        acc_bytes=4,
    )


def load_benchmark(name: str):
    """``benchmarks.<name>`` (the benchmarks are a package; tests run from the repository
    root). Prefer ``from benchmarks import <name>``."""
    return importlib.import_module(f"benchmarks.{name}")
