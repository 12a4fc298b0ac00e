"""usp.rl's pieces in one process: the chunked per-token statistics against autograd
through the full logits (float64, values and gradients, every chunk size, a
temperature), the row layout of padded rows (which token scores where, both
directions), the refusals of rows usp cannot place, and DPO's labels.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import usp
from usp.errors import InputError
from usp.rl import (
    completion_labels,
    preference_logps,
    row_spans,
    shard_rows,
    token_logprobs,
)

pytestmark = pytest.mark.usefixtures("one_thread")
TOL = 1e-12


def full_logits_reference(hidden, weight, targets, temperature, w_logp, w_entropy):
    """Autograd through the full [N, V] logits: log-probs, entropies, mean logits,
    argmax hits, and the gradients of sum(w_logp * logp + w_entropy * H)."""
    hidden = hidden.detach().clone().requires_grad_()
    weight = weight.detach().clone().requires_grad_()
    scaled = F.linear(hidden, weight) / temperature  # [N, V]
    log_p = torch.log_softmax(scaled, -1)
    keep = targets != -100
    logp = log_p.gather(1, targets.clamp(min=0)[:, None])[:, 0] * keep
    entropy = -(log_p.exp() * log_p).sum(-1) * keep
    (w_logp * logp + w_entropy * entropy).sum().backward()
    return {
        "logprobs": logp.detach(),
        "entropy": entropy.detach(),
        "mean_logits": scaled.mean(-1).detach() * keep,
        "is_top1": (scaled.argmax(-1) == targets) & keep,
        "dhidden": hidden.grad,
        "dweight": weight.grad,
    }


@pytest.mark.parametrize("chunk", [1, 3, 1024])
def test_token_stats_equal_autograd_through_the_full_logits(chunk):
    gen = torch.Generator().manual_seed(0)
    n, dim, vocab, temperature = 11, 6, 17, 0.7
    hidden = torch.randn(n, dim, generator=gen, dtype=torch.float64)
    weight = torch.randn(vocab, dim, generator=gen, dtype=torch.float64)
    targets = torch.randint(0, vocab, (n,), generator=gen)
    targets[[0, 4, 5]] = -100  # no target: zeros, no gradient
    w_logp, w_entropy = (torch.randn(n, generator=gen, dtype=torch.float64) for _ in range(2))
    expected = full_logits_reference(hidden, weight, targets, temperature, w_logp, w_entropy)

    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    stats = token_logprobs(
        h, w, targets, temperature=temperature, chunk_tokens=chunk,
        outputs=("entropy", "mean_logits", "is_top1"),
    )  # fmt: skip
    (w_logp * stats.logprobs + w_entropy * stats.entropy).sum().backward()
    for name in ("logprobs", "entropy", "mean_logits"):
        assert torch.allclose(getattr(stats, name), expected[name], rtol=TOL, atol=TOL), name
    assert torch.equal(stats.is_top1, expected["is_top1"])
    assert torch.allclose(h.grad, expected["dhidden"], rtol=1e-10, atol=1e-12)
    assert torch.allclose(w.grad, expected["dweight"], rtol=1e-10, atol=1e-12)
    assert stats.logprobs.dtype == torch.float64


def test_another_ignore_index():
    """``ignore_index=-1`` marks the tokens without a target for the log-probs, the rows
    and DPO's labels."""
    gen = torch.Generator().manual_seed(2)
    hidden, weight = torch.randn(4, 3, generator=gen), torch.randn(7, 3, generator=gen)
    targets = torch.tensor([2, -1, 5, -100])
    with pytest.raises(InputError, match="token ids in"):  # -100 is a target now
        token_logprobs(hidden, weight, targets, ignore_index=-1)
    stats = token_logprobs(hidden, weight, targets.clamp(min=-1), ignore_index=-1)
    assert stats.logprobs[1] == 0 and stats.logprobs[0] != 0
    ids = torch.tensor([[5, 6, 7, 8]])
    labels = completion_labels(ids, torch.tensor([[0, 0, 1, 1]]), ignore_index=-1)
    assert labels.tolist() == [[-1, -1, 7, 8]]
    shard = shard_rows(usp.Plan(None), ids, labels=labels, ignore_index=-1)
    assert shard.targets.tolist() == [[-1, 7, 8, -1]] and shard.index.tolist() == [[-1, 1, 2, -1]]


def test_log_probs_alone_and_float32():
    """Without optional outputs only the log-probs come back; float32 hidden states give
    float32 values (the loss's dtype) within float32 rounding of float64."""
    gen = torch.Generator().manual_seed(1)
    hidden = torch.randn(2, 5, 8, generator=gen)
    weight = torch.randn(13, 8, generator=gen)
    targets = torch.randint(0, 13, (2, 5), generator=gen)
    stats = token_logprobs(hidden, weight, targets, chunk_tokens=4)
    assert stats.entropy is None and stats.mean_logits is None and stats.is_top1 is None
    assert stats.logprobs.shape == (2, 5) and stats.logprobs.dtype == torch.float32
    exact = torch.log_softmax(hidden.double() @ weight.double().T, -1)
    exact = exact.gather(-1, targets[..., None])[..., 0]
    assert torch.allclose(stats.logprobs.double(), exact, atol=1e-5)


def test_token_logprobs_refuses_bad_arguments():
    hidden, weight = torch.zeros(3, 4), torch.zeros(5, 4)
    targets = torch.zeros(3, dtype=torch.int64)
    cases = [
        ({"temperature": 0.0}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"outputs": ("entropies",)}, "unknown outputs"),
        ({"chunk_tokens": 0}, "loss_chunk_tokens"),
    ]
    for kwargs, match in cases:
        with pytest.raises((InputError, ValueError), match=match):
            token_logprobs(hidden, weight, targets, **kwargs)
    with pytest.raises(InputError, match="token ids in"):
        token_logprobs(hidden, weight, torch.tensor([0, 5, 1]))
    with pytest.raises(InputError, match="targets shape"):
        token_logprobs(hidden, weight, targets[:2])


# ----------------------------------------------------------------------------- rows
def padded_rows():
    """Three rows: left-padded prompts (3, 1, 2 real tokens) then right-padded
    completions (2, 3, 0 tokens) -- TRL's GRPO layout -- as ids, mask and labels
    (the completion tokens)."""
    prompt = torch.tensor([[5, 6, 7], [0, 0, 8], [0, 9, 10]])
    prompt_mask = (prompt != 0).long()
    completion = torch.tensor([[11, 12, 0], [13, 14, 15], [0, 0, 0]])
    completion_mask = torch.tensor([[1, 1, 0], [1, 1, 1], [0, 0, 0]])
    ids = torch.cat([prompt, completion], 1)
    mask = torch.cat([prompt_mask, completion_mask], 1)
    labels = torch.cat(
        [torch.full_like(prompt, -100), completion.masked_fill(completion_mask == 0, -100)], 1
    )
    return ids, mask, labels


def test_rows_become_documents_scored_in_trls_layout():
    ids, mask, labels = padded_rows()
    starts, lengths = row_spans(mask)
    assert starts.tolist() == [0, 2, 1] and lengths.tolist() == [5, 4, 2]
    shard = shard_rows(usp.Plan(None), ids, labels=labels, attention_mask=mask, pad_token_id=1)
    assert (shard.rows, shard.columns) == (3, 5)
    packed = shard.batch.input_ids[0].tolist()
    assert packed == [5, 6, 7, 11, 12, 8, 13, 14, 15, 9, 10]
    assert shard.batch.position_ids[0].tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 3, 0, 1]
    # the prediction at a row's column t scores its token t + 1: TRL's log_probs[:, t]
    assert shard.targets[0].tolist() == [-100, -100, 11, 12, -100, 13, 14, 15, -100, -100, -100]
    expected_index = [-1, -1, 0 * 5 + 2, 0 * 5 + 3, -1, 1 * 5 + 2, 1 * 5 + 3, 1 * 5 + 4, -1, -1, -1]
    assert shard.index[0].tolist() == expected_index
    assert shard.row[0].tolist() == [-1, -1, 0, 0, -1, 1, 1, 1, -1, -1, -1]
    # to the rows and back: the last 3 columns are the completions' (TRL's [B, C])
    values = torch.arange(1.0, 12.0)[None]
    rows = shard.to_rows(values)
    assert rows.shape == (3, 5)
    assert rows[0].tolist() == [0, 0, 3, 4, 0] and rows[1].tolist() == [0, 0, 6, 7, 8]
    completions = shard.to_rows(values, last=3)
    assert completions.tolist() == [[3, 4, 0], [6, 7, 8], [0, 0, 0]]
    # tensors of their own (the fused head's outputs under FSDP2: no view to write into)
    assert rows._base is None and completions._base is None
    taken = shard.take(completions, fill=-1.0)
    assert taken[0].tolist() == [-1, -1, 3, 4, -1, 6, 7, 8, -1, -1, -1]
    assert shard.sequence_sums(values).tolist() == [7.0, 21.0, 0.0]


def test_rows_usp_cannot_place_are_refused():
    ids, mask, labels = padded_rows()
    holed = mask.clone()
    holed[0, 1] = 0
    with pytest.raises(InputError, match="row 0 .* padding between"):
        shard_rows(usp.Plan(None), ids, labels=labels, attention_mask=holed)
    empty = mask.clone()
    empty[2] = 0
    with pytest.raises(InputError, match="row 2 .* no tokens"):
        shard_rows(usp.Plan(None), ids, labels=labels, attention_mask=empty)
    with pytest.raises(InputError, match="input_ids and labels"):
        shard_rows(usp.Plan(None), ids, labels=labels[:, 1:], attention_mask=mask)


def test_preference_rows_give_chosen_and_rejected_sums():
    ids = torch.tensor([[5, 6, 7, 8], [5, 6, 9, 0]])  # chosen, rejected (right-padded)
    completion_mask = torch.tensor([[0, 0, 1, 1], [0, 0, 1, 0]])
    labels = completion_labels(ids, completion_mask)
    assert labels.tolist() == [[-100, -100, 7, 8], [-100, -100, 9, -100]]
    shard = shard_rows(usp.Plan(None), ids, labels=labels, attention_mask=(ids != 0).long())
    chosen, rejected = preference_logps(torch.arange(1.0, 8.0)[None], shard)
    # packed: [5 6 7 8 | 5 6 9]; scored positions 1, 2 (row 0) and 5 (row 1)
    assert chosen.tolist() == [2.0 + 3.0] and rejected.tolist() == [6.0]
