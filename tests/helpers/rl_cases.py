"""Shared pieces of the post-training tests (examples/trl_grpo.py, examples/trl_dpo.py):
prompt and preference data for the tiny character-level tokenizer of
tests/helpers/trainer_cases.py, a deterministic ``generate``, and the examples as
pooled-rank bodies."""

from __future__ import annotations

import contextlib
import json
import random
import zlib
from pathlib import Path

import torch
import trainer_cases as tc

#: the tokenizer's character ids (trainer_cases.CHARS): what the fake generation samples
FIRST_CHAR, LAST_CHAR = len(tc.SPECIALS), len(tc.SPECIALS) + len(tc.CHARS)
EOS_ID, PAD_ID = 2, 0


def write_prompts(path: Path, count: int, *, seed: int = 0) -> Path:
    """``count`` conversational prompt records of 1-3 words (so prompts are left-padded
    to different lengths), each with a ``target`` column the test reward reads."""
    rng = random.Random(seed)
    rows = []
    for index in range(count):
        text = " ".join(rng.choice(tc.WORDS) for _ in range(rng.randint(1, 3)))
        rows.append({"prompt": [{"role": "user", "content": text}], "target": 6 + index % 5})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def write_pairs(path: Path, count: int, *, seed: int = 0) -> Path:
    """``count`` conversational preference records ``{"prompt", "chosen", "rejected"}``."""
    rng = random.Random(seed)

    def words(n):
        return " ".join(rng.choice(tc.WORDS) for _ in range(n))

    rows = [
        {
            "prompt": [{"role": "user", "content": words(rng.randint(1, 3)) + "?"}],
            "chosen": [{"role": "assistant", "content": words(rng.randint(1, 4)) + "."}],
            "rejected": [{"role": "assistant", "content": words(rng.randint(1, 4)) + "!"}],
        }
        for _ in range(count)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def write_reward(path: Path) -> Path:
    """A reward function file for ``--reward FILE.py:score``: closeness of the
    completion's length to the record's ``target`` column, minus repeated letters."""
    path.write_text(
        "def score(prompts, completions, completion_ids, target, **kwargs):\n"
        "    out = []\n"
        "    for completion, goal in zip(completions, target):\n"
        "        text = completion[-1]['content']\n"
        "        repeats = sum(a == b for a, b in zip(text, text[1:]))\n"
        "        out.append(-abs(len(text) - goal) / goal - 0.5 * repeats)\n"
        "    return out\n"
    )
    return path


def _fake_completion(prompt: tuple, index: int, max_new: int) -> list[int]:
    """The completion of ``prompt``'s ``index``-th row in a call: random characters (a
    seed from both), an end-of-sequence token unless it runs to ``max_new``."""
    seed = zlib.crc32(json.dumps([list(prompt), index]).encode())
    gen = torch.Generator().manual_seed(seed)
    length = int(torch.randint(1, max_new + 1, (1,), generator=gen))
    tokens = torch.randint(FIRST_CHAR, LAST_CHAR, (length,), generator=gen).tolist()
    if length < max_new:
        tokens[-1] = EOS_ID
    return tokens


@contextlib.contextmanager
def deterministic_generation():
    """transformers' ``generate`` (every model's) replaced: a row's completion depends
    only on its prompt (the real tokens of the left-padded row) and its index among the
    rows of that prompt in the call, never on the weights or a random state."""
    import transformers

    real = transformers.GenerationMixin.generate

    def generate(self, input_ids=None, attention_mask=None, generation_config=None, **kwargs):
        max_new = generation_config.max_new_tokens
        seen: dict[tuple, int] = {}
        rows = []
        for ids, mask in zip(input_ids.tolist(), attention_mask.tolist()):
            prompt = tuple(i for i, m in zip(ids, mask) if m)
            index = seen.get(prompt, 0)
            seen[prompt] = index + 1
            tokens = _fake_completion(prompt, index, max_new)
            rows.append(tokens + [PAD_ID] * (max_new - len(tokens)))
        completions = torch.tensor(rows, dtype=input_ids.dtype, device=input_ids.device)
        return torch.cat([input_ids, completions], dim=1)

    transformers.GenerationMixin.generate = generate
    try:
        yield
    finally:
        transformers.GenerationMixin.generate = real


def run_example_alone(name: str, argv: list[str], *, overrides=None, fake_generation=True) -> int:
    """The example in this process (``--no-usp`` or usp at ``Plan(None)``)."""
    context = deterministic_generation() if fake_generation else contextlib.nullcontext()
    try:
        with context:
            return tc.load_example(name).main(argv, overrides=overrides)
    finally:
        tc.reset_accelerate()


def run_example_on_ranks(name: str, argv: list[str], ulysses: int, ring: int, *,
                         overrides=None, fake_generation=True, spy=None):  # fmt: skip
    """A pooled-rank body: the example on this world's ``ulysses x ring`` plan.
    ``spy``: a function of the trainer's completions checked on every rank
    (:func:`record_training_rows`)."""
    from usp_cases import topology

    import usp

    plan = usp.Plan(topology(ulysses, ring))
    context = deterministic_generation() if fake_generation else contextlib.nullcontext()
    recorder = record_training_rows() if spy else contextlib.nullcontext([])
    with tc.accelerate_world(), context, recorder as rows:
        status = tc.load_example(name).main(argv, plan=plan, overrides=overrides)
    return status, [[r.tolist() for r in step] for step in rows]


@contextlib.contextmanager
def record_training_rows():
    """The completion ids of every micro-batch ``UspGRPOTrainer`` computes a loss on."""
    from usp.integrations.trl_grpo import UspGRPOTrainer

    seen = []
    real = UspGRPOTrainer.compute_loss

    def compute_loss(self, model, inputs, *args, **kwargs):
        seen.append([inputs["completion_ids"].cpu(), inputs["completion_mask"].cpu()])
        return real(self, model, inputs, *args, **kwargs)

    UspGRPOTrainer.compute_loss = compute_loss
    try:
        yield seen
    finally:
        UspGRPOTrainer.compute_loss = real
