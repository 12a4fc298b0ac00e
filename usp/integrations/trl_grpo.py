"""TRL's ``GRPOTrainer`` on usp's sequence parallelism (:class:`UspGRPOTrainer`).

A data-parallel replica is what a TRL process is: its SP ranks hold the same rows, so
every quantity TRL computes per process (a loss normalisation, a micro-batch's
load-balancing loss) is computed per replica, and every quantity TRL gathers over
processes (rewards for the advantages, token counts, metrics) is gathered over the
replicas. On ``u x r`` SP ranks with one replica it equals the stock trainer in one
process; on ``dp`` replicas, the stock trainer on ``dp`` processes.

* **the model** (:class:`usp.integrations.hf_trainer.UspTrainerMixin`): USP attention,
  the levers, FSDP2 over ``dp x sp``; TRL's fused LM head computed under SP
  (:func:`usp.integrations.trl_head.add_sp_fused_head`), so TRL's own ``_compute_loss``
  runs unchanged on every SP rank on the same per-token values, and its gradient is
  divided by ``dp`` (FSDP2 sums over the replicas where TRL's DDP averages). The
  reference model (``beta != 0``) is prepared the same way (its own FSDP2 shards).
* **rollouts** (:mod:`usp.integrations.trl_rollouts`): the replica's prompts spread
  over its SP ranks by whole prompt groups, generated with SP off on a full-weight copy
  of the policy, scored once per completion, all-gathered; TRL's advantages over every
  replica's rewards; the old policy's (``num_iterations > 1``) and the reference's
  log-probs under SP.
* **refused** (each named in a :class:`usp.ConfigError`): what usp has not made exact or
  tested under SP: vLLM generation, continuous batching, tools and environments
  (multi-turn), custom rollout functions, reward models (wrap them in a reward
  function), PEFT, liger kernels, evaluation, and the options listed in
  :func:`check_grpo_arguments`.
"""

from __future__ import annotations

try:
    import trl
except ImportError:  # pragma: no cover - the message is the point
    raise ImportError(
        "usp.integrations.transformers.UspGRPOTrainer needs TRL: pip install usp[trl]"
    ) from None

import torch
import torch.distributed as dist
from torch import nn
from trl.data_utils import is_conversational
from trl.trainer.utils import identity, nanstd, pad, split_tensor_dict

from usp.comm.agreement import agree, can_agree
from usp.errors import ConfigError, UspError
from usp.integrations import trl_rollouts as rollouts
from usp.integrations.hf_setup import launch_plan, prepare_model
from usp.integrations.hf_trainer import _AGREED_ERRORS, UspTrainerMixin, _EpochDataLoader
from usp.integrations.trl_head import add_sp_fused_head
from usp.models import DEFAULT_LOSS_CHUNK_TOKENS, Levers
from usp.models.hf_inputs import HFInputError
from usp.rl import row_spans
from usp.sp.plan import as_plan

#: the loss types whose SP path is tested against TRL (usp.rl.policy, examples/trl_grpo.py)
LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")


def check_grpo_arguments(args, reward_funcs, kwargs) -> None:
    """A :class:`usp.ConfigError` naming every GRPO option usp's trainer refuses."""
    problems = []
    for name in ("tools", "environment_factory", "rollout_func"):
        if kwargs.get(name):
            problems.append(f"{name} (multi-turn rollouts are not supported under usp yet)")
    if kwargs.get("peft_config") is not None:
        problems.append("peft_config (PEFT models are not supported by usp's trainers yet)")
    funcs = reward_funcs if isinstance(reward_funcs, list) else [reward_funcs]
    if any(isinstance(f, (str, nn.Module)) for f in funcs if f is not None):
        problems.append(
            "a reward model in reward_funcs (usp scores completions with reward functions: "
            "wrap the model in a function with TRL's reward-function signature)"
        )
    if args is not None:
        refused = {
            "use_vllm": "vLLM generation (its weight sync from usp's FSDP2 shards is not "
            "implemented: generate with transformers, use_vllm=False)",
            "use_transformers_continuous_batching": "continuous batching (set it False)",
            "use_liger_kernel": "use_liger_kernel (it replaces the model's forward)",
            "cast_lm_head_to_fp32": "cast_lm_head_to_fp32 (usp's head computes in the "
            "model's dtype, log-probs in float32)",
            "sync_ref_model": "sync_ref_model (not tested with usp's sharded reference)",
            "use_adaptive_entropy": "use_adaptive_entropy (the entropy bonus)",
            "log_completions": "log_completions (the completions table)",
            "mask_truncated_completions": "mask_truncated_completions (not tested under usp)",
        }
        problems += [why for name, why in refused.items() if getattr(args, name, False)]
        if getattr(args, "loss_type", "dapo") not in LOSS_TYPES:
            problems.append(f'loss_type="{args.loss_type}" (usp runs {", ".join(LOSS_TYPES)})')
        if getattr(args, "entropy_coef", 0.0):
            problems.append(f"entropy_coef={args.entropy_coef} (the entropy bonus): set 0")
        if getattr(args, "top_entropy_quantile", 1.0) < 1.0:
            problems.append(
                f"top_entropy_quantile={args.top_entropy_quantile} (its entropy quantile is "
                "gathered over processes, not replicas): set 1.0"
            )
        if getattr(args, "off_policy_mask_threshold", None) is not None:
            problems.append("off_policy_mask_threshold (not tested under usp): set None")
        if getattr(args, "eval_strategy", "no") not in ("no", None) or kwargs.get("eval_dataset"):
            problems.append("evaluation (eval_strategy / eval_dataset): not supported yet")
    if problems:
        raise ConfigError("usp's GRPOTrainer integration cannot use " + "; ".join(problems))


class UspGRPOTrainer(UspTrainerMixin, trl.GRPOTrainer):
    """``trl.GRPOTrainer`` on usp's sequence parallelism (module docstring). Arguments
    as TRL's (``args``, ``train_dataset``, ``processing_class`` ... by keyword), plus
    ``plan`` and ``levers`` as :class:`usp.integrations.transformers.UspTrainer`'s.
    ``args.per_device_train_batch_size`` is per replica, and the generation batch is
    ``per_device_train_batch_size x dp x steps_per_generation`` rows (TRL derives it
    from the world size, which counts every SP rank: set ``steps_per_generation``, not
    ``generation_batch_size``)."""

    def __init__(self, model=None, reward_funcs=None, args=None, *more, plan=None,
                 levers=None, **kwargs):  # fmt: skip
        if more:
            raise TypeError("UspGRPOTrainer takes its arguments after args by keyword")
        check_grpo_arguments(args, reward_funcs, kwargs)
        plan = launch_plan() if plan is None else as_plan(plan)
        if args is not None:
            _replica_generation_batch(args, plan.topology.dp_degree)
        rollout = rollouts.RolloutModel(model) if isinstance(model, nn.Module) else None
        super().__init__(model, args, plan=plan, levers=levers, reward_funcs=reward_funcs,
                         **kwargs)  # fmt: skip
        # TRL's generation settings over the model's own (as its generation context does)
        rollout.model.generation_config.update(**self.generation_kwargs)
        rollout.check_names(self.model)
        self._usp_rollout = rollout
        topology = plan.topology
        self._usp_sp_group = topology.sp_group if topology.sp_degree > 1 else None
        self._usp_dp = topology.dp_degree
        if (
            self._usp_dp_group() is not None
            and dist.get_rank(self._usp_dp_group()) != topology.dp_rank
        ):
            raise ConfigError(
                "the dp group's ranks are not ordered by replica: usp cannot gather rewards"
            )
        chunk = self.usp_model.levers.loss_chunk_tokens or DEFAULT_LOSS_CHUNK_TOKENS
        head = {"temperature": self.temperature, "chunk_tokens": chunk,
                "pad_token_id": self._tokenizer.pad_token_id}  # fmt: skip
        add_sp_fused_head(self.model, plan, outputs=("entropy",), **head)
        if self.ref_model is not None:
            name = f"{self.usp_model.attention}-reference"
            prepare_model(self.ref_model, plan, Levers(), name=name,
                          use_cpu=bool(self.args.use_cpu))  # fmt: skip
            add_sp_fused_head(self.ref_model, plan, outputs=(), **head)

    # ------------------------------------------------------------------ data
    def get_train_dataloader(self):
        dataset = self.train_dataset
        if isinstance(dataset, torch.utils.data.IterableDataset) or not hasattr(dataset, "__len__"):
            raise ConfigError("usp's GRPOTrainer needs a map-style data set (its length)")
        if hasattr(dataset, "column_names") and hasattr(dataset, "remove_columns"):
            dataset = self._remove_unused_columns(dataset, description="Training")
        local = self._train_batch_size * self.args.steps_per_generation
        topology = self.usp_plan.topology
        sampler = rollouts.ReplicaRepeatSampler(
            self._get_train_sampler(dataset), local=local, dp_rank=topology.dp_rank,
            dp_degree=topology.dp_degree,
        )  # fmt: skip
        return _EpochDataLoader(dataset, batch_size=local, sampler=sampler, collate_fn=identity,
                                num_workers=self.args.dataloader_num_workers)  # fmt: skip

    def _get_num_items_in_batch(self, batch_samples, device):
        return None  # GRPO normalises its loss itself

    def _track_num_input_tokens(self, inputs) -> None:
        """GRPO counts the tokens it generates (every replica's once)."""

    def _prepare_inputs(self, generation_batch):
        """TRL's buffering of a generation batch over ``steps_per_generation`` steps, its
        rows shuffled by one permutation the replica's SP ranks share."""
        if not self.model.training:
            raise ConfigError("usp's GRPOTrainer does not evaluate yet")
        generate_every = self.args.steps_per_generation * self.num_iterations
        if self._step % generate_every == 0 or self._buffered_inputs is None:
            batch = self._generate_and_score_completions(generation_batch)
            batch = self._usp_shuffle(batch)
            self._buffered_inputs = split_tensor_dict(batch, self.args.steps_per_generation)
        return self._buffered_inputs[self._step % self.args.steps_per_generation]

    def _usp_shuffle(self, batch: dict) -> dict:
        rows = len(batch["prompt_ids"])
        permutation = torch.randperm(rows).to(self.accelerator.device)
        if self._usp_sp_group is not None:  # the replica's first SP rank draws it
            source = dist.get_global_rank(self._usp_sp_group, 0)
            dist.broadcast(permutation, src=source, group=self._usp_sp_group)
        permutation = permutation.cpu()
        return {k: v if not torch.is_tensor(v) or v.dim() == 0 else v[permutation.to(v.device)]
                for k, v in batch.items()}  # fmt: skip

    # ------------------------------------------------------------------ the loss
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """TRL's loss of this replica's micro-batch (its log-probs from the SP head),
        divided by ``dp``: FSDP2 sums the replicas' gradients where TRL's DDP averages."""
        error = None
        try:  # rows usp cannot place: refused on every replica before any collective
            row_spans(torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1))
        except UspError as err:
            error = err
        self._usp_agree_replicas("usp: this micro-batch", error)
        loss = trl.GRPOTrainer.compute_loss(self, model, inputs, return_outputs)
        return loss * (self.usp_model.loss_scale / self._usp_dp)

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        raise ConfigError("usp's GRPOTrainer does not evaluate yet")

    # ------------------------------------------------------------------ rollouts
    def _generate_and_score_completions(self, inputs: list) -> dict:
        """TRL's generation batch (prompts to padded rows, rewards, advantages, the old
        and reference log-probs, metrics) for this replica's ``inputs``; see the module
        docstring for how the SP ranks share the work."""
        device = self.accelerator.device
        prompts = [x.get("prompt") for x in inputs]

        def tokenize():  # a replica's bad record fails every replica, not only its own
            if any("image" in x or "images" in x or "prompt" not in x for x in inputs):
                raise HFInputError(
                    "usp's GRPOTrainer trains on text prompts: every record needs a 'prompt' "
                    "(a string or a message list) and no images"
                )
            return self._tokenize_prompts(prompts)[0]

        prompt_ids = self._usp_on_every_rank("usp: the prompts", tokenize)
        mine = self._usp_my_rows(len(inputs))
        self._usp_rollout.sync(self.model)

        def generate():
            if mine.stop == mine.start:
                return []
            return self._usp_rollout.generate(
                [list(p) for p in prompt_ids[mine]], generation_config=self.generation_config,
                pad_token_id=self._tokenizer.pad_token_id, eos_token_ids=self.eos_token_ids,
                pad_to_multiple_of=self.pad_to_multiple_of, device=device,
            )  # fmt: skip

        completion_ids = self._usp_on_every_rank("usp: generating completions", generate)
        conversational = is_conversational({"prompt": prompts[0]})
        texts = self.processing_class.batch_decode(completion_ids, skip_special_tokens=True)
        completions = (
            [[{"role": "assistant", "content": t}] for t in texts] if conversational else texts
        )
        rewards = self._usp_on_every_rank(
            "usp: the reward functions",
            lambda: rollouts.evaluate_rewards(
                self, inputs[mine], prompts[mine], completions, completion_ids
            ).cpu(),
        )
        parts = rollouts.gather_objects((completion_ids, rewards.tolist()), self._usp_sp_group)
        completion_ids = [ids for part in parts for ids in part[0]]
        rewards_local = torch.tensor([r for part in parts for r in part[1]], dtype=torch.float32)
        return self._usp_score(inputs, prompts, prompt_ids, completion_ids,
                               rewards_local.view(len(inputs), -1).to(device))  # fmt: skip

    def _usp_on_every_rank(self, what: str, call):
        """``call()`` (user code: generation, reward functions) on this rank; an exception
        on any rank is raised on every rank (the others would wait in the next
        collective)."""
        error, result = None, None
        try:
            result = call()
        except Exception as err:  # any failure of user code is shared
            error = err
        if dist.is_initialized() and dist.get_world_size() > 1 and can_agree(dist.group.WORLD):
            agree(dist.group.WORLD, what, [], error, _AGREED_ERRORS)
        if error is not None:
            raise error
        return result

    def _usp_my_rows(self, rows: int) -> slice:
        group = self._usp_sp_group
        parts = 1 if group is None else dist.get_world_size(group)
        index = 0 if group is None else dist.get_rank(group)
        first = self.usp_plan.topology.dp_rank * rows
        return rollouts.group_slices(rows, first, self.num_generations, parts)[index]

    def _usp_score(self, inputs, prompts, prompt_ids, completion_ids, rewards_local) -> dict:
        device, mode = self.accelerator.device, "train"
        dp_group = self._usp_dp_group()
        pad_id = self._tokenizer.pad_token_id
        self._usp_generation_metrics(prompt_ids, completion_ids)
        padded = {"padding_side": "left", "pad_to_multiple_of": self.pad_to_multiple_of}
        prompt_tensors = [torch.tensor(ids) for ids in prompt_ids]
        prompt_ids = pad(prompt_tensors, padding_value=pad_id, **padded).to(device)
        prompt_mask = pad([torch.ones_like(t) for t in prompt_tensors], padding_value=0, **padded)
        padded["padding_side"] = "right"
        completion_tensors = [torch.tensor(ids, dtype=torch.long) for ids in completion_ids]
        completion = pad(completion_tensors, padding_value=pad_id, **padded).to(device)
        completion_mask = pad([torch.ones_like(t) for t in completion_tensors], padding_value=0,
                              **padded).to(device)  # fmt: skip
        prompt_mask = prompt_mask.to(device)
        # TRL's count over all processes: every SP rank holds its replica's rows, so the
        # sum counts each replica sp times and TRL's division by the processes gives the
        # count per replica
        count = completion_mask.sum().reshape(1).to(torch.float64)
        num_items = rollouts.gather_rows(count, dp_group).sum() * self.usp_plan.sp_degree
        ids = torch.cat([prompt_ids, completion], dim=1)
        mask = torch.cat([prompt_mask, completion_mask], dim=1)
        keep = completion.size(1)
        batch_size = self.args.per_device_train_batch_size
        old = ref = None
        with torch.no_grad():
            generate_every = self.args.steps_per_generation * self.num_iterations
            if self.args.gradient_accumulation_steps % generate_every != 0:
                old, _, _ = self._get_per_token_logps_and_entropies(
                    self.model, ids, mask, keep, batch_size=batch_size
                )
            if self.beta != 0.0:
                ref, _, _ = self._get_per_token_logps_and_entropies(
                    self.ref_model, ids, mask, keep, batch_size=batch_size
                )
        rewards_per_func = rollouts.gather_rows(rewards_local, dp_group)  # [rows x dp, F]
        advantages, is_std_zero = rollouts.advantages_of(
            rewards_per_func, self.reward_weights, self.num_generations, self.scale_rewards,
            self.multi_objective_aggregation,
        )  # fmt: skip
        rows = len(inputs)
        start = self.usp_plan.topology.dp_rank * rows
        self._usp_reward_metrics(rewards_per_func, is_std_zero, mode)
        output = {
            "prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "completion_ids": completion,
            "completion_mask": completion_mask, "advantages": advantages[start : start + rows],
            "num_items_in_batch": num_items,
        }  # fmt: skip
        if old is not None:
            output["old_per_token_logps"] = old
        if ref is not None:
            output["ref_per_token_logps"] = ref
        return output

    # ------------------------------------------------------------------ metrics
    def _usp_generation_metrics(self, prompt_ids, completion_ids) -> None:
        """TRL's token count and completion-length metrics over every replica's rows."""
        device, group = self.accelerator.device, self._usp_dp_group()
        lengths = torch.tensor([[len(p), len(c)] for p, c in zip(prompt_ids, completion_ids)],
                               device=device)  # fmt: skip
        stops = [*self.eos_token_ids, self._tokenizer.pad_token_id]
        cut = torch.tensor([bool(c) and c[-1] not in stops for c in completion_ids], device=device)
        lengths = rollouts.gather_rows(lengths, group)
        truncated = rollouts.gather_rows(cut, group)
        metrics = self._metrics["train"]
        self.state.num_input_tokens_seen += int(lengths.sum())
        metrics["num_tokens"] = [self.state.num_input_tokens_seen]
        completions = lengths[:, 1].float()
        for name, value in (("mean", completions.mean()), ("min", completions.min()),
                            ("max", completions.max())):  # fmt: skip
            metrics[f"completions/{name}_length"].append(value.item())
        metrics["completions/clipped_ratio"].append(truncated.float().mean().item())
        ended = completions[~truncated]
        ended = torch.zeros(1, device=device) if ended.numel() == 0 else ended
        for name, value in (("mean", ended.mean()), ("min", ended.min()), ("max", ended.max())):
            metrics[f"completions/{name}_terminated_length"].append(value.item())

    def _usp_reward_metrics(self, rewards_per_func, is_std_zero, mode) -> None:
        metrics = self._metrics[mode]
        for i, name in enumerate(self.reward_func_names):
            metrics[f"rewards/{name}/mean"].append(torch.nanmean(rewards_per_func[:, i]).item())
            metrics[f"rewards/{name}/std"].append(nanstd(rewards_per_func[:, i]).item())
        weights = self.reward_weights.to(rewards_per_func.device)[None]
        rewards = (rewards_per_func * weights).nansum(dim=1)
        rewards[torch.isnan(rewards_per_func).all(dim=1)] = torch.nan
        metrics["reward"].append(torch.nanmean(rewards).item())
        metrics["reward_std"].append(nanstd(rewards).item())
        metrics["frac_reward_zero_std"].append(is_std_zero.float().mean().item())
        self._usp_flush_reward_logs(mode)

    def _usp_flush_reward_logs(self, mode) -> None:
        """Metrics the reward functions logged (``log_metric``): the mean of every call
        over every rank (each rank scores its own completions); ``log_extra`` columns
        are not kept (the completions table is refused)."""
        self._pending_extra_logs.clear()
        world = dist.group.WORLD if dist.is_initialized() and dist.get_world_size() > 1 else None
        parts = rollouts.gather_objects(sorted(self._pending_metrics), world)
        for name in sorted({name for part in parts for name in part}):
            values = self._pending_metrics.get(name, [])
            stats = torch.tensor([sum(values), len(values)], dtype=torch.float64)
            if world is not None:
                dist.all_reduce(stats)
            self._metrics[mode][name].append(float(stats[0] / stats[1].clamp(min=1)))
        self._pending_metrics.clear()


def _replica_generation_batch(args, dp: int) -> None:
    """TRL's generation batch, per replica: ``per_device x dp x steps_per_generation``."""
    args.generation_batch_size = args.per_device_train_batch_size * dp * args.steps_per_generation
    if args.generation_batch_size % args.num_generations:
        raise ConfigError(
            f"the generation batch of per_device_train_batch_size({args.per_device_train_batch_size})"
            f" x dp({dp}) x steps_per_generation({args.steps_per_generation}) = "
            f"{args.generation_batch_size} rows must hold whole groups of num_generations"
            f"({args.num_generations}) completions"
        )
