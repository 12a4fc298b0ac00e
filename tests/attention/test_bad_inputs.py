"""Bad inputs on the newest APIs (issue 59): Gated DeltaNet (and Mamba-2, the same
checks), sinks, MLA head sizes, documents that differ.

Each case runs on 2 gloo ranks whose process groups wait at most ``PG_TIMEOUT`` seconds
in a collective (a rank left waiting fails there instead of hanging) and must end within
``TIMEOUT`` seconds on every rank. A refused call raises the same usp error on every
rank, naming the argument, before any byte is sent; the groups are usable afterwards (a
valid call after it is exact). Chunk sizes longer than the sequence compute exactly.
"""

from __future__ import annotations

import contextlib
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from gdn_cases import gdn_inputs, reference_gdn
from mamba_cases import mamba_inputs, reference_mamba2
from reference import reference_attention, relative_error
from usp_cases import topology

import usp
from usp.linear import gated_deltanet_usp, mamba2_usp

TIMEOUT = 90  # seconds a case may take on every rank
PG_TIMEOUT = 30  # seconds a collective waits before failing (a hang fails fast)
HARNESS_PG_TIMEOUT = 600  # the harness's own (restored after each case)


@contextlib.contextmanager
def short_timeouts(topo):
    groups = {id(g): g for g in (topo.sp_group, topo.ring_group, topo.ulysses_group)}
    for group in groups.values():
        group.set_timeout(timedelta(seconds=PG_TIMEOUT))
    try:
        yield
    finally:
        for group in groups.values():
            group.set_timeout(timedelta(seconds=HARNESS_PG_TIMEOUT))


def _gdn(total=32, heads=4, key_heads=2, seed=3):
    """Global GDN inputs (float64): [q, k, v, g, beta], conv weights (K = 4)."""
    inputs, ws, _ = gdn_inputs(1, total, key_heads, heads, 8, 6, 4, seed=seed)
    return inputs, ws


def _mamba2(plan, inputs, x=None, **options):
    """mamba2_usp on this rank's shard of global ``inputs`` (``x``: this rank's x)."""
    x_, b, c, dt = (plan.shard(t) for t in inputs[:4])
    a, d, weight, bias = inputs[4:]
    x = x_ if x is None else x
    return mamba2_usp(x, b, c, dt, a, plan, d=d, conv_weight=weight, conv_bias=bias, **options)


def _gdn_still_exact(plan) -> float:
    inputs, ws = _gdn(seed=11)
    out = gated_deltanet_usp(*[plan.shard(t) for t in inputs], plan, conv_weights=ws)
    return relative_error(plan.gather(out), reference_gdn(*inputs, ws))


def _attention_still_exact(plan) -> float:
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 16, h, 8, generator=gen, dtype=torch.float64) for h in (4, 2, 2))
    out = plan.attention(*[plan.shard(t) for t in (q, k, v)], causal=True)
    expected, _ = reference_attention(q, k, v, causal=True)
    return relative_error(plan.gather(out), expected)


def _attention_inputs(plan, v_dim=8):
    gen = torch.Generator().manual_seed(1)
    shapes = ((1, 32, 4, 8), (1, 32, 2, 8), (1, 32, 2, v_dim))
    return [plan.shard(torch.randn(*s, generator=gen, dtype=torch.float64)) for s in shapes]


def _sinks(rank: int, shift: float = 0.0) -> torch.Tensor:
    return torch.tensor([0.5, -0.25, 1.0, 0.125], dtype=torch.float64) + shift * rank


def _call(name: str, plan, rank: int):
    """The bad call of case ``name`` on this rank."""
    inputs, ws = _gdn()
    local = [plan.shard(t) for t in inputs]
    if name == "gdn_grad_on_one_rank":  # 1: rank 0's backward waited in a collective
        q = local[0].requires_grad_(rank == 0)  # its conv tails are all-gathered
        out = gated_deltanet_usp(q, *local[1:], plan, conv_weights=ws)
        if out.requires_grad:  # rank 0 only
            out.sum().backward()
    elif name == "sinks_values_differ":  # 3
        plan.attention(*_attention_inputs(plan), causal=True, sinks=_sinks(rank, 0.25))
    elif name == "sinks_grad_on_one_rank":  # 4
        q, k, v = (t.requires_grad_() for t in _attention_inputs(plan))
        sinks = _sinks(0).requires_grad_(rank == 0)
        plan.attention(q, k, v, causal=True, sinks=sinks).sum().backward()
    elif name == "gdn_nan_scale":  # 5
        gated_deltanet_usp(*local, plan, scale=float("nan"))
    elif name == "mla_v_head_size_on_one_rank":  # 8
        plan.attention(*_attention_inputs(plan, v_dim=16 if rank == 0 else 8), causal=True)
    elif name == "gdn_chunk_size_bool":  # 9
        gated_deltanet_usp(*local, plan, chunk_size=True)
    elif name == "gdn_conv_weights_1d":  # 11
        gated_deltanet_usp(*local, plan, conv_weights=[w[:, 0] for w in ws])
    elif name == "gdn_conv_width_0":  # 12
        gated_deltanet_usp(*local, plan, conv_weights=[w[:, :0] for w in ws])
    elif name == "gdn_gate_dtypes_differ":  # 13 (ulysses 2)
        dtype = torch.float32 if rank == 0 else torch.float64
        q, k, v, g, beta = local
        gated_deltanet_usp(q, k, v, g.to(dtype), beta.to(dtype), plan)
    elif name == "gdn_value_heads_over_ulysses":  # value heads, not "query heads"
        odd, _ = _gdn(heads=3, key_heads=3)
        gated_deltanet_usp(*[plan.shard(t) for t in odd], plan)
    elif name == "gdn_documents_differ":  # boundaries, not hashes
        cu = torch.tensor([0, 8 if rank == 0 else 16, 32], dtype=torch.int32)
        gated_deltanet_usp(*local, plan, packed=cu)
    elif name == "attention_documents_differ":
        cu = torch.tensor([0, 8 if rank == 0 else 16, 32], dtype=torch.int32)
        plan.attention(*_attention_inputs(plan), causal=True, packed=cu)
    elif name == "mamba2_grad_on_one_rank":  # as 1, for the Mamba-2 scan
        inputs, _ = mamba_inputs(1, 32, 4, 2, 4, 4, 4, seed=2)
        x = plan.shard(inputs[0]).requires_grad_(rank == 0)
        out = _mamba2(plan, inputs, x)
        if out.requires_grad:  # rank 0 only
            out.sum().backward()
    elif name == "mamba2_chunk_size_bool":  # as 9
        _mamba2(plan, mamba_inputs(1, 32, 4, 2, 4, 4, 4, seed=2)[0], chunk_size=True)
    elif name == "pack_documents_differ":
        plan.pack(torch.tensor([0, 8 if rank == 0 else 16, 32], dtype=torch.int32))
    elif name == "mamba2_placed_documents":  # placement by length: not for Mamba-2 yet
        placed = usp.Plan(plan.topology, placement="documents")
        cu = torch.tensor([0, 8, 32], dtype=torch.int32)
        _mamba2(placed, mamba_inputs(1, 32, 4, 2, 4, 4, 4, seed=2)[0], packed=cu)
    elif name == "hf_register_placed_documents":  # the plug-in shards by sequence only
        from usp.models import hf as usp_hf

        usp_hf.register(usp.Plan(plan.topology, placement="documents"), name="usp_placed")
    else:
        raise AssertionError(f"unknown case {name}")


def run_refusal(name: str, ulysses: int, ring: int):
    """The case's error text on this rank, the bytes sent before it, and the error of a
    valid call (attention and GDN) after it."""
    topo = topology(ulysses, ring)
    plan = usp.Plan(topo)
    with short_timeouts(topo):
        topo.comm_stats.reset()
        try:
            _call(name, plan, dist.get_rank())
            message = "no error"
        except Exception as err:  # noqa: BLE001 - the test compares type and text
            message = f"{type(err).__name__}: {err}"
        sent = topo.comm_stats.total_sent
        after = max(_attention_still_exact(plan), _gdn_still_exact(plan))
        dist.barrier(group=topo.sp_group)
    return message, sent, after


REFUSALS = {
    "gdn_grad_on_one_rank": (
        (1, 2),
        "RankDisagreementError: gated_deltanet_usp: the ranks of the group disagree on "
        "needs_grad (rank 0: q requires grad; rank 1: no grad)",
    ),
    "sinks_values_differ": (
        (1, 2),
        "RankDisagreementError: usp_attention: the ranks of the group disagree on the values "
        "of sinks (every rank must pass the same sinks) (rank 0: [0.5, -0.25, 1.0, 0.125]; "
        "rank 1: [0.75, 0.0, 1.25, 0.375])",
    ),
    "sinks_grad_on_one_rank": (
        (1, 2),
        "RankDisagreementError: usp_attention: the ranks of the group disagree on needs_grad "
        "(rank 0: q, k, v, sinks require grad; rank 1: q, k, v require grad)",
    ),
    "gdn_nan_scale": (
        (1, 2),
        "LinearAttentionError: gated_deltanet_usp failed on ranks 0, 1 of 2: scale must be a "
        "finite number, or None for dk**-0.5",
    ),
    "mla_v_head_size_on_one_rank": (
        (1, 2),
        "RankDisagreementError: usp_attention: the ranks of the group disagree on v.shape[3] "
        "(rank 0: 16; rank 1: 8)",
    ),
    "gdn_chunk_size_bool": (
        (1, 2),
        "LinearAttentionError: gated_deltanet_usp failed on ranks 0, 1 of 2: chunk_size must "
        "be a positive int (the kernel's chunk length, e.g. 64), got True",
    ),
    "gdn_conv_weights_1d": (
        (1, 2),
        "LinearAttentionError: gated_deltanet_usp failed on ranks 0, 1 of 2: conv_weights must "
        "be (wq, wk, wv), each a floating-point tensor [channels, kernel] with channels "
        "[16, 16, 24]; got a tensor (16,), a tensor (16,), a tensor (24,)",
    ),
    "gdn_conv_width_0": (
        (1, 2),
        "LinearAttentionError: gated_deltanet_usp failed on ranks 0, 1 of 2: conv_weights' "
        "kernel size must be >= 1",
    ),
    "gdn_gate_dtypes_differ": (
        (2, 1),
        "RankDisagreementError: gated_deltanet_usp: the ranks of the group disagree on dtype "
        "of g, beta (rank 0: torch.float32; rank 1: torch.float64)",
    ),
    "gdn_value_heads_over_ulysses": (
        (2, 1),
        "UlyssesHeadError: gated_deltanet_usp failed on ranks 0, 1 of 2: cannot split 3 GDN "
        "value heads / 3 key heads over ulysses=2: num_heads(3) is not divisible by "
        "ulysses(2): every Ulysses rank must hold the same number of value heads. valid "
        "(ulysses, ring) pairs for sp_size=2 with 3 value heads / 3 key heads: (1, 2)",
    ),
    "gdn_documents_differ": (
        (1, 2),
        "RankDisagreementError: gated_deltanet_usp: the ranks of the group disagree on "
        "documents (rank 0: cu_seqlens [0, 8, 32]; rank 1: cu_seqlens [0, 16, 32])",
    ),
    "attention_documents_differ": (
        (1, 2),
        "RankDisagreementError: usp_attention: the ranks of the group disagree on documents "
        "(cu_seqlens) (rank 0: cu_seqlens [0, 8, 32]; rank 1: cu_seqlens [0, 16, 32])",
    ),
    "mamba2_grad_on_one_rank": (
        (1, 2),
        "RankDisagreementError: mamba2_usp: the ranks of the group disagree on needs_grad "
        "(rank 0: x requires grad; rank 1: no grad)",
    ),
    "mamba2_chunk_size_bool": (
        (1, 2),
        "Mamba2Error: mamba2_usp failed on ranks 0, 1 of 2: chunk_size must be a positive int "
        "(the kernel's chunk length, e.g. 64), got True",
    ),
    "pack_documents_differ": (
        (1, 2),
        "RankDisagreementError: Plan.pack: the ranks of the group disagree on cu_seqlens "
        "(rank 0: cu_seqlens [0, 8, 32]; rank 1: cu_seqlens [0, 16, 32])",
    ),
    "mamba2_placed_documents": (
        (1, 2),
        "Mamba2Error: mamba2_usp does not place documents by length yet: use a plan with "
        'placement="sequence"',
    ),
    "hf_register_placed_documents": (
        (1, 2),
        'ValueError: usp.models.hf.register: a plan with placement="documents" (documents '
        "placed whole by length) is not supported by the HF plug-in yet",
    ),
}


@pytest.mark.parametrize("name", list(REFUSALS))
def test_a_bad_call_is_the_same_usp_error_on_every_rank(distributed, name):
    (ulysses, ring), expected = REFUSALS[name]
    results = distributed.run(run_refusal, name, ulysses, ring, world_size=2, timeout=TIMEOUT)
    messages = {message for message, _, _ in results}
    assert len(messages) == 1, f"ranks raised different errors: {messages}"
    message = messages.pop()
    assert message.startswith(expected), message
    assert "\n" not in message, message
    for _, sent, after in results:
        assert sent == 0, f"{sent} bytes sent before the error"
        assert after < 1e-10, "a valid call after the refusal is wrong"


# ------------------------------------------------------------------ 2, 10: long chunks
def run_long_chunks(ulysses, ring):
    """chunk_size far beyond the sequence (4096 and 10**6 over 32 tokens) computes the
    same as chunk 64: forward and gradients against the float64 reference."""
    topo = topology(ulysses, ring)
    plan = usp.Plan(topo)
    inputs, ws = _gdn(seed=7)
    dout = torch.randn(1, 32, 4, 6, generator=torch.Generator().manual_seed(8), dtype=torch.float64)
    leaves = [t.clone().requires_grad_() for t in inputs]
    expected = reference_gdn(*leaves, ws)
    expected_grads = torch.autograd.grad(expected, leaves, dout)
    m_inputs, m_dout = mamba_inputs(1, 32, 4, 2, 4, 4, 4, seed=4)
    m_leaves = [t.clone().requires_grad_() for t in m_inputs]
    m_expected = reference_mamba2(*m_leaves)
    m_grads = torch.autograd.grad(m_expected, m_leaves[:4], m_dout)
    errors = {}
    with short_timeouts(topo):
        for chunk in (4096, 10**6):
            local = [plan.shard(t).requires_grad_() for t in inputs]
            out = gated_deltanet_usp(*local, plan, conv_weights=ws, chunk_size=chunk)
            grads = torch.autograd.grad(out, local, plan.shard(dout))
            errors[f"gdn {chunk}"] = max(
                relative_error(plan.gather(out), expected),
                *(relative_error(plan.gather(g), e) for g, e in zip(grads, expected_grads)),
            )
            x, b, c, dt = (plan.shard(t).requires_grad_() for t in m_inputs[:4])
            out = mamba2_usp(x, b, c, dt, m_inputs[4], plan, d=m_inputs[5],
                             conv_weight=m_inputs[6], conv_bias=m_inputs[7], chunk_size=chunk)  # fmt: skip
            grads = torch.autograd.grad(out, (x, b, c, dt), plan.shard(m_dout))
            errors[f"mamba2 {chunk}"] = max(
                relative_error(plan.gather(out), m_expected),
                *(relative_error(plan.gather(g), e) for g, e in zip(grads, m_grads)),
            )
        dist.barrier(group=topo.sp_group)
    return errors


@pytest.mark.parametrize("ulysses,ring", [(1, 2), (2, 1)])
def test_a_chunk_longer_than_the_sequence_computes_exactly(distributed, ulysses, ring):
    for errors in distributed.run(run_long_chunks, ulysses, ring, world_size=2, timeout=TIMEOUT):
        assert set(errors) == {f"{op} {n}" for op in ("gdn", "mamba2") for n in (4096, 10**6)}
        assert all(error < 1e-10 for error in errors.values()), errors
