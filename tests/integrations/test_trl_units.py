"""The TRL trainers' pieces in one process: the options they refuse (each named), the
replicas' share of TRL's sampler, the split of a replica's rows over its SP ranks by
whole prompt groups, TRL's advantages against closed forms, and the SP head's refusals.
"""

from __future__ import annotations

import statistics
import types

import pytest
import torch

pytest.importorskip("transformers", minversion="5.24", reason="the integration needs 5.24")
trl = pytest.importorskip("trl", reason="the TRL trainers need TRL")

import usp  # noqa: E402
from usp.errors import ConfigError, InputError  # noqa: E402
from usp.integrations import trl_rollouts as rollouts  # noqa: E402
from usp.integrations.trl_dpo import check_dpo_arguments  # noqa: E402
from usp.integrations.trl_grpo import check_grpo_arguments  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


def grpo_args(**changes):
    base = dict(loss_type="dapo", use_vllm=False, entropy_coef=0.0, top_entropy_quantile=1.0,
                off_policy_mask_threshold=None, eval_strategy="no")  # fmt: skip
    return types.SimpleNamespace(**{**base, **changes})


@pytest.mark.parametrize(
    "changes, needle",
    [
        ({"use_vllm": True}, "vLLM generation"),
        ({"use_transformers_continuous_batching": True}, "continuous batching"),
        ({"loss_type": "cispo"}, 'loss_type="cispo"'),
        ({"top_entropy_quantile": 0.2}, "top_entropy_quantile=0.2"),
        ({"entropy_coef": 0.01}, "entropy_coef=0.01"),
        ({"use_adaptive_entropy": True}, "use_adaptive_entropy"),
        ({"off_policy_mask_threshold": 0.5}, "off_policy_mask_threshold"),
        ({"mask_truncated_completions": True}, "mask_truncated_completions"),
        ({"log_completions": True}, "log_completions"),
        ({"sync_ref_model": True}, "sync_ref_model"),
        ({"use_liger_kernel": True}, "use_liger_kernel"),
        ({"cast_lm_head_to_fp32": True}, "cast_lm_head_to_fp32"),
        ({"eval_strategy": "steps"}, "evaluation"),
    ],
)
def test_grpo_options_usp_cannot_run_are_refused_by_name(changes, needle):
    with pytest.raises(ConfigError, match="GRPOTrainer integration cannot use") as caught:
        check_grpo_arguments(grpo_args(**changes), [len], {})
    assert needle in str(caught.value)


def test_grpo_rollout_and_reward_options_are_refused_by_name():
    for kwargs, needle in [
        ({"tools": [len]}, "tools (multi-turn"),
        ({"environment_factory": object}, "environment_factory"),
        ({"rollout_func": len}, "rollout_func"),
        ({"peft_config": object()}, "peft_config"),
    ]:
        with pytest.raises(ConfigError) as caught:
            check_grpo_arguments(grpo_args(), [len], kwargs)
        assert needle in str(caught.value)
    with pytest.raises(ConfigError, match="a reward model in reward_funcs"):
        check_grpo_arguments(grpo_args(), ["org/reward-model"], {})
    with pytest.raises(ConfigError, match="a reward model in reward_funcs"):
        check_grpo_arguments(grpo_args(), [torch.nn.Linear(2, 1)], {})
    check_grpo_arguments(grpo_args(), [len], {})  # the defaults pass


def test_the_trainer_refuses_before_it_builds_anything():
    from usp.integrations.transformers import UspGRPOTrainer

    args = trl.GRPOConfig(output_dir="unused", use_cpu=True, loss_type="sapo", report_to=[])
    with pytest.raises(ConfigError, match='loss_type="sapo"'):
        UspGRPOTrainer(model=torch.nn.Linear(2, 2), reward_funcs=len, args=args)


@pytest.mark.parametrize(
    "changes, needle",
    [
        ({"loss_type": ["ipo"]}, "loss_type=['ipo']"),
        ({"use_weighting": True}, "use_weighting"),
        ({"ld_alpha": 0.5}, "ld_alpha"),
        ({"f_divergence_type": "js_divergence"}, "f_divergence_type"),
        ({"sync_ref_model": True}, "sync_ref_model"),
        ({"eval_strategy": "steps"}, "eval_strategy"),
    ],
)
def test_dpo_options_usp_cannot_run_are_refused_by_name(changes, needle):
    args = types.SimpleNamespace(**{"loss_type": ["sigmoid"], **changes})
    with pytest.raises(ConfigError, match="DPOTrainer integration cannot use") as caught:
        check_dpo_arguments(args, {})
    assert needle in str(caught.value)
    check_dpo_arguments(types.SimpleNamespace(loss_type=["sigmoid"]), {})


# ----------------------------------------------------------------------------- sampling
def test_the_replicas_share_out_trls_generation_batches():
    """Replica d takes the d-th share of each generation batch of TRL's RepeatSampler
    (what accelerate gives process d); together they are TRL's one-process order."""
    from trl.trainer.utils import RepeatSampler

    data = list(range(10))
    local, dp, generations = 4, 2, 2

    def inner():
        return RepeatSampler(data, mini_repeat_count=generations,
                             batch_size=local * dp // generations, repeat_count=2, seed=5)  # fmt: skip

    alone = list(inner())
    shares = [
        list(rollouts.ReplicaRepeatSampler(inner(), local=local, dp_rank=d, dp_degree=dp))
        for d in range(dp)
    ]
    assert all(len(s) == len(alone) // dp for s in shares)
    rebuilt = []
    for start in range(0, len(alone) // dp, local):
        for share in shares:
            rebuilt += share[start : start + local]
    assert rebuilt == alone


def test_a_replicas_rows_split_over_its_sp_ranks_by_whole_groups():
    # 8 rows in groups of 4: one group per rank of 2, nothing for ranks 3 and 4 of 4
    assert rollouts.group_slices(8, 0, 4, 2) == [slice(0, 4), slice(4, 8)]
    assert rollouts.group_slices(8, 0, 4, 4) == [slice(0, 4), slice(4, 4), slice(4, 8),
                                                 slice(8, 8)]  # fmt: skip
    # 12 rows in groups of 2 over 4 ranks: balanced, 3 rows each is not whole groups
    # 12 rows in groups of 2 over 4 ranks: 3 rows each would cut groups; cuts at the
    # boundaries nearest 3, 6, 9 (ties to the later one)
    assert rollouts.group_slices(12, 0, 2, 4) == [slice(0, 4), slice(4, 6), slice(6, 10),
                                                  slice(10, 12)]  # fmt: skip
    # a replica whose rows are rows 6..13 of groups of 4: its groups are 6-7 (cut by its
    # edge), 8-11 and 12-13; two parts cut at the boundary nearest 4 (row 10 -> 2 or 6)
    assert rollouts.group_slices(8, 6, 4, 2) == [slice(0, 6), slice(6, 8)]


# ----------------------------------------------------------------------------- advantages
def closed_form(rewards, groups, scale):
    """Per group (or batch) mean and Bessel std, by hand."""
    advantages = []
    for g in range(0, len(rewards), groups):
        group = rewards[g : g + groups]
        spread = statistics.stdev(group if scale != "batch" else rewards)
        for r in group:
            a = r - statistics.mean(group)
            advantages.append(a if scale == "none" else a / (spread + 1e-4))
    return advantages


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_advantages_sum_then_normalize(scale):
    per_func = torch.tensor([[1.0, 0.5], [0.0, 0.5], [2.0, -1.0], [3.0, 1.0], [1.0, 1.0],
                             [1.0, 1.0]])  # fmt: skip
    weights = torch.tensor([1.0, 2.0])
    advantages, zero_std = rollouts.advantages_of(per_func, weights, 2, scale, "sum_then_normalize")
    rewards = (per_func * weights).sum(1).tolist()
    assert torch.allclose(advantages, torch.tensor(closed_form(rewards, 2, scale)), atol=1e-6)
    expected_zero = [False] * 4 + [True] * 2 if scale != "batch" else [False] * 6
    assert zero_std.tolist() == expected_zero


def test_advantages_normalize_then_sum_and_unscorable_rows():
    per_func = torch.tensor([[1.0, 4.0], [3.0, 0.0], [float("nan"), float("nan")], [2.0, 2.0]])
    weights = torch.tensor([1.0, 0.5])
    advantages, _ = rollouts.advantages_of(per_func, weights, 2, "group", "normalize_then_sum")
    # each function normalised within its group, then weighted and summed, then over the batch
    z = []
    for g in (0, 2):
        rows = per_func[g : g + 2]
        cols = []
        for f in range(2):
            values = [v for v in rows[:, f].tolist() if v == v]
            mean = statistics.mean(values)
            std = statistics.stdev(values) if len(values) > 1 else float("nan")
            cols.append([(v - mean) / (std + 1e-4) for v in rows[:, f].tolist()])
        # the weighted sum skips NaN terms (a function with one value in a group has no
        # spread: its normalised value is NaN, left out)
        z += [sum(v * w for v, w in zip((cols[0][i], cols[1][i]), (1.0, 0.5)) if v == v)
              for i in range(2)]  # fmt: skip
    z[2] = float("nan")  # unscorable: every function returned None
    real = [v for v in z if v == v and abs(v) != float("inf")]
    mean, std = statistics.mean(real), statistics.stdev(real)
    expected = [0.0 if v != v else (v - mean) / (std + 1e-4) for v in z]
    assert advantages[2] == 0.0  # no signal from an unscorable completion
    assert torch.allclose(advantages, torch.tensor(expected), atol=1e-5), (advantages, expected)


# ----------------------------------------------------------------------------- the head
def test_the_sp_head_refuses_inputs_it_does_not_compute(tmp_path):
    import trainer_cases as tc
    import transformers

    from usp.integrations.trl_head import add_sp_fused_head

    directory = tc.write_checkpoint(tmp_path / "qwen3", "qwen3")
    model = transformers.AutoModelForCausalLM.from_pretrained(directory)
    add_sp_fused_head(model, usp.Plan(None))
    ids = torch.randint(6, 30, (2, 6))
    labels = ids.clone()
    with pytest.raises(InputError, match="does not take \\['pixel_values'\\]"):
        model(input_ids=ids, labels=labels, fused_lm_head=True, pixel_values=torch.zeros(1))
    with pytest.raises(InputError, match="pre-shifted shift_labels"):
        model(input_ids=ids, shift_labels=labels, labels=labels, fused_lm_head=True)
    holed = torch.ones_like(ids)
    holed[0, 2] = 0
    with pytest.raises(InputError, match="row 0 .* padding between"):
        model(input_ids=ids, attention_mask=holed, labels=labels, fused_lm_head=True)
    with pytest.raises(InputError, match="temperature"):
        add_sp_fused_head(model, usp.Plan(None), temperature=0.0)
    out = model(input_ids=ids, labels=labels, fused_lm_head=True)  # the good call
    assert out.log_probs.shape == (2, 5) and out.entropy.shape == (2, 5)
    assert model(input_ids=ids).logits.shape == (2, 6, 64)  # the plain forward is untouched
