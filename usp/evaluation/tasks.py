"""The two long-context checks of ``usp eval``: what their sequences are and how a
sequence's :class:`~usp.evaluation.scoring.TokenScores` count.

**Perplexity by position.** The held-out documents, concatenated in order into one
token stream, are cut into consecutive windows of ``L`` tokens; each window is one
causal sequence (positions ``0 .. L-1``), so a token at position ``i`` is predicted
from the ``i + 1`` tokens before it, across document boundaries as in a long-context
evaluation of a corpus. The loss of predicting token ``i + 1`` counts in the bucket of
position ``i`` when token ``i + 1`` is a trained token of its format (every token of a
``"text"`` record; a completion, not its prompt; assistant turns): ``buckets`` equal
ranges of positions (starts ``b * L // buckets``), and a bucket's perplexity is ``exp``
of its mean loss. A model that uses its context well
has a perplexity that falls (or stays flat) with position; one that breaks beyond its
trained length rises there.

**Passkey retrieval.** A 5-digit number is hidden at a ``depth`` (0: the start, 1: the
end) of filler text, and the prompt ends by asking for it; the whole sequence, with the
answer after the question, is exactly ``L`` tokens. The model passes when greedy
decoding after the question gives the answer's tokens (checked in one forward, see
:mod:`usp.evaluation.scoring`).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from usp.errors import ConfigError

FILLER = (
    "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
)
INTRO = "A pass key is hidden in this text. Find it and remember it. "
NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key. "
QUESTION = "What is the pass key? The pass key is"
ANSWER = " {key}"


# ----------------------------------------------------------------------------- perplexity
def window_count(stream_tokens: int, length: int, wanted: int) -> int:
    """Windows of ``length`` tokens the stream holds, at most ``wanted``."""
    return min(wanted, stream_tokens // length)


def window(stream: torch.Tensor, length: int, index: int) -> torch.Tensor:
    """``stream[..., window index]``: the window's ``[..., length]`` entries."""
    return stream[..., index * length : (index + 1) * length]


def bucket_starts(length: int, buckets: int) -> list[int]:
    return [b * length // buckets for b in range(buckets)]


def add_to_buckets(scores, length: int, sums: torch.Tensor, counts: torch.Tensor) -> None:
    """Add this rank's token losses to ``sums`` (float64 [buckets]) and ``counts``
    (int64 [buckets]) by the bucket of each token's position."""
    buckets = sums.numel()
    which = (scores.positions * buckets) // length  # [n], bucket of each local token
    mask = scores.labelled
    sums.index_add_(0, which[mask], scores.loss[mask])
    counts.index_add_(0, which[mask], torch.ones_like(which[mask]))


# ----------------------------------------------------------------------------- passkey
@dataclass(frozen=True)
class PasskeyPrompt:
    """A passkey sequence of exactly ``length`` tokens: prompt, then the answer."""

    tokens: torch.Tensor  # int64 [length]
    answer_start: int  # position of the answer's first token (the answer runs to the end)
    needle_at: int  # position of the needle's first token
    key: int
    depth: float


def passkey_keys(seed: int, lengths, depths, trials: int) -> dict[tuple[int, float, int], int]:
    """A 5-digit key per (length, depth, trial), the same in every process."""
    rng = random.Random(seed)
    return {
        (length, depth, trial): rng.randint(10000, 99999)
        for length in lengths
        for depth in depths
        for trial in range(trials)
    }


def passkey_prompt(tokenizer, length: int, depth: float, key: int) -> PasskeyPrompt:
    """The passkey sequence of ``length`` tokens with ``key`` at ``depth`` of the filler.
    Pieces are tokenised separately and joined (the filler is cut at a token), so the
    answer's tokens are those of ``ANSWER`` alone."""
    head = ([tokenizer.bos_id] if tokenizer.bos_id is not None else []) + tokenizer.encode(INTRO)
    needle = tokenizer.encode(NEEDLE.format(key=key))
    question = tokenizer.encode(QUESTION)
    answer = tokenizer.encode(ANSWER.format(key=key))
    room = length - len(head) - len(needle) - len(question) - len(answer)
    if room < 0:
        raise ConfigError(
            f"--lengths {length}: a passkey sequence needs at least {length - room} tokens with "
            "this tokenizer (before any filler); give longer --lengths or leave out --passkey"
        )
    sentence = tokenizer.encode(FILLER)
    filler = (sentence * (room // max(len(sentence), 1) + 1))[:room]
    at = round(depth * room)
    ids = head + filler[:at] + needle + filler[at:] + question + answer
    return PasskeyPrompt(
        torch.tensor(ids, dtype=torch.int64),
        answer_start=length - len(answer),
        needle_at=len(head) + at,
        key=key,
        depth=depth,
    )


def passkey_checks(scores, prompt: PasskeyPrompt) -> torch.Tensor:
    """int64 [2]: of this rank's positions that predict an answer token (positions
    ``answer_start - 1 .. length - 2``), how many have the answer token as their greedy
    token, and how many there are. Summed over the SP group, the trial passes when the
    two are equal."""
    tokens = prompt.tokens.to(scores.positions.device)
    length = tokens.numel()
    predicts = (scores.positions >= prompt.answer_start - 1) & (scores.positions < length - 1)
    expected = tokens[(scores.positions + 1).clamp(max=length - 1)]  # [n], the next tokens
    passed = (predicts & (scores.greedy == expected)).sum()
    return torch.stack([passed, predicts.sum()]).to(torch.int64)
