"""Post-training under sequence parallelism: the primitives any RL or preference
framework calls (verl, OpenRLHF, TRL through :mod:`usp.integrations`, a custom loop).

    shard = usp.rl.shard_rows(plan, input_ids, labels=labels, attention_mask=mask)
    hidden = model.get_decoder()(**shard.batch.hf_kwargs()).last_hidden_state
    stats = usp.rl.token_logprobs(hidden, model.lm_head.weight, shard.targets,
                                  temperature=0.9, outputs=("entropy",))
    per_token = shard.to_rows(stats.logprobs)        # [B, S - 1] on every SP rank
    per_row = shard.sequence_sums(stats.logprobs)     # [B]

* :mod:`usp.rl.logprobs`: per-token log-probabilities and entropies of given targets
  from hidden states, in chunks of tokens (never ``[S/P, V]`` logits in float32 at once,
  never a gathered vocabulary);
* :mod:`usp.rl.rows`: padded rows as packed documents, this rank's shard, and the sums
  over the SP group back to rows (global values, local gradients);
* :mod:`usp.rl.policy`: TRL's GRPO policy losses (grpo, bnpo, dr_grpo, dapo; token or
  sequence importance ratios; clipping; the KL to a reference) from per-sequence sums;
* :mod:`usp.rl.preference`: DPO's per-sequence sums of chosen and rejected completions.
"""

from usp.rl.logprobs import OPTIONAL_OUTPUTS, TokenStats, token_logprobs
from usp.rl.policy import PolicyLoss, PolicyLossConfig, policy_loss
from usp.rl.preference import completion_labels, preference_logps
from usp.rl.rows import RowShard, row_spans, shard_rows, sum_over_group

__all__ = [
    "OPTIONAL_OUTPUTS",
    "PolicyLoss",
    "PolicyLossConfig",
    "RowShard",
    "TokenStats",
    "completion_labels",
    "policy_loss",
    "preference_logps",
    "row_spans",
    "shard_rows",
    "sum_over_group",
    "token_logprobs",
]
