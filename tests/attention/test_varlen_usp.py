"""Packed variable-length sequences through USP attention (document masking).

Multi-process gloo runs on 4 and 8 ranks over several (ulysses, ring) grids, with random
document lengths (length-1 documents, one document spanning everything, many short
ones), compared with a single-process float64 reference that applies the block-diagonal
document mask. Tolerances as for dense USP: float32 1e-5, bfloat16 2e-2 / 4e-2.
"""

from __future__ import annotations

import random

import pytest
import torch
from reference import document_mask, reference_attention, relative_error
from usp_cases import topology

import usp
from usp.ring.documents import Documents
from usp.ring.layout import attention_pairs

TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (2e-2, 4e-2)}


def document_lengths(kind: str, seed: int) -> list[int]:
    rng = random.Random(seed)
    if kind == "mixed":  # includes length-1 documents
        return [rng.choice([1, 1, 2, 3, 7, 13, 20, 33]) for _ in range(7)]
    if kind == "one":  # a single document spanning everything
        return [rng.randint(40, 90)]
    if kind == "many-short":
        return [rng.randint(1, 4) for _ in range(20)]
    raise ValueError(kind)


def cu_of(lengths) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def run_packed_case(ulysses, ring, layout, ring_impl, causal, kind, dtype_name, seed=0):
    topo = topology(ulysses, ring)
    dtype = getattr(torch, dtype_name)
    raw_cu = cu_of(document_lengths(kind, seed))
    padding = usp.pad_documents(raw_cu, topo, layout=layout)
    cu = padding.cu_seqlens
    total, heads, kv_heads, dim = padding.padded_len, 8, 2, 16
    gen = torch.Generator().manual_seed(seed)
    q, k, v, dout = (
        torch.randn(1, total, h, dim, generator=gen, dtype=torch.float64)
        for h in (heads, kv_heads, kv_heads, heads)
    )
    ref = [t.clone().requires_grad_() for t in (q, k, v)]
    ref_out, _ = reference_attention(*ref, mask=document_mask(cu.tolist(), causal))
    expected = [ref_out.detach(), *torch.autograd.grad(ref_out, ref, dout)]

    local = [
        usp.shard_sequence(t, topo, layout=layout, cu_seqlens=cu).to(dtype).requires_grad_()
        for t in (q, k, v)
    ]
    out = usp.usp_attention(
        *local, topo, causal=causal, layout=layout, ring_impl=ring_impl, cu_seqlens=cu
    )
    out.backward(usp.shard_sequence(dout, topo, layout=layout, cu_seqlens=cu).to(dtype))
    actual = [out.detach(), *(t.grad for t in local)]
    gathered = [usp.gather_sequence(a, topo, layout=layout, cu_seqlens=cu) for a in actual]
    return {
        n: relative_error(a, e) for n, a, e in zip(("out", "dq", "dk", "dv"), gathered, expected)
    }


GRIDS = [(8, (8, 1)), (8, (4, 2)), (8, (2, 4)), (8, (1, 8)), (4, (4, 1)), (4, (2, 2)), (4, (1, 4))]
KINDS = ["mixed", "one", "many-short"]


@pytest.mark.parametrize("world,grid", GRIDS, ids=[f"{w}ranks-u{u}r{r}" for w, (u, r) in GRIDS])
def test_packed_usp_matches_per_document_reference(distributed, world, grid):
    failures, index = [], 0
    for layout in ("zigzag", "contiguous"):
        for ring_impl in ("p2p", "allgather"):
            for causal in (True, False):
                kind = KINDS[index % len(KINDS)]
                index += 1
                for dtype in (
                    ["float32", "bfloat16"] if causal and ring_impl == "p2p" else ["float32"]
                ):
                    case = (layout, ring_impl, causal, kind, dtype)
                    results = distributed.run(
                        run_packed_case, *grid, *case, seed=index, world_size=world, timeout=300
                    )
                    out_tol, grad_tol = TOL[getattr(torch, dtype)]
                    for rank, errors in enumerate(results):
                        for name, err in errors.items():
                            if err > (out_tol if name == "out" else grad_tol):
                                failures.append(f"{case} rank {rank} {name}: {err:.3g}")
    assert not failures, "\n".join(failures)


def run_unpadded_length_one_documents(ring_impl):
    """With ring 1 and the contiguous layout every document length is valid as is."""
    topo = topology(4, 1)
    cu = cu_of([1, 5, 1, 1, 9, 2, 1, 4])  # 24 tokens, 6 per rank
    gen = torch.Generator().manual_seed(5)
    q, k, v, dout = (
        torch.randn(1, 24, h, 16, generator=gen, dtype=torch.float64) for h in (8, 4, 4, 8)
    )
    ref = [t.clone().requires_grad_() for t in (q, k, v)]
    ref_out, _ = reference_attention(*ref, mask=document_mask(cu.tolist(), True))
    expected = [ref_out.detach(), *torch.autograd.grad(ref_out, ref, dout)]
    local = [
        usp.shard_sequence(t, topo, layout="contiguous", cu_seqlens=cu).float().requires_grad_()
        for t in (q, k, v)
    ]
    out = usp.usp_attention(
        *local, topo, causal=True, layout="contiguous", ring_impl=ring_impl, cu_seqlens=cu
    )
    out.backward(usp.shard_sequence(dout, topo, layout="contiguous", cu_seqlens=cu).float())
    actual = [out.detach(), *(t.grad for t in local)]
    gathered = [usp.gather_sequence(a, topo, layout="contiguous", cu_seqlens=cu) for a in actual]
    return max(relative_error(a, e) for a, e in zip(gathered, expected))


@pytest.mark.parametrize("ring_impl", ["p2p", "allgather"])
def test_length_one_documents_without_padding(distributed, ring_impl):
    for error in distributed.run(run_unpadded_length_one_documents, ring_impl, world_size=4):
        assert error < 1e-5


# ------------------------------------------------------------------ balance
@pytest.mark.parametrize("ring_size", [2, 4, 8])
def test_zigzag_packed_work_is_balanced_and_contiguous_is_not(ring_size):
    rng = random.Random(ring_size)
    worst_zigzag, worst_contiguous = 1.0, 1.0
    for _ in range(20):
        raw = [rng.randint(1, 3000) for _ in range(rng.randint(1, 30))]
        for layout in ("zigzag", "contiguous"):
            chunks = 2 * ring_size if layout == "zigzag" else ring_size
            docs = Documents(tuple(-(-n // chunks) * chunks for n in raw), ring_size, layout)
            work = [attention_pairs(docs, causal=True, ring_rank=i) for i in range(ring_size)]
            imbalance = max(work) / (sum(work) / ring_size)
            if layout == "zigzag":
                worst_zigzag = max(worst_zigzag, imbalance)
            else:
                worst_contiguous = max(worst_contiguous, imbalance)
    print(
        f"ring {ring_size}: max/mean work zigzag {worst_zigzag:.4f}, contiguous {worst_contiguous:.3f}"
    )
    assert worst_zigzag <= 1.02
    assert (
        worst_contiguous >= 1 + 0.6 * (ring_size - 1) / ring_size
    )  # ~ (2r-1)/r for long documents


def test_work_count_matches_a_brute_force_count():
    # one rank of a ring of 3, zigzag, documents of 6 and 12 tokens: count visible pairs directly
    docs = Documents((6, 12), 3, "zigzag")
    cu = [0, 6, 18]
    mask = document_mask(cu, causal=True)
    for rank in range(3):
        positions = usp.sp.sharding.sequence_positions(
            18, ring_size=3, ring_rank=rank, cu_seqlens=torch.tensor(cu, dtype=torch.int32)
        )
        assert attention_pairs(docs, causal=True, ring_rank=rank) == int(mask[positions].sum())


# ------------------------------------------------------------------ helpers and errors
def test_pad_documents_keeps_every_token_and_pads_labels():
    class Degrees:
        ring_degree, ulysses_degree = 2, 3

    cu = cu_of([5, 1, 14])
    padding = usp.pad_documents(cu, Degrees(), layout="zigzag")
    assert padding.cu_seqlens.tolist() == [
        0,
        8,
        12,
        28,
        36,
    ]  # docs to multiples of 4, + a pad document
    ids = torch.arange(1, 21)[None]
    padded = padding.apply(ids, 0)
    assert padded[padded != 0].tolist() == list(range(1, 21))
    labels = padding.apply(ids, -100)
    assert (labels == -100).sum() == 16
    # the padded sequence shards cleanly
    usp.sp.sharding.sequence_positions(
        36, ring_size=2, ring_rank=1, ulysses_size=3, ulysses_rank=2, cu_seqlens=padding.cu_seqlens
    )


def run_position_ids():
    topo = topology(2, 2)
    cu = cu_of([8, 4, 12])
    local = usp.local_position_ids(cu, topo)
    full = usp.document_position_ids(cu)
    return (
        local.tolist(),
        usp.gather_sequence(local[None], topo, cu_seqlens=cu)[0].tolist(),
        full.tolist(),
    )


def test_position_ids_restart_in_every_document_and_shard_like_tokens(distributed):
    for local, gathered, full in distributed.run(run_position_ids, world_size=4):
        assert full == list(range(8)) + list(range(4)) + list(range(12))
        assert gathered == full
        assert len(local) == 6


def run_bad_boundaries(kind):
    topo = topology(2, 2)
    q = torch.randn(1, 8, 8, 16)
    kv = torch.randn(1, 8, 2, 16)
    cu = {
        "decreasing": torch.tensor([0, 16, 8, 32], dtype=torch.int32),
        "start": torch.tensor([4, 16, 32], dtype=torch.int32),
        "end": torch.tensor([0, 16, 24], dtype=torch.int32),
        "dtype": torch.tensor([0, 16, 32], dtype=torch.int64),
        "odd_document": torch.tensor([0, 13, 32], dtype=torch.int32),
        "batch": torch.tensor([0, 16, 32], dtype=torch.int32),
    }[kind]
    try:
        if kind == "batch":
            usp.usp_attention(
                q.expand(2, -1, -1, -1),
                kv.expand(2, -1, -1, -1),
                kv.expand(2, -1, -1, -1),
                topo,
                cu_seqlens=cu,
            )
        else:
            usp.usp_attention(q, kv, kv, topo, causal=True, cu_seqlens=cu)
    except ValueError as err:
        message = str(err)
    else:
        message = "no error"
    try:
        usp.shard_sequence(torch.randn(1, 32, 4), topo, cu_seqlens=cu)
    except ValueError as err:
        return message, str(err)
    return message, "no error"


@pytest.mark.parametrize(
    "kind,message",
    [
        ("decreasing", "cu_seqlens must be non-decreasing, but entry 2 (8) < entry 1 (16)"),
        ("start", "cu_seqlens must start at 0, got 4"),
        ("end", "cu_seqlens must end at the number of tokens (32), got 24"),
        ("dtype", "cu_seqlens must have dtype torch.int32, got torch.int64"),
        (
            "odd_document",
            "document 0 has 13 tokens; the zigzag layout on a ring of 2 cuts every document into 4 equal chunks, so it needs a multiple of 4 (pad documents with usp.pad_documents)",
        ),
        ("batch", "packed sequences (cu_seqlens) need batch size 1, got 2"),
    ],
)
def test_bad_boundaries_are_explained(distributed, kind, message):
    for attention_error, shard_error in distributed.run(run_bad_boundaries, kind, world_size=4):
        assert message in attention_error, attention_error
        if kind != "batch":
            assert message in shard_error, shard_error
