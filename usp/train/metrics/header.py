"""The lines rank 0 prints when a run starts: the plan, the model, its levers, LoRA,
the data, the batch arithmetic and where a resume starts from."""

from __future__ import annotations

from usp.models import lora_of


def _lora_lines(model) -> list[str]:
    """``[train] lora``: its settings and the trainable share of the parameters."""
    lora = lora_of(model)
    if lora is None:
        return []
    total = sum(p.numel() for p in model.parameters())
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return [
        f"  lora:  {lora.describe()}; {trained / 1e6:.3f}M trainable parameters "
        f"({100 * trained / total:.2f}%), the base frozen"
    ]


def print_header(job, plan, source, dataset, model, state, newest, stream) -> None:
    params = sum(p.numel() for p in model.parameters())
    t = job.train
    dp = plan.topology.dp_degree
    accumulation = job.gradient_accumulation(dp)
    what = source.directory or f'preset "{job.model.preset}"'
    config = source.config
    lines = [
        f"usp train: {job.source or 'config'}",
        f"  plan:  {plan.describe()}",
        f"  model: {what} ({config.family}), {params / 1e6:.2f}M parameters, "
        f"{config.num_hidden_layers} layers",
        f"  levers: {t.levers.describe()}",  # what the trainer built the model with
        *_lora_lines(model),
        *(f"  data:  {line}" for line in dataset.summary(t.steps * t.global_batch)),
        f"  batch: {t.global_batch} sequences/step = dp {dp} x micro_batch {t.micro_batch} x "
        f"accumulation {accumulation}",
    ]
    lines += [f"  rope:  {change} ([model] setting)" for change in source.changes]
    if newest is not None:
        lines.append(f"  resuming from {newest} (step {state.step})")
    print("\n".join(lines), file=stream, flush=True)
