"""The chunked loss (``usp.models.loss``'s autograd function over all chunks) against one
unchunked pass through autograd (``chunk_tokens=None``: ``F.linear`` + ``F.cross_entropy``),
value and both gradients, and its memory-periodic loops under the planner's fake tensors:
the same peak with every chunk run and with the representative chunks only.

Tolerances: float64 1e-12 (relative); float32 and bf16 against the float64 value of the
same inputs, at a bound the unchunked autograd path in that dtype must meet as well (so
the chunking never rounds worse than what it replaces, beyond a small factor).
"""

from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed._tools.mem_tracker import MemTracker
from torch.utils._python_dispatch import TorchDispatchMode

from usp.errors import InputError
from usp.models import cross_entropy_sum, sp_cross_entropy
from usp.models import loss as loss_module
from usp.models.loss import chunked_cross_entropy_sum
from usp.models.tiling import representative_tiles

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB, DIM = 53, 12


def _inputs(tokens, dtype, *, targets=None, ignored=0, seed=0):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(2, tokens, DIM, generator=gen, dtype=torch.float64).to(dtype)
    weight = torch.randn(VOCAB, DIM, generator=gen, dtype=torch.float64).to(dtype)
    labels = torch.randint(0, VOCAB, (2, tokens), generator=gen)
    if targets is not None:
        labels.fill_(targets)
    labels.view(-1)[:ignored] = -100
    return hidden, weight, labels


def _run(hidden, weight, labels, chunk, *, grads=(True, True), scale=0.7):
    """(sum, count, dhidden, dweight) of cross_entropy_sum backpropagated with ``scale``."""
    hidden = hidden.detach().requires_grad_(grads[0])
    weight = weight.detach().requires_grad_(grads[1])
    total, count = cross_entropy_sum(hidden, weight, labels, chunk_tokens=chunk)
    if total.requires_grad:
        total.backward(torch.tensor(scale, dtype=total.dtype))
    return total.detach(), count, hidden.grad, weight.grad


def _close(actual, expected, rtol):
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    scale = expected.abs().max().clamp(min=1)
    err = (actual.double() - expected.double()).abs().max() / scale
    assert err <= rtol, (err.item(), rtol)


# (tokens per row, chunk, ignored labels, all targets one value): 2 rows of tokens
CASES = {
    "partial_last_chunk": (37, 10, 3, None),  # 71 labels: 7 chunks of 10 and one of 1
    "dividing_chunk": (20, 8, 0, None),  # 40 labels: 5 chunks
    "fewer_than_a_chunk": (5, 64, 2, None),
    "one_target": (19, 6, 0, 7),  # every label the same token
    "chunk_of_one": (4, 1, 1, None),
}


@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_float64_equals_unchunked_autograd(case):
    tokens, chunk, ignored, targets = CASES[case]
    hidden, weight, labels = _inputs(tokens, torch.float64, targets=targets, ignored=ignored)
    expected = _run(hidden, weight, labels, None)
    actual = _run(hidden, weight, labels, chunk)
    assert actual[1] == expected[1] == 2 * tokens - ignored
    for got, want in zip(actual[:1] + actual[2:], expected[:1] + expected[2:]):
        _close(got, want, 1e-12)


@pytest.mark.parametrize(
    ("dtype", "rtol"),
    [(torch.float32, (5e-7, 1e-6, 1e-6)), (torch.bfloat16, (5e-4, 1.5e-2, 1.5e-2))],
    ids=["float32", "bfloat16"],
)
def test_low_precision_within_tolerance_of_float64(dtype, rtol):
    """Value, dhidden, dweight within ``rtol`` of the float64 result on the same (rounded)
    inputs; the unchunked autograd path in ``dtype`` is held to the same bound."""
    hidden, weight, labels = _inputs(37, dtype, ignored=3, seed=1)
    exact = _run(hidden.double(), weight.double(), labels, None)
    for chunk in (None, 10):  # None: what the chunking must be as good as
        total, count, dhidden, dweight = _run(hidden, weight, labels, chunk)
        assert total.dtype == torch.float32 and dhidden.dtype == dweight.dtype == dtype
        for got, want, tol in zip((total, dhidden, dweight), exact[:1] + exact[2:], rtol):
            _close(got.double(), want, tol)


def test_no_labels_gives_zero_in_the_graph():
    hidden, weight, labels = _inputs(6, torch.float64, ignored=12)
    for chunk in (None, 4):
        total, count, dhidden, dweight = _run(hidden, weight, labels, chunk)
        assert count == 0 and total.item() == 0.0
        assert torch.equal(dhidden, torch.zeros_like(hidden))
        assert torch.equal(dweight, torch.zeros_like(weight))


@pytest.mark.parametrize(
    "grads", [(True, False), (False, True)], ids=["frozen_weight", "frozen_hidden"]
)
def test_one_input_without_grad(grads):
    hidden, weight, labels = _inputs(23, torch.float64, ignored=1)
    expected = _run(hidden, weight, labels, None, grads=grads)
    actual = _run(hidden, weight, labels, 5, grads=grads)
    _close(actual[0], expected[0], 1e-12)
    for got, want, needed in zip(actual[2:], expected[2:], grads):
        assert (got is None) == (want is None) == (not needed)
        if needed:
            _close(got, want, 1e-12)


@pytest.mark.parametrize("frozen", [False, True], ids=["trained", "frozen"])
def test_tied_embedding(frozen):
    """The output projection is the embedding that made the hidden states: one weight,
    two uses; frozen, nothing needs a gradient and the value is still exact."""
    gen = torch.Generator().manual_seed(3)
    embedding = torch.randn(VOCAB, DIM, generator=gen, dtype=torch.float64)
    ids = torch.randint(0, VOCAB, (2, 17), generator=gen)
    labels = torch.randint(0, VOCAB, (2, 17), generator=gen)
    results = []
    for chunk in (None, 4):
        weight = embedding.clone().requires_grad_(not frozen)
        hidden = torch.tanh(weight[ids])  # [2, 17, dim], from the same weight
        loss = sp_cross_entropy(hidden, weight, labels, chunk_tokens=chunk)
        assert loss.requires_grad == (not frozen)
        if not frozen:
            loss.backward()
        results.append((loss.detach(), weight.grad))
    _close(results[1][0], results[0][0], 1e-12)
    if frozen:
        assert results[0][1] is None and results[1][1] is None
    else:
        _close(results[1][1], results[0][1], 1e-12)


def test_rows_of_hidden_by_index():
    """The function itself over chosen rows (out of order, some rows without a target):
    equal to autograd over ``hidden[rows]``; the other rows' gradient is zero."""
    gen = torch.Generator().manual_seed(4)
    hidden = torch.randn(40, DIM, generator=gen, dtype=torch.float64)
    weight = torch.randn(VOCAB, DIM, generator=gen, dtype=torch.float64)
    rows = torch.randperm(40, generator=gen)[:27]
    targets = torch.randint(0, VOCAB, (27,), generator=gen)
    results = []
    for chunked in (False, True):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        if chunked:
            total = chunked_cross_entropy_sum(h, w, targets, 6, rows=rows)
        else:
            total = loss_module._chunk_loss_sum(h[rows], w, targets)
        total.backward()
        results.append((total.detach(), h.grad, w.grad))
    for got, want in zip(*reversed(results)):
        _close(got, want, 1e-12)
    unlabelled = torch.ones(40, dtype=torch.bool)
    unlabelled[rows] = False
    assert torch.equal(results[1][1][unlabelled], torch.zeros(13, DIM, dtype=torch.float64))


def test_real_tensors_run_every_chunk_inside_representative_tiles():
    hidden, weight, labels = _inputs(37, torch.float64, ignored=3)
    expected = _run(hidden, weight, labels, 10)
    with representative_tiles():
        actual = _run(hidden, weight, labels, 10)
    for got, want in zip(actual[:1] + actual[2:], expected[:1] + expected[2:]):
        assert torch.equal(got, want)


def test_bad_inputs_are_refused():
    hidden, weight = torch.randn(6, DIM), torch.randn(VOCAB, DIM)
    targets = torch.zeros(6, dtype=torch.int64)
    with pytest.raises(InputError, match="integer chunk_tokens"):
        chunked_cross_entropy_sum(hidden, weight, targets, None)
    with pytest.raises(ValueError, match="positive integer"):
        chunked_cross_entropy_sum(hidden, weight, targets, 0)
    with pytest.raises(InputError, match=r"targets \[n\]"):
        chunked_cross_entropy_sum(hidden, weight, targets[:5], 4)
    with pytest.raises(InputError, match="one dtype"):
        chunked_cross_entropy_sum(hidden.double(), weight, targets, 4)


class _CountOps(TorchDispatchMode):
    """Counts the matmuls dispatched (to tell how many chunks ran)."""

    def __init__(self):
        super().__init__()
        self.matmuls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (
            torch.ops.aten.mm.default,
            torch.ops.aten.mm.out,
            torch.ops.aten.addmm_.default,
        ):
            self.matmuls += 1
        return func(*args, **(kwargs or {}))


def _fake_peak(rows, chunk, dtype, representative, labelled=None):
    """Peak bytes (MemTracker) and matmul count of the chunked loss's forward + backward
    over fake tensors, as ``usp plan`` runs it; ``labelled`` of the rows carry a target
    (default all)."""
    labelled = rows if labelled is None else labelled
    mode = representative_tiles() if representative else nullcontext()
    with mode, FakeTensorMode():
        hidden = torch.empty(rows, 64, dtype=dtype, requires_grad=True)
        weight = torch.empty(1000, 64, dtype=dtype, requires_grad=True)
        targets = torch.zeros(labelled, dtype=torch.int64)
        index = torch.arange(labelled)
        tracker, counter = MemTracker(), _CountOps()
        with tracker, counter:
            loss = chunked_cross_entropy_sum(hidden, weight, targets, chunk, rows=index)
            loss.backward()
        peak = tracker.get_tracker_snapshot("peak")
    return sum(int(snap.get("Total", 0)) for snap in peak.values()), counter.matmuls


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bfloat16", "float32"])
@pytest.mark.parametrize("rows", [9 * 48 + 17, 10 * 48], ids=["partial_last", "full_last"])
def test_representative_chunks_give_the_same_fake_peak(rows, dtype):
    """10 chunks (the last partial or full): running the first and last only, as the
    planner does, gives the same peak byte for byte, and does run fewer chunks."""
    full_peak, full_matmuls = _fake_peak(rows, 48, dtype, representative=False)
    peak, matmuls = _fake_peak(rows, 48, dtype, representative=True)
    assert full_matmuls == 10 * 4 and matmuls == 2 * 4  # forward 1, backward 3 per chunk
    assert peak == full_peak > 1000 * 64 * dtype.itemsize


def test_the_benchmark_sees_equal_fake_peaks_through_sp_cross_entropy():
    """``benchmarks/loss_memory.py --fake`` at a tiny size: the whole entry point (label
    selection, the chunked loss, the SP normalisation) under fake tensors, 5 chunks, the
    last partial; the representative run gives the same peak."""
    from benchmarks import loss_memory

    rows = [
        loss_memory.measure_fake(4 * 32 + 5, 16, 300, 32, "bfloat16", "cpu", representative)
        for representative in (False, True)
    ]
    assert rows[0]["peak_bytes"] == rows[1]["peak_bytes"] > 300 * 16 * 2


def test_fewer_labels_never_need_more_memory():
    """What ``usp plan`` relies on when it labels every token: under fake tensors the
    peak with a quarter, half or all but one of the rows labelled is at most the peak
    with all of them."""
    rows = 10 * 48
    everything, _ = _fake_peak(rows, 48, torch.bfloat16, representative=False)
    for labelled in (0, rows // 4, rows // 2, rows - 1):
        peak, _ = _fake_peak(rows, 48, torch.bfloat16, representative=False, labelled=labelled)
        assert peak <= everything, (labelled, peak, everything)


def run_sp_chunked_loss(chunk):
    """One rank's shard of a float64 sequence: (loss, its rows' dhidden, dweight summed
    over the group) of the chunked SP loss with a non-default ignore_index and
    num_items_in_batch; rank 2 has no labels."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    hidden, weight, labels = _sp_case(world)
    rows = slice(rank * 9, (rank + 1) * 9)  # this rank's 9 of the [1, 9 * world] tokens
    local_hidden = hidden[:, rows].clone().requires_grad_()
    weight = weight.clone().requires_grad_()
    loss = sp_cross_entropy(local_hidden, weight, labels[:, rows], dist.group.WORLD,
                            ignore_index=-7, chunk_tokens=chunk, num_items_in_batch=29)  # fmt: skip
    loss.backward()
    dist.all_reduce(weight.grad)
    return loss.detach(), local_hidden.grad, weight.grad


def _sp_case(world):
    gen = torch.Generator().manual_seed(5)
    hidden = torch.randn(1, 9 * world, DIM, generator=gen, dtype=torch.float64)
    weight = torch.randn(VOCAB, DIM, generator=gen, dtype=torch.float64)
    labels = torch.randint(0, VOCAB, (1, 9 * world), generator=gen)
    labels[:, 18:27] = -7  # rank 2's shard: no labels
    labels[:, 1] = labels[:, 30] = -7
    return hidden, weight, labels


def test_sp_chunked_loss_on_4_ranks_equals_one_process(distributed):
    """4 gloo ranks against one process (chunk_tokens=None), float64: the loss on every
    rank, each rank's hidden-state gradient and the summed weight gradient, 1e-12."""
    hidden, weight, labels = _sp_case(4)
    hidden.requires_grad_(), weight.requires_grad_()
    expected = sp_cross_entropy(
        hidden, weight, labels, ignore_index=-7, chunk_tokens=None, num_items_in_batch=29
    )
    expected.backward()
    for rank, (loss, dhidden, dweight) in enumerate(
        distributed.run(run_sp_chunked_loss, 4, world_size=4)
    ):
        _close(loss, expected.detach(), 1e-12)
        _close(dhidden, hidden.grad[:, rank * 9 : (rank + 1) * 9], 1e-12)
        _close(dweight, weight.grad, 1e-12)
    assert hidden.grad[:, 18:27].abs().max() == 0  # rank 2's rows: no labels, zero gradient
