"""TRL's ``DPOTrainer`` on usp's sequence parallelism (:class:`UspDPOTrainer`).

TRL's preference collator gives every micro-batch as ``2B`` padded rows (the chosen
completions, then the rejected ones, each after its prompt) with a
``completion_mask``; TRL's loss asks the model for per-token log-probs through its
fused head. Under usp every SP rank of a replica holds the same micro-batch
(:class:`usp.integrations.hf_batches.DataParallelSampler`), the head packs the rows,
shards them and returns the per-token values in TRL's layout on every SP rank
(:func:`usp.integrations.trl_head.add_sp_fused_head`), so each completion's log-prob
sum is one sum over the SP group and TRL's own ``_compute_loss`` runs unchanged. As in
:mod:`usp.integrations.trl_grpo`, a replica is what a TRL process is: the loss is the
replica's, its gradient divided by ``dp`` (FSDP2 sums where DDP averages).

The reference log-probs come from a reference model prepared like the policy (USP
attention, its own FSDP2 shards) or, with ``precompute_ref_log_probs``, are computed
before training under the same SP (every rank over the whole data set, in order, by a
copy of the initial policy that is dropped afterwards) and added to it as TRL's
``ref_chosen_logps`` / ``ref_rejected_logps`` columns.
"""

from __future__ import annotations

try:
    import trl
except ImportError:  # pragma: no cover - the message is the point
    raise ImportError(
        "usp.integrations.transformers.UspDPOTrainer needs TRL: pip install usp[trl]"
    ) from None

import copy

import torch
from torch.utils.data import DataLoader

from usp.errors import ConfigError, UspError
from usp.integrations.hf_setup import prepare_model
from usp.integrations.hf_trainer import UspTrainerMixin
from usp.integrations.trl_head import add_sp_fused_head
from usp.models import DEFAULT_LOSS_CHUNK_TOKENS, Levers
from usp.rl import row_spans

#: DPO's loss types whose SP path is tested (examples/trl_dpo.py)
LOSS_TYPES = ("sigmoid",)


def check_dpo_arguments(args, kwargs) -> None:
    """A :class:`usp.ConfigError` naming every DPO option usp's trainer refuses."""
    problems = []
    if kwargs.get("peft_config") is not None:
        problems.append("peft_config (PEFT models are not supported by usp's trainers yet)")
    if kwargs.get("eval_dataset") is not None:
        problems.append("eval_dataset (evaluation is not supported yet)")
    if args is not None:
        loss_types = args.loss_type if isinstance(args.loss_type, list) else [args.loss_type]
        if any(t not in LOSS_TYPES for t in loss_types):
            problems.append(f"loss_type={loss_types} (usp runs {list(LOSS_TYPES)})")
        if getattr(args, "use_weighting", False):
            problems.append("use_weighting (needs log_sum_sq_probs, which usp's head omits)")
        if getattr(args, "ld_alpha", None) is not None:
            problems.append("ld_alpha (not tested under usp): set None")
        if getattr(args, "f_divergence_type", "reverse_kl") != "reverse_kl":
            problems.append(f'f_divergence_type="{args.f_divergence_type}" (usp runs reverse_kl)')
        for name in ("use_liger_kernel", "sync_ref_model", "padding_free"):
            if getattr(args, name, False):
                problems.append(f"{name} (not supported by usp's DPO trainer)")
        if getattr(args, "eval_strategy", "no") not in ("no", None):
            problems.append("eval_strategy (evaluation is not supported yet): set 'no'")
    if problems:
        raise ConfigError("usp's DPOTrainer integration cannot use " + "; ".join(problems))


class UspDPOTrainer(UspTrainerMixin, trl.DPOTrainer):
    """``trl.DPOTrainer`` on usp's sequence parallelism (module docstring). Arguments as
    TRL's (``ref_model``, ``args``, ``train_dataset`` ... by keyword), plus ``plan`` and
    ``levers`` as :class:`usp.integrations.transformers.UspTrainer`'s;
    ``args.per_device_train_batch_size`` is per replica."""

    def __init__(self, model=None, ref_model=None, args=None, *more, plan=None, levers=None,
                 **kwargs):  # fmt: skip
        if more:
            raise TypeError("UspDPOTrainer takes its arguments after args by keyword")
        check_dpo_arguments(args, kwargs)
        self._usp_heads_added = False
        precompute = bool(getattr(args, "precompute_ref_log_probs", False))
        if precompute and ref_model is None and isinstance(model, torch.nn.Module):
            # the reference is the policy before training: a copy taken before usp shards
            # the policy (TRL fingerprints the reference's weights, which needs them whole),
            # sharded like it for the precomputation and dropped after it
            ref_model = copy.deepcopy(model)
        super().__init__(model, args, plan=plan, levers=levers, ref_model=ref_model, **kwargs)
        self._usp_add_heads()
        if self.precompute_ref_logps:
            self.ref_model = None  # the data set holds its log-probs now
        # TRL's DPO loss is a mean per micro-batch: HF divides it by the accumulation
        # steps (the mixin's default is a loss normalised by the step's label count)
        self.loss_is_scaled_for_ga = False
        # the SP ranks hold copies of the batch, as TRL's tensor-parallel ranks do: its
        # token count divides by this
        self._tp_size = self.usp_plan.sp_degree

    def _usp_add_heads(self) -> None:
        """The SP head on the policy and on the reference model (prepared like the
        policy), once (TRL may precompute reference log-probs inside its __init__)."""
        if self._usp_heads_added:
            return
        plan = self.usp_plan
        chunk = self.usp_model.levers.loss_chunk_tokens or DEFAULT_LOSS_CHUNK_TOKENS
        pad = self._tokenizer.pad_token_id
        add_sp_fused_head(self.model, plan, outputs=("entropy", "mean_logits", "is_top1"),
                          chunk_tokens=chunk, pad_token_id=pad)  # fmt: skip
        if getattr(self, "ref_model", None) is not None:
            name = f"{self.usp_model.attention}-reference"
            prepare_model(self.ref_model, plan, Levers(), name=name,
                          use_cpu=bool(self.args.use_cpu))  # fmt: skip
            add_sp_fused_head(self.ref_model, plan, outputs=(), chunk_tokens=chunk,
                              pad_token_id=pad)  # fmt: skip
        self._usp_heads_added = True

    def _precompute_ref_logps(self, dataset, name: str, batch_size: int):
        """The reference log-probs of every record, under SP: every rank runs the whole
        data set in order (the SP ranks of a replica the same batches)."""
        self._usp_add_heads()
        loader = DataLoader(dataset, batch_size=batch_size, collate_fn=self.data_collator)
        model = self.ref_model if self.ref_model is not None else self.model
        chosen, rejected = [], []
        for batch in loader:
            batch = {k: v.to(self.args.device) for k, v in batch.items()}
            pair = self.compute_ref_log_probs(model, batch)
            chosen.append(pair[0].float().cpu())
            rejected.append(pair[1].float().cpu())
        dataset = dataset.add_column("ref_chosen_logps", torch.cat(chosen).tolist())
        return dataset.add_column("ref_rejected_logps", torch.cat(rejected).tolist())

    def _get_num_items_in_batch(self, batch_samples, device):
        return None  # DPO's loss is a mean per micro-batch

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """TRL's loss of this replica's micro-batch (its log-probs from the SP head),
        divided by ``dp``: FSDP2 sums the replicas' gradients where TRL's DDP averages."""
        if return_outputs:
            raise ConfigError("usp's DPOTrainer computes the loss only (no logits)")
        error = None
        try:  # rows usp cannot place: refused on every replica before any collective
            row_spans(inputs["attention_mask"])
        except UspError as err:
            error = err
        self._usp_agree_replicas("usp: this micro-batch", error)
        loss = trl.DPOTrainer.compute_loss(self, model, inputs)
        return loss * (self.usp_model.loss_scale / self.usp_plan.topology.dp_degree)

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        raise ConfigError("usp's DPOTrainer does not evaluate yet")
