"""``usp eval``'s building blocks on 4 gloo ranks against one process: per-token scores of
a sharded forward (against full logits), greedy answers checked in one forward (against
token-by-token greedy decoding), the passkey sequences, and the run's sums over ranks
and replicas (against a closed form)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from usp_cases import topology

import usp
from usp.evaluation import EvalSettings, run_checks, score_tokens
from usp.evaluation.tasks import PasskeyPrompt, passkey_checks, passkey_keys, passkey_prompt
from usp.models import Llama, preset
from usp.train.data import ByteTokenizer

TIMEOUT = 180
LENGTH = 64
ANSWER_TOKENS = 6  # " 12345" in bytes


def tiny_model(plan):
    torch.manual_seed(0)  # the same weights on every rank and in the reference
    return Llama(preset("tiny"), plan).eval()


def sequence(seed: int = 1):
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(4, 256, (LENGTH,), generator=gen)
    target = torch.rand(LENGTH, generator=gen) < 0.7
    return tokens, target


def _score_on_ranks(layout: str, prompts: list[PasskeyPrompt]):
    plan = usp.Plan(topology(2, 2), layout=layout, verify_calls=False)
    model = tiny_model(plan)
    tokens, target = sequence()
    s = score_tokens(model, plan, tokens, target, chunk_tokens=5)  # several chunks
    checks = []
    for prompt in prompts:
        local = passkey_checks(score_tokens(model, plan, prompt.tokens), prompt)
        total = local.clone()
        torch.distributed.all_reduce(total, group=plan.sp_group)
        checks.append((local.tolist(), total.tolist()))
    return s.positions.tolist(), s.labelled.tolist(), s.loss.tolist(), s.greedy.tolist(), checks


def greedy_continuation(model, prompt: torch.Tensor, count: int) -> list[int]:
    """Greedy decoding the plain way: one full forward per new token."""
    ids = prompt.clone()
    out = []
    with torch.no_grad():
        for _ in range(count):
            token = int(model(ids[None])[0, -1].argmax())
            out.append(token)
            ids = torch.cat([ids, torch.tensor([token])])
    return out


def test_sharded_scores_equal_full_logits_and_greedy_checks_equal_decoding(distributed):
    reference = tiny_model(None)
    tokens, target = sequence()
    with torch.no_grad():
        logits = reference(tokens[None])[0].double()  # [L, V]
    ref_loss = F.cross_entropy(logits[:-1], tokens[1:], reduction="none")
    ref_greedy = logits.argmax(-1)
    # passkey sequences whose answer is what greedy decoding gives, and the same with the
    # answer's last token changed: the first must pass, the second fail at exactly one check
    prompt = passkey_prompt(ByteTokenizer(), 192, 0.5, 12345)
    head = prompt.tokens[: prompt.answer_start]
    answer = greedy_continuation(reference, head, ANSWER_TOKENS)
    good = torch.cat([head, torch.tensor(answer)])
    bad = good.clone()
    bad[-1] = (bad[-1] + 1) % 256
    prompts = [PasskeyPrompt(t, prompt.answer_start, prompt.needle_at, 0, 0.5) for t in (good, bad)]
    for layout in ("zigzag", "contiguous"):
        results = distributed.run(_score_on_ranks, layout, prompts, world_size=4, timeout=TIMEOUT)
        positions = [p for r in results for p in r[0]]
        assert sorted(positions) == list(range(LENGTH)), "every position on exactly one rank"
        for pos, labelled, loss, greedy, _ in results:
            for i, p in enumerate(pos):
                wanted = p < LENGTH - 1 and bool(target[p + 1])
                assert labelled[i] == wanted, (layout, p)
                expected = float(ref_loss[p]) if wanted else 0.0
                assert abs(loss[i] - expected) <= 1e-5 * max(1.0, expected), (layout, p)
                assert greedy[i] == int(ref_greedy[p]), (layout, p)
        good_total, bad_total = results[0][4][0][1], results[0][4][1][1]
        assert good_total == [ANSWER_TOKENS, ANSWER_TOKENS], "greedy decoding's answer passes"
        assert bad_total == [ANSWER_TOKENS - 1, ANSWER_TOKENS], "one wrong token fails one check"
        assert sum(r[4][0][0][1] for r in results) == ANSWER_TOKENS, "each check on one rank"


def test_passkey_sequences_have_the_length_the_key_and_the_depth():
    tokenizer = ByteTokenizer()
    at = []
    for depth in (0.0, 0.5, 1.0):
        p = passkey_prompt(tokenizer, 300, depth, 48213)
        assert p.tokens.numel() == 300 and p.tokens[0] == tokenizer.bos_id
        assert tokenizer.decode(p.tokens[p.answer_start :].tolist()) == " 48213"
        text = tokenizer.decode(p.tokens.tolist())
        assert text.count("48213") == 3 and text.endswith("The pass key is 48213")
        assert tokenizer.decode(p.tokens[p.needle_at : p.needle_at + 21].tolist()).startswith(
            "The pass key is 48213"
        )
        at.append(p.needle_at)
    assert at[0] < at[1] < at[2]
    try:
        passkey_prompt(tokenizer, 100, 0.5, 48213)
    except usp.errors.ConfigError as err:
        assert "needs at least 163 tokens" in str(err), err
    else:
        raise AssertionError("a length too short for the prompt must be refused")
    keys = passkey_keys(3, (192, 256), (0.0, 1.0), 2)
    assert keys == passkey_keys(3, (192, 256), (0.0, 1.0), 2) and len(set(keys.values())) == 8


def _fake_checks(scores, prompt):
    """A passkey trial passes iff its key is even (the schedule and the sums under test):
    SP rank 0 always reports a pass, the others the truth, so only the checks summed
    over the SP group decide right."""
    passed = int(prompt.key % 2 == 0)
    if _FAKE_SP_RANK[0] == 0:
        passed = 1
    return torch.tensor([passed, 1], dtype=torch.int64)


_FAKE_SP_RANK = [0]  # set by the body on every rank


def _run_checks_on_ranks(ulysses, ring, settings, stream, target, fake_passkey):
    from usp.evaluation import runner

    plan = usp.Plan(topology(ulysses, ring), verify_calls=False)
    model = tiny_model(plan)
    original = runner.passkey_checks
    _FAKE_SP_RANK[0] = plan.topology.sp_rank
    if fake_passkey:
        runner.passkey_checks = _fake_checks
    try:
        return run_checks(model, plan, stream, target, ByteTokenizer(), settings)
    finally:
        runner.passkey_checks = original


def reference_perplexity(stream, target, length, windows, buckets):
    """Per-bucket perplexity by hand: full logits of each window, one process."""
    model = tiny_model(None)
    sums, counts = [0.0] * buckets, [0] * buckets
    with torch.no_grad():
        for k in range(windows):
            ids, flags = (
                stream[k * length : (k + 1) * length],
                target[k * length : (k + 1) * length],
            )
            logits = model(ids[None])[0].double()
            nll = F.cross_entropy(logits[:-1], ids[1:], reduction="none")
            for i in range(length - 1):
                if flags[i + 1]:
                    sums[i * buckets // length] += float(nll[i])
                    counts[i * buckets // length] += 1
    return [torch.tensor(s / c).exp().item() for s, c in zip(sums, counts)], counts


def test_run_checks_on_4_ranks_and_2_replicas_equal_one_process(distributed):
    gen = torch.Generator().manual_seed(4)
    stream = torch.randint(4, 256, (700,), generator=gen)
    target = torch.rand(700, generator=gen) < 0.8
    settings = EvalSettings(
        (192, 256), buckets=4, windows=3, passkey=True, depths=(0.0, 1.0), trials=3, seed=9
    )
    for ulysses, ring in ((2, 2), (1, 2)):  # (1, 2) on 4 ranks: 2 replicas of sp 2
        results = distributed.run(
            _run_checks_on_ranks, ulysses, ring, settings, stream, target, True,
            world_size=4, timeout=TIMEOUT,
        )  # fmt: skip
        assert all(r == results[0] for r in results), "every rank ends with the same numbers"
        for length, windows in ((192, 3), (256, 2)):  # 700 tokens: 2 windows of 256
            ours = results[0]["perplexity"][str(length)]
            values, counts = reference_perplexity(stream, target, length, windows, 4)
            assert ours["tokens"] == counts and ours["windows"] == windows
            assert ours["bucket_starts"] == [0, length // 4, length // 2, 3 * length // 4]
            for a, b in zip(ours["values"], values):
                assert abs(a - b) <= 1e-5 * b, (length, a, b)
        keys = passkey_keys(9, (192, 256), (0.0, 1.0), 3)
        for length in (192, 256):
            for depth in (0.0, 1.0):
                even = sum(keys[(length, depth, t)] % 2 == 0 for t in range(3))
                assert results[0]["passkey"][str(length)][f"{depth:g}"] == even / 3
