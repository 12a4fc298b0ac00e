"""The float64 checks every model family runs against transformers
(tests/models/test_families.py, over family_cases.CASES): one process, the SP run on 4
ranks, and the export read back by transformers."""

from __future__ import annotations

import torch
import torch.distributed as dist
from model_cases import global_batch, grad_errors, relative_error

import usp


def one_process_errors(model, rows, labels, cu_seqlens, expected: dict) -> dict:
    """Relative errors of ``model``'s logits, loss and each gradient against
    ``expected`` (:func:`model_cases.transformers_reference` of the same batch)."""
    with torch.no_grad():
        logits = model(rows, cu_seqlens=cu_seqlens)
    loss = model(rows, labels=labels, cu_seqlens=cu_seqlens)
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    return {
        "logits": relative_error(logits, expected["logits"]),
        "loss": abs(loss.item() - expected["loss"]) / expected["loss"],
        **grad_errors(grads, expected["grads"]),
    }


def sp_float64_run(plan, model, batches) -> list[dict]:
    """Body for every rank: ``model`` on each global ``(ids, labels, cu_seqlens or None)``
    of ``batches``: the gathered logits, the loss of every rank and the gradients summed
    over the SP group."""
    out = []
    for ids, labels, cu_seqlens in batches:
        batch = usp.models.shard_batch(plan, ids, labels=labels, cu_seqlens=cu_seqlens, shift=False)
        with torch.no_grad():
            logits = model(batch.input_ids, cu_seqlens=batch.packed)
        model.zero_grad()
        loss = model(batch.input_ids, **batch.model_kwargs())
        loss.backward()
        losses = [None] * plan.sp_degree
        dist.all_gather_object(losses, loss.item(), group=plan.sp_group)
        grads = {}
        for n, p in model.named_parameters():
            grads[n] = p.grad.detach().clone()
            dist.all_reduce(grads[n], group=plan.sp_group)
        gathered = plan.gather(logits, packed=batch.packed)
        out.append({"logits": gathered, "losses": losses, "grads": grads})
    return out


def sp_failures(index, result: dict, want: dict, tolerance: float) -> list[str]:
    """One SP result against its reference: every rank's loss equal (asserted), then
    ``"index name: error"`` for each of loss, logits and gradients above ``tolerance``."""
    assert len(set(result["losses"])) == 1, result["losses"]
    errors = {
        "loss": abs(result["losses"][0] - want["loss"]) / want["loss"],
        "logits": relative_error(result["logits"], want["logits"]),
        **grad_errors(result["grads"], want["grads"]),
    }
    return [f"{index} {n}: {e:.3g}" for n, e in errors.items() if not e <= tolerance]


def assert_export_matches_transformers(path, out_dir, load_reference):
    """usp's model of ``path``, perturbed, exported to ``out_dir``: transformers' float32
    model of the export (``load_reference(dir, dtype=)``) gives its logits (1e-5), and
    usp reads the export back bit for bit. Returns the export's directory."""
    model = usp.models.from_pretrained(path)
    with torch.no_grad():
        for p in model.parameters():  # not the checkpoint's values: the export carries them
            p.add_(0.01 * torch.randn_like(p))
    out = model.save_pretrained(out_dir)
    hf = load_reference(out, dtype=torch.float32)
    ids = global_batch(2, 16, seed=23)
    with torch.no_grad():
        ours, theirs = model(ids), hf(ids, use_cache=False).logits
    assert relative_error(ours, theirs) <= 1e-5, path
    again = usp.models.from_pretrained(out)
    assert all(torch.equal(a, b) for a, b in zip(again.state_dict().values(),
                                                 model.state_dict().values()))  # fmt: skip
    return out
