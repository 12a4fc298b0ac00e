"""Bodies for the sliding-window and attention-sink tests of USP attention (run on every
rank by the harness): global float64 inputs, a reference with the sink column and the
window's mask, and the errors of one call's out, dq, dk, dv and dsinks."""

from __future__ import annotations

import torch
import torch.distributed as dist
from reference import reference_sink_attention, relative_error, window_document_mask

import usp


def case_inputs(total, heads, kv_heads, seed, dim=8, value_dim=None):
    """Global q, k, v, dout and sinks in float64; ``value_dim``: v's (and out's) head
    size when it differs from q/k's (MLA)."""
    gen = torch.Generator().manual_seed(seed)
    value_dim = dim if value_dim is None else value_dim
    q, k, v, dout = (
        torch.randn(1, total, h, d, generator=gen, dtype=torch.float64)
        for h, d in ((heads, dim), (kv_heads, dim), (kv_heads, value_dim), (heads, value_dim))
    )
    sinks = torch.randn(heads, generator=gen, dtype=torch.float64)
    return q, k, v, dout, sinks


def reference(q, k, v, dout, sinks, cu: list[int], window, with_sinks: bool):
    """(out, dq, dk, dv, dsinks or None) of the whole sequence in one process."""
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    s = sinks.clone().requires_grad_() if with_sinks else torch.full_like(sinks, -torch.inf)
    mask = window_document_mask(cu, window)
    out = reference_sink_attention(*leaves, s, mask=mask)
    grads = torch.autograd.grad(out, [*leaves, s] if with_sinks else leaves, dout)
    return [out.detach(), *grads] + ([] if with_sinks else [None])


def _min_cut_backend(traffic=None):
    """AOT autograd with Inductor's min-cut partitioner, graphs run as they are (no code
    generation): what decides which pass a collective lands in. ``traffic``: a dict that
    receives, per pass ("forward", "backward"), the bytes this rank's graph sends
    (:func:`graph_traffic`)."""
    from functorch.compile import make_boxed_func, min_cut_rematerialization_partition
    from torch._dynamo.backends.common import aot_autograd

    def compiler(phase):
        def run(gm, _example_inputs):
            if traffic is not None:
                found = graph_traffic(gm, dist.get_rank())
                for kind, sent in found.items():
                    totals = traffic.setdefault(phase, {})
                    totals[kind] = totals.get(kind, 0) + sent
            return make_boxed_func(gm.forward)

        return run

    return aot_autograd(
        fw_compiler=compiler("forward"),
        bw_compiler=compiler("backward"),
        partition_fn=min_cut_rematerialization_partition,
    )


def graph_traffic(gm, rank: int) -> dict[str, int]:
    """Bytes a compiled graph's functional collectives send from this rank, by the kinds
    ``CommStats`` counts eagerly (whose counters see nothing under compile): a ring shift
    (an all-to-all with one destination) "p2p"; an equal-split all-to-all "all_to_all"
    (the kept chunk not counted); "all_gather" and "reduce_scatter" (size - 1) times a
    rank's share. Read from the graph's nodes and their example values (one process
    group per collective: the caller knows which)."""
    c10d = torch.ops._c10d_functional
    sent: dict[str, int] = {}

    def add(kind, n):
        sent[kind] = sent.get(kind, 0) + n

    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        if node.target in (c10d.all_to_all_single.default,):
            value, splits = node.args[0].meta["val"], node.args[2]
            size = value.element_size()
            destinations = [n for n in splits if n]
            if len(destinations) == 1:  # usp.comm.traced.post_shift
                add("p2p", destinations[0] * size)
            else:
                add("all_to_all", value.numel() * size * (len(splits) - 1) // len(splits))
        elif node.target is c10d.all_gather_into_tensor.default:
            value, group_size = node.args[0].meta["val"], node.args[1]
            add("all_gather", (group_size - 1) * value.numel() * value.element_size())
        elif node.target is c10d.reduce_scatter_tensor.default:
            value, group_size = node.args[0].meta["val"], node.args[2]
            share = value.numel() // group_size * value.element_size()
            add("reduce_scatter", (group_size - 1) * share)
    return sent


def usp_case(
    topo, inputs, *, layout, ring_impl, window, with_sinks, packed, dtype, sinks_dtype,
    compiled=False, traffic=None,
):  # fmt: skip
    """``packed``: global document boundaries (each a multiple of the layout's chunks),
    or None for a dense sequence. ``compiled``: the call under
    ``torch.compile(fullgraph=True)``, whose graphs' bytes sent go to ``traffic`` (a
    dict, as :func:`_min_cut_backend`'s)."""
    q, k, v, dout, sinks = inputs
    sinks = sinks.to(sinks_dtype).double()  # the reference sees the sinks as given
    total = q.shape[1]
    bounds = [0, total] if packed is None else packed
    cu = None if packed is None else torch.tensor(packed, dtype=torch.int32)
    expected = reference(q, k, v, dout, sinks, bounds, window, with_sinks)
    shard = dict(layout=layout, cu_seqlens=cu)
    local = [usp.shard_sequence(t, topo, **shard).to(dtype).requires_grad_() for t in (q, k, v)]
    local_sinks = sinks.to(sinks_dtype).detach().requires_grad_() if with_sinks else None

    plan = usp.Plan(topo, layout=layout, ring_impl=ring_impl)
    # a compiled graph takes packed documents built outside it (plan.pack)
    packing = None if cu is None else plan.pack(cu)

    def attend(q, k, v, sinks):
        return plan.attention(q, k, v, causal=True, packed=packing, window=window, sinks=sinks)

    if compiled:
        torch._dynamo.reset()
        attend = torch.compile(attend, fullgraph=True, backend=_min_cut_backend(traffic))
    out = attend(*local, local_sinks)
    out.backward(usp.shard_sequence(dout, topo, **shard).to(dtype))
    actual = [out.detach(), *(t.grad for t in local)]
    gathered = [usp.gather_sequence(a, topo, **shard) for a in actual]
    errors = {
        n: relative_error(a, e) for n, a, e in zip(("out", "dq", "dk", "dv"), gathered, expected)
    }
    if with_sinks:
        if local_sinks.grad.dtype != sinks_dtype:
            raise AssertionError(f"dsinks came back as {local_sinks.grad.dtype}")
        dsinks = local_sinks.grad.double()
        dist.all_reduce(dsinks, group=topo.sp_group)  # as FSDP sums gradients
        errors["dsinks"] = relative_error(dsinks, expected[4])
    if compiled:
        torch._dynamo.reset()
    return errors
