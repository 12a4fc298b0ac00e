"""transformers' ``Trainer`` on usp's sequence parallelism: :class:`UspTrainerMixin`.

What the mixin changes in a Trainer (TRL's ``SFTTrainer`` included), and why:

* **the model** (:func:`usp.integrations.hf_setup.prepare_model`, before the Trainer
  sees it): USP attention, the levers, FSDP2 over ``dp x sp`` with summed gradients;
  the Trainer takes it as a model sharded at load time (no DDP, no second sharding).
* **the data**: one :class:`DataParallelSampler` per dp replica, so every SP rank of a
  replica holds the same global batch; each micro-batch is sharded for this rank
  (:class:`usp.integrations.hf_batches.GlobalBatch`: padding-free batches by their
  global documents, padded rows as documents), the SP ranks agreeing on its fingerprint.
* **the loss**: the mean over every label of the optimizer step (all micro-batches, all
  replicas): each micro-batch's loss is its SP-global sum over that count
  (:func:`usp.models.hf.sp_loss`, or the chunked :func:`usp.models.hf.causal_lm_loss`),
  so gradient accumulation and data parallelism are exact; the value returned for
  logging is summed over the replicas, so HF's mean over processes logs the global loss.
* **errors**: a batch one replica cannot train (left padding, an attention chunk shorter than
  the sequence, SP ranks holding different batches) is agreed over the replicas before
  any collective of the step, so every rank raises the same error instead of hanging.
* **saving**: the full state dict is gathered from the shards (tied weights once, as
  transformers saves them); rank 0 writes it.
"""

from __future__ import annotations

import contextlib
import functools

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.utils.data import DataLoader, IterableDataset

import usp.models.hf as usp_hf
from usp.comm.agreement import agree, can_agree
from usp.errors import (
    ConfigError,
    InputError,
    ModelConfigError,
    RankDisagreementError,
    ShardingError,
    UspError,
)
from usp.integrations.hf_batches import DataParallelSampler, global_batch
from usp.integrations.hf_setup import (
    UnsupportedModelError,
    launch_plan,
    prepare_model,
    window_problem,
)
from usp.models.hf_inputs import HFInputError
from usp.models.moe import sp_router_aux_loss, stats_dtype, stats_from_router_logits
from usp.sp.plan import as_plan
from usp.train.parallelize import set_gradient_sync

#: error classes re-raised as themselves when the replicas agree on a failure
_AGREED_ERRORS = (
    HFInputError,
    UnsupportedModelError,
    RankDisagreementError,
    ShardingError,
    InputError,
    ModelConfigError,
    UspError,
)


class _EpochDataLoader(DataLoader):
    """A DataLoader whose sampler hears the Trainer's ``set_epoch``."""

    def set_epoch(self, epoch: int) -> None:
        self.sampler.set_epoch(epoch)


def check_training_arguments(args, *, compute_loss_func=None, levers=None) -> None:
    """A :class:`usp.ConfigError` for Trainer settings the integration replaces or cannot
    serve (each message says what to do instead)."""
    problems = []
    if getattr(args, "deepspeed", None):
        problems.append("deepspeed (usp shards the model with FSDP2 itself): remove it")
    if getattr(args, "fsdp", None):
        problems.append("fsdp (usp shards the model with FSDP2 over dp x sp itself): remove it")
    if getattr(args, "parallelism_config", None) is not None:
        problems.append(
            "parallelism_config (accelerate's own sequence/context parallelism): usp's plan "
            "replaces it; remove it"
        )
    if getattr(args, "label_smoothing_factor", 0):
        problems.append("label_smoothing_factor (usp's SP loss is plain cross-entropy): set 0")
    if getattr(args, "torch_compile", False):
        problems.append("torch_compile (not supported through the Trainer integration yet)")
    strategy = getattr(args, "train_sampling_strategy", "random")
    if strategy not in ("random", "sequential"):
        problems.append(
            f'train_sampling_strategy="{strategy}": usp samples by data-parallel replica, '
            '"random" or "sequential"'
        )
    if compute_loss_func is not None:
        problems.append("compute_loss_func (usp computes the SP loss): remove it")
    # (transformers 5 reads the deprecated gradient_checkpointing into this one)
    hf_checkpointing = getattr(args, "activation_checkpointing", False)
    if levers is not None and levers.activation_checkpointing and hf_checkpointing:
        problems.append(
            "activation_checkpointing in both the TrainingArguments and usp's Levers: keep one "
            "(the Levers' also offloads to host memory)"
        )
    if problems:
        raise ConfigError("usp's Trainer integration cannot use " + "; ".join(problems))


class UspTrainerMixin:
    """Put before a ``transformers.Trainer`` subclass: ``class T(UspTrainerMixin, Trainer)``
    (see the module docstring). Extra keywords: ``plan`` (a :class:`usp.Plan`; default:
    :func:`launch_plan`'s, one process when not under torchrun), ``levers`` (a
    :class:`usp.models.Levers`), ``attention_name`` (the name USP attention is
    registered under)."""

    def __init__(self, model=None, args=None, *more, plan=None, levers=None, **kwargs):
        attention_name = kwargs.pop("attention_name", "usp")
        if model is None or isinstance(model, str):
            raise TypeError(
                "usp's Trainer integration needs the model itself, e.g. "
                "AutoModelForCausalLM.from_pretrained(path), not a name or None"
            )
        if hasattr(model, "peft_config"):
            raise ConfigError("PEFT models are not supported by usp's Trainer integration yet")
        if args is not None:
            check_training_arguments(
                args, compute_loss_func=kwargs.get("compute_loss_func"), levers=levers
            )
        self.usp_plan = launch_plan() if plan is None else as_plan(plan)  # a Plan or Topology
        self.usp_model = prepare_model(
            model, self.usp_plan, levers, name=attention_name,
            use_cpu=bool(getattr(args, "use_cpu", False)),
        )  # fmt: skip
        if more:  # the Trainer's positional order (model, args, data_collator, ...)
            super().__init__(model, args, *more, **kwargs)
        else:  # by keyword: TRL's GRPO and DPO trainers take other arguments second
            super().__init__(model, args=args, **kwargs)
        check_training_arguments(self.args, levers=self.usp_model.levers)
        # the loss is normalised by the label count of the whole step (see compute_loss)
        self.loss_is_scaled_for_ga = True

    # ------------------------------------------------------------------ data
    def get_train_dataloader(self) -> DataLoader:
        if self.train_dataset is None:
            raise ValueError("Trainer: training requires a train_dataset.")
        sequential = self.args.train_sampling_strategy == "sequential"
        return self._usp_dataloader(
            self.train_dataset, self._train_batch_size, "Training", shuffle=not sequential
        )

    def get_eval_dataloader(self, eval_dataset=None) -> DataLoader:
        if eval_dataset is None and self.eval_dataset is None:
            raise ValueError("Trainer: evaluation requires an eval_dataset.")
        if isinstance(eval_dataset, str):
            eval_dataset = self.eval_dataset[eval_dataset]
        dataset = self.eval_dataset if eval_dataset is None else eval_dataset
        return self._usp_dataloader(dataset, self.args.eval_batch_size, "Evaluation", shuffle=False)

    def _usp_dataloader(self, dataset, batch_size: int, description: str, *, shuffle: bool):
        if isinstance(dataset, IterableDataset) or not hasattr(dataset, "__len__"):
            raise ConfigError(
                f"usp's Trainer integration samples a {description.lower()} data set by "
                "data-parallel replica, which needs its length: give a map-style data set "
                "(datasets.Dataset, a list), not an IterableDataset"
            )
        collator = self.data_collator
        if hasattr(dataset, "column_names") and hasattr(dataset, "remove_columns"):
            dataset = self._remove_unused_columns(dataset, description=description)
        else:
            collator = self._get_collator_with_removed_columns(collator, description=description)
        topology = self.usp_plan.topology
        sampler = DataParallelSampler(
            len(dataset),
            batch_size=batch_size,
            dp_rank=topology.dp_rank,
            dp_degree=topology.dp_degree,
            shuffle=shuffle,
            seed=self.args.seed if self.args.data_seed is None else self.args.data_seed,
            drop_last=self.args.dataloader_drop_last,
        )
        workers = self.args.dataloader_num_workers
        options = {"prefetch_factor": self.args.dataloader_prefetch_factor} if workers else {}
        return _EpochDataLoader(
            dataset,
            batch_size=batch_size,
            sampler=sampler,
            collate_fn=collator,
            num_workers=workers,
            pin_memory=self.args.dataloader_pin_memory,
            persistent_workers=self.args.dataloader_persistent_workers and workers > 0,
            **options,
        )

    # ------------------------------------------------------------------ the loss
    def _get_num_items_in_batch(self, batch_samples: list, device: torch.device):
        """The optimizer step's label count: every micro-batch of every replica."""
        if not batch_samples:
            return None
        error, count = None, 0
        try:
            for inputs in batch_samples:
                count += global_batch(inputs, self.usp_plan).label_count()
        except UspError as err:
            error = err
        self._usp_agree_replicas("usp: the step's batches", error)
        total = torch.tensor(count, dtype=torch.int64, device=device)
        return int(self._usp_sum_replicas(total))

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """This rank's share of the SP loss of one micro-batch (see the module
        docstring); ``num_items_in_batch`` (the step's label count) normalises it, None:
        this micro-batch's own count over the SP group."""
        plan = self.usp_plan
        error, batch = None, None
        self._usp_last_aux = None  # this micro-batch's router aux loss, if any
        try:
            batch = global_batch(inputs, plan).shard(
                plan, pad_token_id=self._usp_pad_id(), model=model
            )
            problem = window_problem(self.model.config, batch.input_ids.shape[1] * plan.sp_degree)
            if problem is not None:
                raise UnsupportedModelError(f"usp cannot train exactly {problem}")
        except UspError as err:
            error = err
        self._usp_agree_replicas("usp: this micro-batch", error)
        weight = self._usp_router_aux_weight(num_items_in_batch)
        router_aux = None
        if weight is not None:
            router_aux = functools.partial(self._usp_router_aux, real=batch.real, weight=weight)
        chunk = self.usp_model.levers.loss_chunk_tokens
        if chunk is not None:
            loss = usp_hf.causal_lm_loss(
                model, batch, plan, chunk_tokens=chunk, num_items_in_batch=num_items_in_batch,
                router_aux=router_aux,
            )  # fmt: skip
        else:
            extra = {} if router_aux is None else {"output_router_logits": True}
            out = model(**batch.hf_kwargs(), **extra)
            loss = usp_hf.sp_loss(  # logits [B, S/P, V]
                out.logits, batch.labels, plan, num_items_in_batch=num_items_in_batch
            )
            if router_aux is not None:
                loss = loss + router_aux(out.router_logits).to(loss.dtype)
        self._usp_after_loss(inputs)
        if self.usp_model.loss_scale != 1.0:
            loss = loss * self.usp_model.loss_scale  # FSDP averages: undone here
        return (loss, None) if return_outputs else loss

    # ------------------------------------------------------------------ the router's aux
    def _usp_router_aux_weight(self, num_items_in_batch) -> float | None:
        """The coefficient of a mixture-of-experts model's load-balancing loss in this
        micro-batch's loss, None: no aux term. transformers' models add
        ``router_aux_loss_coef`` x aux to each micro-batch's loss when the config has
        ``output_router_logits`` (TRL's trainer overrides this)."""
        config = self.model.config.get_text_config()
        if not getattr(config, "output_router_logits", False):
            return None
        return float(config.router_aux_loss_coef)

    def _usp_router_aux(self, router_logits, *, real, weight: float) -> torch.Tensor:
        """``weight`` x the load-balancing loss of this micro-batch of every replica
        (its router statistics summed over dp x sp: what one process computes for the
        whole micro-batch; the pads usp added are left out). Its value is divided by dp
        (the logged loss is summed over the replicas), its gradient is this rank's share
        (FSDP2 sums the shares)."""
        config = self.model.config.get_text_config()
        stats = stats_from_router_logits(router_logits, config.num_experts_per_tok, real)
        topology = self.usp_plan.topology
        group, dp = None, 1
        if topology.world_size > 1:
            group, dp = topology.dp_sp_group, topology.dp_degree
        dtype = stats_dtype(router_logits[0].dtype)
        aux = sp_router_aux_loss(stats, router_logits[0].shape[-1], group, dtype=dtype)
        self._usp_last_aux = aux.detach()
        return weight * (aux - aux.detach() * (1 - 1 / dp))

    def training_step(self, model, inputs, num_items_in_batch=None):
        """HF's step (backward of this rank's share); returns the micro-batch's loss
        over all replicas, so HF's mean over processes logs the global loss."""
        loss = super().training_step(model, inputs, num_items_in_batch)
        return self._usp_sum_replicas(loss / self.usp_model.loss_scale)

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        """The evaluation loss of one batch over all replicas (the logits are sharded over
        the SP ranks and not gathered: loss only)."""
        if not prediction_loss_only:
            raise ConfigError(
                "usp's Trainer integration evaluates the loss only (each SP rank holds a shard "
                "of the logits): leave compute_metrics unset (prediction_loss_only=True)"
            )
        inputs = self._prepare_inputs(inputs)
        count = self._get_num_items_in_batch([inputs], self.args.device)
        with torch.no_grad(), self.compute_loss_context_manager():
            loss = self.compute_loss(model, inputs, num_items_in_batch=count)
        loss = self._usp_sum_replicas(loss.detach() / self.usp_model.loss_scale)
        return loss, None, None

    def _usp_after_loss(self, inputs) -> None:
        """A hook after each micro-batch's loss (the TRL trainer counts tokens there)."""

    def _usp_pad_id(self) -> int:
        pad = getattr(self.model.config.get_text_config(), "pad_token_id", None)
        return 0 if pad is None else int(pad)

    # ------------------------------------------------------------------ replicas
    def _usp_dp_group(self):
        topology = self.usp_plan.topology
        if topology.dp_degree == 1 or not can_agree(topology.dp_group):
            return None
        return topology.dp_group

    def _usp_agree_replicas(self, what: str, error: BaseException | None) -> None:
        """Raise ``error`` (or a replica's) on every rank; SP ranks already agree."""
        group = self._usp_dp_group()
        if group is not None:
            agree(group, what, [], error, _AGREED_ERRORS)
        if error is not None:
            raise error

    def _usp_sum_replicas(self, value: torch.Tensor) -> torch.Tensor:
        """``value`` (equal on the SP ranks of a replica) summed over the replicas."""
        group = self._usp_dp_group()
        if group is None:
            return value
        total = value.detach().clone()
        dist.all_reduce(total, group=group)
        return total

    # ------------------------------------------------------------------ bookkeeping
    @contextlib.contextmanager
    def _defer_fsdp_gradient_reduction(self):
        """No reduce-scatter until the last micro-batch of a step (FSDP2's own switch)."""
        set_gradient_sync(self.model, False)
        try:
            yield
        finally:
            set_gradient_sync(self.model, True)

    def _track_num_input_tokens(self, inputs) -> None:
        """Tokens seen, each replica's once (HF's count over all processes would count
        every SP rank's copy of the batch)."""
        mode = self.args.include_num_input_tokens_seen
        if mode == "no" or mode is False:
            return
        ids = inputs[getattr(self.model, "main_input_name", "input_ids")]
        mask = inputs.get("attention_mask")
        pad = getattr(self.processing_class, "pad_token_id", None)
        count = ids.numel()  # HF's rules for what counts
        if mode == "non_padding" and mask is not None:
            count = mask.sum()
        elif mode == "non_padding" and pad is not None:
            count = (ids != pad).sum()
        count = torch.as_tensor(count, dtype=torch.int64, device=self.args.device)
        self.state.num_input_tokens_seen += int(self._usp_sum_replicas(count))

    def floating_point_ops(self, inputs) -> int:
        """HF's estimate for the replica's batch, shared by its SP ranks."""
        return super().floating_point_ops(inputs) // self.usp_plan.sp_degree

    def _save(self, output_dir=None, state_dict=None) -> None:
        """The full weights from the FSDP2 shards (a collective), written by rank 0."""
        if self.usp_model.sharded and state_dict is None:
            options = StateDictOptions(full_state_dict=True, cpu_offload=True)
            state_dict = get_model_state_dict(self.model, options=options)
            # gathered copies no longer share storage, by which transformers finds tied
            # weights (tied embeddings): leave them out as its own save does
            for target, source in getattr(self.model, "all_tied_weights_keys", {}).items():
                if source in state_dict:
                    state_dict.pop(target, None)
            if not self.args.should_save:
                return
        super()._save(output_dir, state_dict=state_dict)
