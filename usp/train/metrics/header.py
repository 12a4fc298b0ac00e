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


def packing_line(job, plan, dataset) -> str:
    """``[data] document_multiple``: the value packed with, and with ``"auto"`` that it
    follows the grid (another ring degree pads documents, so packs them, differently)."""
    m = dataset.document_multiple
    if job.data.document_multiple != "auto":
        return f"  pack:  documents padded to multiples of {m} ([data] document_multiple)"
    why = (
        f"{m} chunks a document for the {plan.layout} layout with ring {plan.ring_degree}"
        if m > 1
        else "no padding needed on this grid"
    )
    return (
        f'  pack:  documents padded to multiples of {m} ([data] document_multiple = "auto": '
        f"{why}); another grid packs differently: to compare losses across grids, give "
        "both runs the same document_multiple, a multiple of what each grid needs"
    )


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
        packing_line(job, plan, dataset),
        f"  batch: {t.global_batch} sequences/step = dp {dp} x micro_batch {t.micro_batch} x "
        f"accumulation {accumulation}",
    ]
    lines += [f"  rope:  {change} ([model] setting)" for change in source.changes]
    if newest is not None:
        lines.append(f"  resuming from {newest} (step {state.step})")
    print("\n".join(lines), file=stream, flush=True)
