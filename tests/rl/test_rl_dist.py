"""usp.rl on 4 gloo ranks against one process.

* Per-token log-probabilities and entropies of the completions of left- and
  right-padded rows (TRL's GRPO layout) through a tiny Qwen3 under USP attention, on
  u2 x r2, u1 x r4 and dp2 x r2 (each replica half the rows), against transformers'
  float64 model in one process running each row's tokens alone with the full logits:
  values, the DPO per-row sums and the gradients of a weighted sum of both (summed
  over the ranks) within 1e-10 relative.
* TRL's GRPO loss: :func:`usp.rl.policy_loss` on u2 x r2 (and dp2 x r2, a replica being
  a TRL process) against ``trl.GRPOTrainer._compute_loss`` itself on the same global
  inputs, for every loss type, both importance-sampling levels, with and without a
  reference model, clipping bounds and the two-sided ``delta`` away from their
  defaults: the loss, its gradient with respect to the log-probabilities, and TRL's
  metrics (kl, entropy, clip ratios).
"""

from __future__ import annotations

import types

import pytest
import torch
import torch.distributed as dist
from model_cases import load_hf_reference, relative_error, write_family_checkpoint
from usp_cases import topology

transformers = pytest.importorskip("transformers", reason="the models are transformers'")

import usp  # noqa: E402
import usp.models.hf as usp_hf  # noqa: E402
from usp.rl import (  # noqa: E402
    PolicyLossConfig,
    policy_loss,
    preference_logps,
    shard_rows,
    token_logprobs,
)

TOL = 1e-10
TEMPERATURE = 0.8
GRIDS = [(2, 2), (1, 4), (1, 2)]  # (ulysses, ring) on 4 ranks: dp = 4 / (u * r)


def grpo_rows(seed=3, rows=4, prompt=5, completion=6, vocab=64):
    """TRL's layout: prompts left-padded (lengths 5, 2, 1, 4), completions right-padded
    (lengths 6, 3, 0, 5): ids [B, P + C], attention mask, completion labels."""
    gen = torch.Generator().manual_seed(seed)
    prompt_lengths, completion_lengths = (5, 2, 1, 4)[:rows], (6, 3, 0, 5)[:rows]
    ids = torch.randint(2, vocab, (rows, prompt + completion), generator=gen)
    columns = torch.arange(prompt + completion)
    mask = torch.stack([
        (columns >= prompt - p) & (columns < prompt + c)
        for p, c in zip(prompt_lengths, completion_lengths)
    ]).long()  # fmt: skip
    ids = ids.masked_fill(mask == 0, 0)
    labels = ids.masked_fill(mask == 0, -100)
    labels[:, :prompt] = -100
    return ids, mask, labels


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_family_checkpoint(tmp_path_factory.mktemp("rl_dist") / "qwen3", "qwen3", seed=7)


def weights_of(shape, seed):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def one_process_reference(ckpt, ids, mask, labels):
    """Every row alone through transformers' float64 model, full logits: the row-layout
    log-probs and entropies [B, S - 1], the chosen/rejected sums of rows (0, 1) / (2, 3),
    and the gradients of sum(w1 * logp + w2 * entropy)."""
    model = load_hf_reference(ckpt)
    rows, width = ids.shape
    logp = torch.zeros(rows, width - 1, dtype=torch.float64)
    entropy = torch.zeros_like(logp)
    for b in range(rows):
        real = mask[b].nonzero().flatten()
        first, last = int(real[0]), int(real[-1]) + 1
        logits = model(ids[b : b + 1, first:last], use_cache=False).logits[0] / TEMPERATURE
        log_p = torch.log_softmax(logits[:-1], -1)  # predictions of tokens first+1 .. last-1
        targets = labels[b, first + 1 : last]
        keep = targets != -100
        picked = log_p.gather(1, targets.clamp(min=0)[:, None])[:, 0] * keep
        ent = -(log_p.exp() * log_p).sum(-1) * keep
        logp = logp.index_put((torch.tensor([b]), torch.arange(first, last - 1)), picked)
        entropy = entropy.index_put((torch.tensor([b]), torch.arange(first, last - 1)), ent)
    objective = (weights_of(logp.shape, 1) * logp + weights_of(logp.shape, 2) * entropy).sum()
    objective.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    sums = logp.sum(-1)
    return {
        "logp": logp.detach(), "entropy": entropy.detach(), "grads": grads,
        "chosen": sums[[0, 1]].detach(), "rejected": sums[[2, 3]].detach(),
    }  # fmt: skip


def run_logprobs(ckpt, ids, mask, labels):
    results = {}
    for ulysses, ring in GRIDS:
        plan = usp.Plan(topology(ulysses, ring), backend="math")
        name = usp_hf.register(plan, name=f"usp-rl-u{ulysses}r{ring}")
        model = load_hf_reference(ckpt, attn_implementation=name)
        t = plan.topology
        share = slice(
            t.dp_rank * len(ids) // t.dp_degree, (t.dp_rank + 1) * len(ids) // t.dp_degree
        )
        shard = shard_rows(
            plan, ids[share], labels=labels[share], attention_mask=mask[share], pad_token_id=1
        )
        hidden = model.model(**shard.batch.hf_kwargs()).last_hidden_state  # [1, S'/P, dim]
        stats = token_logprobs(
            hidden, model.lm_head.weight, shard.targets, temperature=TEMPERATURE,
            outputs=("entropy",), chunk_tokens=3,
        )  # fmt: skip
        logp, entropy = shard.to_rows(stats.logprobs), shard.to_rows(stats.entropy)
        full = (len(ids), ids.shape[1] - 1)
        w1, w2 = weights_of(full, 1), weights_of(full, 2)
        (w1[share] * logp + w2[share] * entropy).sum().backward()
        grads = {}
        for pname, param in model.named_parameters():
            grads[pname] = param.grad.detach().clone()
            dist.all_reduce(grads[pname])  # every rank's share, every replica's rows
        parts = [None] * t.dp_degree
        pair = preference_logps(stats.logprobs, shard) if t.dp_degree == 1 else None
        group = t.dp_group if t.dp_degree > 1 else None
        local = (logp.detach(), entropy.detach())
        if group is None:
            parts = [local]
        else:
            dist.all_gather_object(parts, local, group=group)
        results[(ulysses, ring)] = {
            "logp": torch.cat([p[0] for p in parts]),
            "entropy": torch.cat([p[1] for p in parts]),
            "grads": grads,
            "pair": None if pair is None else [x.detach() for x in pair],
        }
    return results


def test_logprobs_and_entropy_on_three_grids_equal_one_process(distributed, ckpt):
    ids, mask, labels = grpo_rows()
    expected = one_process_reference(ckpt, ids, mask, labels)
    assert (expected["logp"] != 0).sum() == 6 + 3 + 0 + 5  # every completion token
    results = distributed.run(run_logprobs, str(ckpt), ids, mask, labels, world_size=4, timeout=300)
    for rank, by_grid in enumerate(results):
        for grid, got in by_grid.items():
            where = (rank, grid)
            assert relative_error(got["logp"], expected["logp"]) <= TOL, where
            assert relative_error(got["entropy"], expected["entropy"]) <= TOL, where
            errors = {n: relative_error(got["grads"][n], g) for n, g in expected["grads"].items()}
            assert max(errors.values()) <= TOL, (where, errors)
            if got["pair"] is not None:
                assert relative_error(got["pair"][0], expected["chosen"]) <= TOL, where
                assert relative_error(got["pair"][1], expected["rejected"]) <= TOL, where
        # the SP ranks hold the same bits
        assert torch.equal(by_grid[(2, 2)]["logp"], results[0][(2, 2)]["logp"])


# ----------------------------------------------------------------------------- TRL's loss
#: (loss type, importance-sampling level, beta, extra config): every loss type at both
#: levels with and without a reference model, and the options away from their defaults
LOSS_CASES = [
    (loss, level, beta, {})
    for loss in ("grpo", "bnpo", "dr_grpo", "dapo")
    for level in ("token", "sequence")
    for beta in (0.0, 0.04)
] + [
    ("dapo", "token", 0.04, {"epsilon": 0.1, "epsilon_high": 0.28, "delta": 1.3,
                             "use_bias_correction_kl": True, "gradient_accumulation_steps": 2,
                             "steps_per_generation": 4}),
    ("grpo", "sequence", 0.04, {"epsilon": 0.3, "use_bias_correction_kl": True, "delta": 1.2}),
    ("bnpo", "token", 0.0, {"gradient_accumulation_steps": 3}),
    # inputs of other shapes ("input:" keys): no old policy (ratio 1), per-token advantages
    # [B, C], no entropies for the metrics
    ("dapo", "token", 0.04, {"input:no_old": True, "input:token_advantages": True}),
    ("grpo", "sequence", 0.0, {"input:no_old": True, "input:no_entropy": True}),
]  # fmt: skip


def config_of(extra: dict) -> dict:
    return {k: v for k, v in extra.items() if not k.startswith("input:")}


MAX_COMPLETION = 7
#: TRL computes its clip ratios from float32 indicators (``.float()``)
METRIC_TOL = 1e-6


def loss_inputs(seed=5):
    """Global GRPO inputs for 4 rows with 6 completion columns: log-probs (the variable),
    old and reference log-probs, entropies, advantages of both signs, masks."""
    ids, mask, labels = grpo_rows(seed=seed)
    prompt = 5
    completion_mask = mask[:, prompt:]
    gen = torch.Generator().manual_seed(seed)
    shape = completion_mask.shape
    logp = -torch.rand(shape, generator=gen, dtype=torch.float64) * 3
    old = logp + 0.4 * torch.randn(shape, generator=gen, dtype=torch.float64)
    ref = logp + 0.3 * torch.randn(shape, generator=gen, dtype=torch.float64)
    entropy = torch.rand(shape, generator=gen, dtype=torch.float64)
    zero = completion_mask == 0
    logp, old, ref, entropy = (x.masked_fill(zero, 0.0) for x in (logp, old, ref, entropy))
    advantages = torch.tensor([0.9, -1.2, 0.3, -0.4], dtype=torch.float64)
    token_advantages = torch.randn(shape, generator=gen, dtype=torch.float64).masked_fill(zero, 0)
    return {
        "token_advantages": token_advantages,
        "ids": ids, "mask": mask, "labels": labels, "prompt": prompt,
        "completion_mask": completion_mask, "logp": logp, "old": old, "ref": ref,
        "entropy": entropy, "advantages": advantages,
        "num_items": int(completion_mask.sum()),
    }  # fmt: skip


def trl_loss(inputs, rows, loss_type, level, beta, extra, *, processes=1):
    """``trl.GRPOTrainer._compute_loss`` itself on ``rows`` of the inputs, as one of
    ``processes`` processes sees them: (loss, d loss / d logp [B, C], metrics)."""
    from trl import GRPOTrainer

    options = {**PolicyLossConfig().__dict__, **config_of(extra)}
    logp = inputs["logp"][rows].clone().requires_grad_()
    entropy = inputs["entropy"][rows]
    accelerator = types.SimpleNamespace(
        num_processes=processes,
        reduce=lambda t, reduction="sum": t,
        gather=lambda t: t,
        gather_for_metrics=lambda t: t,
    )
    epsilon_high = options["epsilon_high"]
    fake = types.SimpleNamespace(
        _get_per_token_logps_and_entropies=lambda *a, **k: (logp, entropy, None),
        top_entropy_quantile=1.0, off_policy_mask_threshold=None,
        importance_sampling_level=level, beta=beta, loss_type=loss_type,
        epsilon_low=options["epsilon"],
        epsilon_high=options["epsilon"] if epsilon_high is None else epsilon_high,
        use_vllm=False, model=types.SimpleNamespace(training=True),
        current_gradient_accumulation_steps=options["gradient_accumulation_steps"],
        max_completion_length=MAX_COMPLETION, accelerator=accelerator,
        _entropy_bonus_enabled=False, aux_loss_enabled=False,
        _metrics={"train": __import__("collections").defaultdict(list)},
        args=types.SimpleNamespace(
            use_bias_correction_kl=options["use_bias_correction_kl"], delta=options["delta"],
            steps_per_generation=options["steps_per_generation"],
        ),
    )  # fmt: skip
    prompt = inputs["prompt"]
    batch = {
        "prompt_ids": inputs["ids"][rows, :prompt], "prompt_mask": inputs["mask"][rows, :prompt],
        "completion_ids": inputs["ids"][rows, prompt:],
        "completion_mask": inputs["completion_mask"][rows],
        "advantages": inputs["advantages"][rows], "old_per_token_logps": inputs["old"][rows],
        "ref_per_token_logps": inputs["ref"][rows],
        "num_items_in_batch": torch.tensor(float(inputs["num_items"]), dtype=torch.float64),
    }  # fmt: skip
    if extra.get("input:no_old"):
        del batch["old_per_token_logps"]
    if extra.get("input:token_advantages"):
        batch["advantages"] = inputs["token_advantages"][rows]
    loss = GRPOTrainer._compute_loss(fake, None, batch)
    loss.backward()
    metrics = {k: v[0] for k, v in fake._metrics["train"].items()}
    if extra.get("input:no_entropy"):
        del metrics["entropy"]
    return loss.item(), logp.grad, metrics


def run_policy_losses(inputs, cases, grid):
    plan = usp.Plan(topology(*grid))
    t = plan.topology
    rows = len(inputs["ids"])
    share = slice(t.dp_rank * rows // t.dp_degree, (t.dp_rank + 1) * rows // t.dp_degree)
    shard = shard_rows(
        plan, inputs["ids"][share], labels=inputs["labels"][share],
        attention_mask=inputs["mask"][share],
    )  # fmt: skip
    columns = inputs["completion_mask"].shape[1]
    found = []
    for loss_type, level, beta, extra in cases:
        config = PolicyLossConfig(
            loss_type=loss_type, importance_sampling_level=level, beta=beta,
            max_completion_length=MAX_COMPLETION, **config_of(extra),
        )  # fmt: skip
        advantages = inputs["token_advantages" if extra.get("input:token_advantages") else
                            "advantages"][share]  # fmt: skip
        logp_rows = inputs["logp"][share].clone().requires_grad_()
        local = shard.take(logp_rows)  # this rank's tokens' log-probs
        result = policy_loss(
            local, shard, advantages=advantages,
            completion_mask=inputs["completion_mask"][share], config=config,
            old_logprobs=None if extra.get("input:no_old") else inputs["old"][share],
            ref_logprobs=inputs["ref"][share],
            entropy=None if extra.get("input:no_entropy") else shard.take(inputs["entropy"][share]),
            num_items_in_batch=inputs["num_items"], num_replicas=t.dp_degree,
            dp_group=t.dp_group if t.dp_degree > 1 else None,
        )  # fmt: skip
        result.loss.backward()
        grad = logp_rows.grad.clone()
        dist.all_reduce(grad, group=plan.sp_group)  # the SP ranks' shares
        assert grad.shape == (rows // t.dp_degree, columns)
        found.append((result.loss.item(), grad, result.metrics))
    return found


@pytest.mark.parametrize("grid", [(2, 2), (1, 2)], ids=["u2r2", "dp2r2"])
def test_policy_losses_equal_trls_loss(distributed, grid):
    inputs = loss_inputs()
    dp = 4 // (grid[0] * grid[1])
    cases = LOSS_CASES if dp == 1 else [c for c in LOSS_CASES if c[0] in ("dapo", "grpo")]
    results = distributed.run(run_policy_losses, inputs, cases, grid, world_size=4, timeout=300)
    rows = len(inputs["ids"])
    for case_index, (loss_type, level, beta, extra) in enumerate(cases):
        _, _, metrics = trl_loss(inputs, slice(0, rows), loss_type, level, beta, extra)
        for rank, found in enumerate(results):
            replica = rank // (4 // dp)
            share = slice(replica * rows // dp, (replica + 1) * rows // dp)
            loss, grad, _ = trl_loss(inputs, share, loss_type, level, beta, extra, processes=dp)
            got_loss, got_grad, got_metrics = found[case_index]
            where = (rank, loss_type, level, beta, extra)
            assert abs(got_loss - loss) <= 1e-12 * max(1.0, abs(loss)), (where, got_loss, loss)
            assert relative_error(got_grad, grad) <= 1e-12, where
            assert got_metrics.keys() == metrics.keys(), where
            for name, value in got_metrics.items():  # every replica's, as TRL's gathers
                # (TRL counts clipped tokens in float32: .float())
                same = abs(value - metrics[name]) <= METRIC_TOL * max(1.0, abs(metrics[name]))
                both_nan = value != value and metrics[name] != metrics[name]
                assert same or both_nan, (where, name, value, metrics[name])
    assert any(m["clip_ratio/region_mean"] > 0 for _, _, m in results[0])  # clipping bound
