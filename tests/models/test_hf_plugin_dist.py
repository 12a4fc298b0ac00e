"""The HF attention plug-in under sequence parallelism (4 gloo ranks, ulysses=2 x
ring=2) against transformers' sdpa in one process on the same weights: HF padding-free
batches from ``DataCollatorWithFlattening`` (via ``usp.models.hf.shard_flattened``, and
as global ``cu_seq_lens_q/k`` kwargs), forward and backward; and every input that cannot
be computed exactly under SP refused with the same error on every rank, the groups
still usable afterwards.

float64 all through (math backend, float64 RMSNorm: tests/helpers/model_cases.py): logits, loss
and the SP-summed gradients within 1e-10 relative of the single-process sdpa reference.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from model_cases import load_hf_reference, relative_error, write_hf_checkpoint
from usp_cases import topology

transformers = pytest.importorskip("transformers", reason="the plug-in is for HF transformers")
pytest.importorskip("safetensors", reason="checkpoints are safetensors files")

import usp  # noqa: E402
from usp.models import shift_labels  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")  # (tests/conftest.py)

TOL = 1e-10
LENGTHS = (7, 12, 3, 10)  # none a multiple of 2r = 4: shard_flattened must pad them


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_hf_checkpoint(tmp_path_factory.mktemp("hf_plugin_dist") / "tiny", seed=11)


def collated(flash_kwargs: bool):
    gen = torch.Generator().manual_seed(12)
    features = [{"input_ids": torch.randint(0, 64, (n,), generator=gen).tolist()} for n in LENGTHS]
    collator = transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=flash_kwargs)
    return collator(features, return_tensors="pt")


def sdpa_reference(ckpt, batch) -> dict:
    """One process, sdpa on the unpadded collator batch: logits, the float64 mean loss
    over the collator's labels (shifted per document), every gradient."""
    model = load_hf_reference(ckpt)
    logits = model(batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits
    cu = batch.get("cu_seq_lens_q")
    if cu is None:
        starts = (torch.diff(batch["position_ids"][0]) != 1).nonzero().flatten() + 1
        cu = torch.tensor([0, *starts.tolist(), logits.shape[1]], dtype=torch.int32)
    labels = shift_labels(batch["labels"], cu_seqlens=cu)
    loss = F.cross_entropy(logits[0], labels[0])
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    return {"logits": logits.detach(), "loss": loss.item(), "grads": grads}


def _sp_results(model, plan, logits, loss, packed, padding):
    loss.backward()
    losses = [None] * plan.sp_degree
    dist.all_gather_object(losses, loss.item(), group=plan.sp_group)
    grads = {}
    for name, param in model.named_parameters():
        grad = param.grad.detach().clone()
        dist.all_reduce(grad, group=plan.sp_group)
        grads[name] = grad
    full = plan.gather(logits.detach(), packed=packed)  # [1, padded S, V], every rank
    real = full.index_select(1, padding.destinations)  # the collator's tokens, unpadded
    return {"logits": real, "losses": losses, "grads": grads}


def run_flattened(ckpt, batch, how: str):
    """``how``: "shard_flattened" (usp_packed) or "cu_kwargs" (the global boundaries as
    HF's cu_seq_lens_q/k keywords, this rank's shard of everything else)."""
    import usp.models.hf as usp_hf

    plan = usp.Plan(topology(2, 2), backend="math")
    name = usp_hf.register(plan, name=f"usp-dist-flat-{how}")
    model = load_hf_reference(ckpt, attn_implementation=name)
    sharded = usp_hf.shard_flattened(plan, batch, pad_token_id=3)
    cu = batch.get("cu_seq_lens_q")
    if cu is None:
        starts = (torch.diff(batch["position_ids"][0]) != 1).nonzero().flatten() + 1
        cu = torch.tensor([0, *starts.tolist(), batch["input_ids"].shape[1]], dtype=torch.int32)
    padding = usp.pad_documents(cu, plan)
    kwargs = sharded.hf_kwargs()
    if how == "cu_kwargs":
        global_cu = padding.cu_seqlens
        kwargs.pop("usp_packed")
        kwargs.update(cu_seq_lens_q=global_cu, cu_seq_lens_k=global_cu.clone())
    logits = model(**kwargs).logits  # [1, S/P, V]
    loss = usp_hf.sp_loss(logits, sharded.labels, plan)
    results = _sp_results(model, plan, logits, loss, sharded.packed, padding)
    # .real marks exactly the collator's tokens (not the pads placing the documents)
    real = plan.gather(sharded.real[..., None].double(), packed=sharded.packed)[0, :, 0]
    assert torch.equal(real.nonzero().flatten(), padding.destinations)
    assert padding.padded_len > padding.destinations.numel()  # there are pads
    return results


def _check(results, expected):
    for rank_result in results:
        assert len(set(rank_result["losses"])) == 1, rank_result["losses"]
        assert abs(rank_result["losses"][0] - expected["loss"]) <= TOL * expected["loss"]
    head = results[0]
    assert relative_error(head["logits"], expected["logits"]) <= TOL
    errors = {n: relative_error(head["grads"][n], g) for n, g in expected["grads"].items()}
    assert max(errors.values()) <= TOL, errors


@pytest.mark.parametrize("flash_kwargs", [False, True])
def test_data_collator_with_flattening_on_4_ranks(distributed, ckpt, flash_kwargs):
    batch = collated(flash_kwargs)
    expected = sdpa_reference(ckpt, batch)
    results = distributed.run(
        run_flattened, str(ckpt), batch, "shard_flattened", world_size=4, timeout=240
    )
    _check(results, expected)


def test_global_cu_seq_lens_kwargs_on_4_ranks(distributed, ckpt):
    batch = collated(True)
    expected = sdpa_reference(ckpt, batch)
    results = distributed.run(
        run_flattened, str(ckpt), batch, "cu_kwargs", world_size=4, timeout=240
    )
    _check(results, expected)


# ------------------------------------------------------------------ refusals under SP
def run_refusals(ckpt):
    """Each bad call on every rank; returns (error class, message) per case, then the
    max difference of a good call after them against the same call before them."""
    import usp.models.hf as usp_hf

    plan = usp.Plan(topology(2, 2), backend="math")
    name = usp_hf.register(plan, name="usp-dist-refusals")
    model = load_hf_reference(ckpt, attn_implementation=name)
    gen = torch.Generator().manual_seed(13)
    ids = torch.randint(0, 64, (1, 32), generator=gen)
    good = usp.models.shard_batch(plan, ids, with_labels=False).hf_kwargs()
    with torch.no_grad():
        before = model(**good).logits
    local = good["input_ids"]
    mask = torch.ones_like(ids)
    mask[:, 28:] = 0  # right padding of the global sequence: zeros on the ranks holding them
    restart = torch.tensor([[*range(16), *range(16)]])  # two documents, told by positions only
    cases = {
        "positions only": dict(input_ids=local, position_ids=plan.shard(restart)),
        "HF's own positions": dict(input_ids=local),
        "padding mask": dict(
            input_ids=local, position_ids=good["position_ids"], attention_mask=plan.shard(mask)
        ),
    }
    outcomes = {}
    for what, kwargs in cases.items():
        try:
            model(**kwargs, use_cache=False)
            outcomes[what] = None
        except usp.UspError as err:
            outcomes[what] = (type(err).__name__, str(err))
    with torch.no_grad():
        ones = torch.ones_like(good["input_ids"])
        after = model(**good, attention_mask=ones).logits  # an all-ones mask is fine
    outcomes["after"] = (after - before).abs().max().item()
    return outcomes


def test_inputs_that_cannot_be_exact_under_sp_fail_every_rank_alike(distributed, ckpt):
    results = distributed.run(run_refusals, str(ckpt), world_size=4, timeout=240)
    for what, needle in [
        ("positions only", "GLOBAL boundaries"),
        ("HF's own positions", "are not the positions of its tokens in the dense sequence"),
        ("padding mask", "under sequence parallelism"),
    ]:
        outcomes = [r[what] for r in results]
        assert all(o is not None and o[0] == "HFInputError" for o in outcomes), (what, outcomes)
        assert needle in outcomes[0][1], (what, outcomes[0][1])
        # the same message on every rank (it names the failing ranks)
        assert len({o[1] for o in outcomes}) == 1, (what, outcomes)
    assert all(r["after"] == 0.0 for r in results)
