"""TRL's fused LM head computed under usp's sequence parallelism.

TRL 1.16's GRPO and DPO trainers never ask a model for logits: they call
``model(input_ids=..., attention_mask=..., labels=..., fused_lm_head=True)`` on a
padded batch ``[B, S]`` and read per-token values in the row layout ``[B, S - 1]``
(``log_probs``, ``entropy``, ``mean_logits``, ``is_top1``; the prediction at column
``t`` scores the label at ``t + 1``) and a mixture-of-experts model's ``aux_loss``
(``trl.trainer.utils.add_fused_lm_head``). :func:`add_sp_fused_head` gives an HF causal
LM that keyword under a :class:`usp.Plan`: every SP rank passes the same padded batch,
which is packed row by row and sharded (:func:`usp.rl.shard_rows`); the decoder runs on
this rank's shard; the head computes the per-token values in chunks of tokens
(:func:`usp.rl.token_logprobs`); and they come back in the row layout, the same on
every SP rank, their gradient flowing to this rank's tokens
(:meth:`usp.rl.RowShard.to_rows`). TRL's own loss code then runs unchanged on every SP
rank on identical values, and the SP ranks' gradients sum to the replica's.

The load-balancing loss (``aux_loss``) is transformers' over the batch's real tokens,
its statistics summed over the SP group (:func:`usp.models.moe.sp_router_aux_loss`):
one replica's, as TRL computes one process's. Without ``fused_lm_head`` the forward is
the model's own (generation, the trainers' other calls).
"""

from __future__ import annotations

import functools
import types

try:
    from trl.trainer.utils import FusedCausalLMOutput
except ImportError:  # pragma: no cover - the message is the point
    raise ImportError("usp's TRL trainers need TRL: pip install usp[trl]") from None

import torch

import usp.models.hf as usp_hf
from usp.errors import InputError
from usp.models.loss import DEFAULT_LOSS_CHUNK_TOKENS
from usp.models.moe import sp_router_aux_loss, stats_dtype, stats_from_router_logits
from usp.rl import shard_rows, token_logprobs
from usp.rl.logprobs import check_temperature
from usp.sp.plan import as_plan

#: what the SP head computes of TRL's fused-head outputs (TRL's ``log_sum_sq_probs``,
#: used only by DPO's ``use_weighting``, is not among them)
HEAD_OUTPUTS = ("entropy", "mean_logits", "is_top1")


def num_experts_of(config) -> int:
    """An MoE config's expert count (``num_experts``, gpt-oss's ``num_local_experts``)."""
    value = getattr(config, "num_experts", None)
    return int(value if value is not None else config.num_local_experts)


def add_sp_fused_head(
    model,
    plan,
    *,
    temperature: float = 1.0,
    outputs: tuple[str, ...] = ("entropy",),
    chunk_tokens: int = DEFAULT_LOSS_CHUNK_TOKENS,
    pad_token_id: int = 0,
):
    """Give ``model`` (an HF causal LM with USP attention) the keyword ``fused_lm_head``
    of the module docstring, computed under ``plan``; in place, on top of whatever
    forward it has (TRL's own fused head included), returns the model. ``outputs``:
    which of :data:`HEAD_OUTPUTS` to compute besides the log-probabilities;
    ``pad_token_id``: the token the pads placing documents on the layout get."""
    usp_hf.check_chunked_loss(model)  # logits must be lm_head(hidden): no softcap, no bias
    temperature = check_temperature(temperature)
    unknown = sorted(set(outputs) - set(HEAD_OUTPUTS))
    if unknown:
        raise InputError(f"the SP head computes {list(HEAD_OUTPUTS)}, not {unknown}")
    plan = as_plan(plan)
    inner = model.forward
    head = _SpHead(plan, temperature, tuple(outputs), chunk_tokens, pad_token_id)

    @functools.wraps(type(model).forward)
    def forward(self, *args, fused_lm_head=False, labels=None, shift_labels=None, **kwargs):
        if not fused_lm_head:
            extra = {"labels": labels, "shift_labels": shift_labels}
            return inner(*args, **kwargs, **{k: v for k, v in extra.items() if v is not None})
        if args or shift_labels is not None or labels is None:
            raise InputError(
                "usp's fused head takes keyword inputs and labels (TRL's GRPO/DPO call), "
                "not positional inputs or pre-shifted shift_labels"
            )
        return head(self, labels, kwargs)

    model.forward = types.MethodType(forward, model)
    model.usp_fused_head = head
    return model


class _SpHead:
    """The forward of :func:`add_sp_fused_head` with ``fused_lm_head=True``."""

    def __init__(self, plan, temperature, outputs, chunk_tokens, pad_token_id):
        self.plan, self.temperature, self.outputs = plan, temperature, outputs
        self.chunk_tokens, self.pad_token_id = chunk_tokens, pad_token_id

    def __call__(self, model, labels, kwargs):
        input_ids = kwargs.pop("input_ids", None)
        attention_mask = kwargs.pop("attention_mask", None)
        kwargs.pop("use_cache", None)
        kwargs.pop("num_items_in_batch", None)
        config = model.config.get_text_config()
        routers = kwargs.pop("output_router_logits", getattr(config, "output_router_logits", False))
        if kwargs:
            raise InputError(
                f"usp's fused head does not take {sorted(kwargs)} (text-only batches of "
                "input_ids, attention_mask and labels)"
            )
        if input_ids is None:
            raise InputError("usp's fused head needs input_ids [B, S]")
        shard = shard_rows(
            self.plan, input_ids, labels=labels, attention_mask=attention_mask,
            pad_token_id=self.pad_token_id,
        )  # fmt: skip
        extra = {"output_router_logits": True} if routers else {}
        out = model.get_decoder()(**shard.batch.hf_kwargs(), **extra)
        hidden = out.last_hidden_state  # [1, S'/P, dim]
        weight = model.get_output_embeddings().weight
        device = hidden.device.type
        if torch.is_autocast_enabled(device):  # the projection in the autocast dtype, as TRL's
            dtype = torch.get_autocast_dtype(device)
            hidden, weight = hidden.to(dtype), weight.to(dtype)
        elif weight.dtype != hidden.dtype:
            hidden = hidden.to(weight.dtype)
        stats = token_logprobs(
            hidden, weight, shard.targets, temperature=self.temperature,
            outputs=self.outputs, chunk_tokens=self.chunk_tokens,
        )  # fmt: skip
        log_probs = shard.to_rows(stats.logprobs)  # [B, S - 1]
        values = {}
        for name in HEAD_OUTPUTS:
            value = getattr(stats, name)
            if value is not None and value.dtype == torch.bool:
                values[name] = shard.to_rows(value.to(torch.int32)) > 0
            elif value is not None:
                values[name] = shard.to_rows(value)
        mask = labels[:, 1:] != -100
        loss = -log_probs.sum() / mask.sum().clamp(min=1)
        aux = None
        if routers:
            router_stats = stats_from_router_logits(
                out.router_logits, config.num_experts_per_tok, shard.batch.real
            )
            dtype = stats_dtype(out.router_logits[0].dtype)
            aux = sp_router_aux_loss(router_stats, num_experts_of(config), shard.group, dtype)
            loss = loss + getattr(config, "router_aux_loss_coef", 0.0) * aux
        return FusedCausalLMOutput(
            loss=loss, log_probs=log_probs, entropy=values.get("entropy"),
            log_sum_sq_probs=None, mean_logits=values.get("mean_logits"),
            is_top1=values.get("is_top1"), label_mask=mask, aux_loss=aux,
        )  # fmt: skip
