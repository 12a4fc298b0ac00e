"""usp.Plan: one owner of topology + attention choices.

Multi-process gloo runs against the single-process float64 reference: the plan's
shard / position_ids / attention / gather agree with each other for non-default
choices (contiguous layout, allgather ring, math backend, a softmax scale), packed
documents go through a PackedSequence built once per batch, the single-process plan
gives the same numbers, and no host sync happens inside an attention call.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from host_syncs import HostSyncs
from reference import document_mask, reference_attention, relative_error
from usp_cases import topology

import usp
import usp.models
from usp import options
from usp.kernels.backends import registry
from usp.kernels.backends.math import MathBackend

TOL = 1e-6  # float64 through the math backend: exact up to rounding


def _inputs(total, heads=8, kv_heads=2, dim=16, batch=1, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [
        torch.randn(batch, total, h, dim, generator=gen, dtype=torch.float64)
        for h in (heads, kv_heads, kv_heads, heads)
    ]


def _expected(q, k, v, dout, *, causal, scale=None, mask=None):
    ref = [t.clone().requires_grad_() for t in (q, k, v)]
    out, _ = reference_attention(*ref, causal=causal, scale=scale, mask=mask)
    return [out.detach(), *torch.autograd.grad(out, ref, dout)]


def _plan_errors(plan, inputs, expected, *, causal, scale, packed=None):
    q, k, v, dout = inputs
    local = [plan.shard(t, packed=packed).requires_grad_() for t in (q, k, v)]
    out = plan.attention(*local, causal=causal, softmax_scale=scale, packed=packed)
    out.backward(plan.shard(dout, packed=packed))
    actual = [out.detach(), *(t.grad for t in local)]
    full = [plan.gather(a, packed=packed) for a in actual]
    return max(relative_error(a, e) for a, e in zip(full, expected))


class CountingMath(MathBackend):
    """The math backend, counting its forward and backward calls (a kernel registry's
    entry standing in for usp's)."""

    def __init__(self):
        self.calls = {"forward": 0, "backward": 0}

    def forward(self, *args):
        self.calls["forward"] += 1
        return super().forward(*args)

    def backward(self, *args):
        self.calls["backward"] += 1
        return super().backward(*args)


def run_dense(ulysses, ring, layout, ring_impl, causal, own_registry=False):
    """``own_registry``: the plan's kernels come from a registry whose ``math`` counts
    its calls (``kernel_registry=``); returns the counts with the error."""
    counting = CountingMath()
    kernels = registry.DEFAULT.replacing({"math": counting}) if own_registry else None
    plan = usp.Plan(
        topology(ulysses, ring), layout=layout, ring_impl=ring_impl, backend="math",
        kernel_registry=kernels,
    )  # fmt: skip
    total = 4 * plan.sequence_multiple
    inputs = _inputs(total, batch=2)
    expected = _expected(*inputs, causal=causal, scale=0.3)
    error = _plan_errors(plan, inputs, expected, causal=causal, scale=0.3)
    # RoPE positions of a dense sequence are the global indices this rank holds
    positions = plan.position_ids(total)
    assert torch.equal(positions, plan.token_indices(total))
    assert torch.equal(plan.shard(torch.arange(total)[None])[0], positions)
    assert registry.get("math") is not counting, "usp's own registry is untouched"
    return error, counting.calls


@pytest.mark.parametrize(
    "ulysses,ring,layout,ring_impl,causal,own_registry",
    [
        (2, 2, "zigzag", "p2p", True, False),
        (2, 2, "contiguous", "allgather", True, True),
        (1, 4, "contiguous", "p2p", False, True),
        (4, 1, "zigzag", "allgather", False, False),
    ],
)
def test_plan_dense_matches_reference(
    distributed, ulysses, ring, layout, ring_impl, causal, own_registry
):
    """With ``own_registry`` every kernel call goes to the plan's registry: the counting
    backend ran forward and backward (a ring of 4 makes 4 p2p block calls each way)."""
    for error, calls in distributed.run(
        run_dense, ulysses, ring, layout, ring_impl, causal, own_registry, world_size=4
    ):
        assert error < TOL
        if own_registry:
            expected = 1 if ring_impl == "allgather" else ring
            assert calls == {"forward": expected, "backward": expected}
        else:
            assert calls == {"forward": 0, "backward": 0}


def run_packed(ulysses, ring, layout, ring_impl, causal):
    plan = usp.Plan(topology(ulysses, ring), layout=layout, ring_impl=ring_impl)
    raw = torch.tensor([0, 5, 6, 19, 30], dtype=torch.int32)
    padding = usp.pad_documents(raw, plan)  # the plan's layout is the default
    packed = plan.pack(padding.cu_seqlens)
    inputs = _inputs(packed.seq_len)
    mask = document_mask(packed.bounds, causal)
    expected = _expected(*inputs, causal=causal, mask=mask)
    error = _plan_errors(plan, inputs, expected, causal=causal, scale=None, packed=packed)
    # positions restart in every document, and agree with the functional helper
    positions = plan.position_ids(packed.seq_len, packed=packed)
    global_ids = usp.document_position_ids(padding.cu_seqlens)
    assert torch.equal(positions, plan.shard(global_ids[None], packed=packed)[0])
    assert torch.equal(positions, usp.local_position_ids(padding.cu_seqlens, plan))
    return error


@pytest.mark.parametrize(
    "ulysses,ring,layout,ring_impl",
    [(2, 2, "zigzag", "p2p"), (1, 4, "contiguous", "allgather"), (4, 1, "zigzag", "allgather")],
)
@pytest.mark.parametrize("causal", [True, False])
def test_plan_packed_matches_reference(distributed, ulysses, ring, layout, ring_impl, causal):
    for error in distributed.run(
        run_packed, ulysses, ring, layout, ring_impl, causal, world_size=4
    ):
        assert error < 1e-5  # float64 inputs on the default (cpu) backend


@pytest.mark.parametrize("ring_impl", ["p2p", "allgather"])
def test_single_process_plan_matches_reference(ring_impl):
    plan = usp.Plan(None, backend="math", ring_impl=ring_impl)
    assert plan.sp_degree == 1 and plan.sequence_multiple == 1
    assert plan.layout == "contiguous"  # one process: natural token order
    # its topology answers for a world of one (no None to test for)
    one = plan.topology
    assert one.single_process and (one.world_size, one.rank, one.dp_degree, one.dp_rank) == (
        1,
        0,
        1,
        0,
    )
    assert (one.sp_group, one.comm_stats, plan.describe().split(";")[0]) == (
        None,
        None,
        "single process",
    )
    inputs = _inputs(12, batch=2)
    expected = _expected(*inputs, causal=True, scale=0.2)
    assert _plan_errors(plan, inputs, expected, causal=True, scale=0.2) < TOL
    cu = torch.tensor([0, 4, 12], dtype=torch.int32)
    packed = plan.pack(cu)
    inputs = _inputs(12)
    expected = _expected(*inputs, causal=True, mask=document_mask(packed.bounds, True))
    assert _plan_errors(plan, inputs, expected, causal=True, scale=None, packed=packed) < TOL
    assert plan.position_ids(12, packed=packed).tolist() == [0, 1, 2, 3, *range(8)]
    assert torch.equal(plan.shard(inputs[0], packed=packed), inputs[0])


def run_functional_defaults():
    plan = usp.Plan(topology(1, 2), layout="contiguous", ring_impl="allgather", backend="math")
    assert usp.sequence_multiple(plan) == 2
    assert usp.sequence_multiple(plan, layout="zigzag") == 4
    q, k, v, dout = _inputs(6)
    local = [usp.shard_sequence(t, plan) for t in (q, k, v)]  # contiguous: 6 tokens are fine
    out = usp.gather_sequence(usp.usp_attention(*local, plan, causal=True), plan)
    ref, _ = reference_attention(q, k, v, causal=True)
    with pytest.raises(usp.ShardingError, match="multiple of 4 for the zigzag layout"):
        usp.usp_attention(*local, plan, causal=True, layout="zigzag")
    return relative_error(out, ref)


def test_functional_api_reads_its_defaults_from_the_plan(distributed):
    for error in distributed.run(run_functional_defaults, world_size=2):
        assert error < TOL


def test_plan_rejects_unknown_choices_with_the_valid_ones():
    with pytest.raises(
        usp.PlanError, match="unknown sequence layout 'striped'; valid: zigzag, contiguous"
    ):
        usp.Plan(None, layout="striped")
    with pytest.raises(usp.PlanError, match="unknown ring_impl 'tree'; valid: p2p, allgather"):
        usp.Plan(None, ring_impl="tree")
    with pytest.raises(usp.PlanError, match="valid: auto, cudnn, flash_attn"):
        usp.Plan(None, backend="fast")
    with pytest.raises(usp.PlanError, match="needs a usp.process_groups.Topology"):
        usp.Plan("examples/configs/cpu_demo.toml")
    q, k, v, _ = _inputs(4)
    for call in (
        lambda: usp.usp_attention(q, k, v, "cpu_demo.toml"),
        lambda: usp.models.Llama.from_config("tiny", "x"),
    ):
        with pytest.raises(
            TypeError, match="expected a usp.process_groups.Topology, a usp.Plan or None"
        ):
            call()


def test_a_plan_keeps_its_kernel_registry_and_refuses_to_compile_with_it():
    """``with_options`` keeps the registry; a bad one is refused; a compiled call is
    refused (the compiled kernel ops would look the names up in usp's registry)."""
    counting = CountingMath()
    plan = usp.Plan(
        None, backend="math", kernel_registry=registry.DEFAULT.replacing({"math": counting})
    )
    assert plan.with_options(layout="zigzag").kernel_registry is plan.kernel_registry
    with pytest.raises(usp.PlanError, match="kernel_registry must be None or a"):
        usp.Plan(None, kernel_registry={"math": counting})
    with pytest.raises(ValueError, match="missing \\['cpu'"):
        registry.KernelRegistry({"math": counting})
    q, k, v, _ = _inputs(8)
    eager = plan.attention(q, k, v, causal=True)
    assert counting.calls["forward"] == 1
    reference, _ = reference_attention(q, k, v, causal=True)
    assert relative_error(eager, reference) < TOL
    compiled = torch.compile(plan.attention, fullgraph=True, backend="eager")
    with pytest.raises(Exception, match="own kernel_registry cannot run under torch.compile"):
        compiled(q, k, v, causal=True)


def test_one_source_for_the_choices():
    from usp import config

    assert registry.BACKEND_NAMES == options.BACKEND_NAMES
    assert tuple(config.LAYOUTS) == options.LAYOUTS
    assert tuple(config.RING_IMPLS) == options.RING_IMPLS
    assert tuple(config.BACKENDS) == options.BACKENDS
    assert usp.ring.LAYOUTS == options.LAYOUTS and usp.ring.RING_IMPLS == options.RING_IMPLS


def run_foreign_packed():
    cu = torch.tensor([0, 4, 8], dtype=torch.int32)
    packed = usp.Plan(topology(1, 2), layout="contiguous").pack(cu)
    q, k, v, _ = (usp.Plan(topology(1, 2)).shard(t) for t in _inputs(8))
    try:
        usp.Plan(topology(1, 2)).attention(q, k, v, packed=packed)
    except usp.PlanError as err:
        return str(err)
    return "no error"


def run_packed_for_another_ring_impl():
    cu = torch.tensor([0, 4, 8], dtype=torch.int32)
    plan = usp.Plan(topology(1, 2))
    packed = plan.pack(cu)  # p2p: no all-gather indices
    q, k, v = (plan.shard(t, packed=packed) for t in _inputs(8)[:3])
    try:
        plan.with_options(ring_impl="allgather").attention(q, k, v, packed=packed)
    except usp.PlanError as err:
        return str(err)
    return "no error"


def test_packed_sequence_of_another_ring_impl_is_refused(distributed):
    for message in distributed.run(run_packed_for_another_ring_impl, world_size=2):
        assert "packed by a plan with ring_impl='p2p'" in message


def test_packed_sequence_of_another_plan_is_refused(distributed):
    for message in distributed.run(run_foreign_packed, world_size=2):
        assert (
            "built for (ring, ulysses, layout) = (2, 1, 'contiguous'), the plan has (2, 1, 'zigzag')"
            in message
        )


def run_from_config(path):
    with usp.Plan.from_config(path) as plan:
        result = (plan.layout, plan.ring_impl, plan.backend, plan.ulysses_degree, plan.ring_degree)
    assert plan.topology.destroyed  # the with block tore the topology down
    return result


def test_plan_from_config_takes_the_attention_section(distributed, tmp_path):
    path = tmp_path / "plan.toml"
    path.write_text(
        "[cluster]\nnodes = 1\ngpus_per_node = 4\n"
        "[parallel]\nulysses = 2\nring = 2\n"
        '[attention]\nlayout = "contiguous"\nring_impl = "allgather"\nbackend = "math"\n'
    )
    for result in distributed.run(run_from_config, str(path), world_size=4):
        assert result == ("contiguous", "allgather", "math", 2, 2)


# ---------------------------------------------------------------- no host syncs in a layer
def run_without_host_syncs(ring_impl):
    """With a PackedSequence built beforehand and per-call agreement off (the NCCL
    default), a forward and backward read no tensor values on the host and create no
    tensors from Python data: nothing that would be a host sync or a host-to-device copy
    on a GPU."""
    plan = usp.Plan(topology(2, 2), ring_impl=ring_impl, verify_calls=False)
    packed = plan.pack(torch.tensor([0, 8, 12, 32], dtype=torch.int32))
    q, k, v, dout = (plan.shard(t, packed=packed) for t in _inputs(32))
    q.requires_grad_()
    calls = {}
    originals = {name: getattr(torch.Tensor, name) for name in ("tolist", "item")}

    def spy(name):
        def wrapped(self, *a, **kw):
            calls[name] = calls.get(name, 0) + 1
            return originals[name](self, *a, **kw)

        return wrapped

    def step():
        for cu in (packed, None):  # packed, then dense
            plan.attention(q, k, v, causal=True, packed=cu).backward(dout)

    step()  # first use: cached index tensors and the backend choice are made here
    for name in originals:
        setattr(torch.Tensor, name, spy(name))
    try:
        with HostSyncs() as mode:
            step()
    finally:
        for name, fn in originals.items():
            setattr(torch.Tensor, name, fn)
    return calls, mode.calls


@pytest.mark.parametrize("ring_impl", ["p2p", "allgather"])
def test_no_host_syncs_inside_attention(distributed, ring_impl):
    for calls, dispatched in distributed.run(run_without_host_syncs, ring_impl, world_size=4):
        assert calls == {} and dispatched == [], (calls, dispatched)


def run_host_sync_detector_works():
    """The detector above must see a sync when there is one (verify on: .tolist())."""
    plan = usp.Plan(topology(2, 2), verify_calls=True)
    q, k, v, _ = (plan.shard(t) for t in _inputs(16))
    seen = []
    original = torch.Tensor.tolist

    def spy(self, *a, **kw):
        seen.append(1)
        return original(self, *a, **kw)

    torch.Tensor.tolist = spy
    try:
        plan.attention(q, k, v, causal=True)
    finally:
        torch.Tensor.tolist = original
    return len(seen)


def test_host_sync_detector_sees_the_agreement_check(distributed):
    assert all(n >= 1 for n in distributed.run(run_host_sync_detector_works, world_size=4))


def run_agreement_cost(calls):
    """Per-call cost of the cross-rank agreement on gloo (CPU), for the notes."""
    import time

    plan = usp.Plan(topology(2, 2))
    q, k, v, _ = (plan.shard(t) for t in _inputs(64))
    timings = {}
    for verify in (False, True, False, True):
        dist.barrier()
        start = time.perf_counter()
        for _ in range(calls):
            plan.attention(q, k, v, causal=True, verify=verify)
        timings[verify] = (time.perf_counter() - start) / calls
    return timings


def test_agreement_cost_is_measured(distributed):
    """Not a timed assertion (machines are noisy): both variants run and finish."""
    results = distributed.run(run_agreement_cost, 20, world_size=4)
    for timings in results:
        assert timings[True] > 0 and timings[False] > 0


def test_packed_sequence_of_another_length_is_refused():
    plan = usp.Plan(None)
    packed = plan.pack(torch.tensor([0, 4, 8], dtype=torch.int32))
    q, k, v, _ = _inputs(6)
    expected = "the packed sequence has 8 tokens, but the tensors hold 6 over the 1 SP rank"
    with pytest.raises(usp.ShardingError, match=expected):
        plan.attention(q, k, v, packed=packed)
    with pytest.raises(usp.ShardingError, match=expected):
        plan.shard(q, packed=packed)
    with pytest.raises(usp.ShardingError, match=expected):
        usp.models.Llama.from_config("tiny", plan)(
            torch.zeros(1, 6, dtype=torch.long), cu_seqlens=packed
        )
