"""usp.models under sequence parallelism: the native Llama and HF transformers' Llama
with USP attention, on 4 and 8 gloo ranks, against transformers single-process in
float64 (tests/helpers/model_cases.py): logits, the loss (identical on every rank) and every
parameter's gradient summed over the SP group; dense and packed; KV replication; tied
embeddings; llama3 RoPE scaling; SFT prompts so that one rank has no labels; bf16;
every user option; bad input; SP ranks with the same tokens but different labels (one
RankDisagreementError on every rank, dense and packed).

Tolerances (float32 against HF float64, the issue's "done when"): logits 1e-4 relative,
loss 1e-5, gradients 1e-4 relative per parameter. float64 with the math backend against
the single-process native model: 1e-10 (exact up to summation order).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
from model_cases import (
    IGNORE,
    LLAMA3_ROPE,
    TINY,
    YARN_ROPE,
    cu_of,
    global_batch,
    grad_errors,
    hf_reference,
    relative_error,
    sft_labels,
    write_hf_checkpoint,
)
from usp_cases import topology

pytest.importorskip("transformers", reason="the reference is HF transformers' Llama")
pytest.importorskip("safetensors", reason="checkpoints are safetensors files")

from usp.models import (  # noqa: E402
    Levers,
    Llama,
    LlamaConfig,
    count_labels,
    shard_batch,
)
from usp.sp.plan import Plan  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")  # (tests/conftest.py)

TOL_LOGITS, TOL_LOSS, TOL_GRAD = 1e-4, 1e-5, 1e-4
#: bf16 model (bf16 weights and activations, float32 loss) against float64; measured
#: at u=4: logits 1.2e-2, loss 3.3e-5, gradients 3.2e-2
TOL_BF16 = {"logits": 3e-2, "loss": 5e-4, "grad": 8e-2}


def _summed_grads(model, plan) -> dict:
    grads = {}
    for name, param in model.named_parameters():
        grad = param.grad.detach().clone()
        dist.all_reduce(grad, group=plan.sp_group)
        grads[name] = grad
    return grads


def _run_model(model, plan, ids, labels, cu, *, pack_first=True) -> dict:
    """Forward for logits, forward+backward for the loss; gathered / summed results."""
    packed = plan.pack(cu) if cu is not None else None
    local_ids = plan.shard(ids, packed=packed)
    local_labels = plan.shard(labels, packed=packed)
    with torch.no_grad():
        logits = model(local_ids, cu_seqlens=packed)
    model.zero_grad(set_to_none=True)
    # the logits pass derived the positions itself; the loss pass is given them [B, S/P]
    positions = plan.position_ids(ids.shape[1], packed=packed).expand(ids.shape[0], -1)
    # the loss pass takes raw cu_seqlens when pack_first is False (the model packs it)
    loss = model(
        local_ids,
        labels=local_labels,
        position_ids=positions,
        cu_seqlens=packed if pack_first else cu,
    )
    loss.backward()
    losses = [None] * plan.sp_degree
    dist.all_gather_object(losses, loss.item(), group=plan.sp_group)
    global_count = count_labels(local_labels, plan.sp_group)
    assert global_count == int((labels != IGNORE).sum()), global_count
    return {
        "logits": plan.gather(logits, packed=packed).double(),
        "loss": loss.item(),
        "losses": losses,
        "local_labels": int((local_labels != IGNORE).sum()),
        "grads": {n: g.double() for n, g in _summed_grads(model, plan).items()},
    }


def native_case(ckpt, ids, labels, cu, grid, options, *, dtype="float32", compare_ac=False):
    u, r = grid
    plan = Plan(topology(u, r), **options.get("plan", {}))
    model = Llama.from_pretrained(ckpt, plan, dtype=getattr(torch, dtype))
    levers = Levers(**options.get("levers", {}))
    levers.apply(model)
    result = _run_model(model, plan, ids, labels, cu, pack_first=options.get("pack_first", True))
    if compare_ac:  # the same model with per-layer recomputation: identical gradients
        levers.replace(activation_checkpointing=not levers.activation_checkpointing).apply(model)
        again = _run_model(model, plan, ids, labels, cu)
        result["ac_grad_diff"] = max(
            (again["grads"][n] - g).abs().max().item() for n, g in result["grads"].items()
        )
    return result if dist.get_rank() == 0 else {"local_labels": result["local_labels"]}


def _check(results, expected, *, tol_logits=TOL_LOGITS, tol_loss=TOL_LOSS, tol_grad=TOL_GRAD):
    head = results[0]
    errors = {
        "logits": relative_error(head["logits"], expected["logits"]),
        "loss": abs(head["loss"] - expected["loss"]) / abs(expected["loss"]),
        "grad": max(grad_errors(head["grads"], expected["grads"]).values()),
    }
    assert len(set(head["losses"])) == 1, f"the loss differs between SP ranks: {head['losses']}"
    assert errors["logits"] <= tol_logits, errors
    assert errors["loss"] <= tol_loss, errors
    assert errors["grad"] <= tol_grad, errors
    return errors


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Two HF-written checkpoints: untied with plain RoPE, tied with llama3 scaling."""
    root = tmp_path_factory.mktemp("models")
    return {
        "plain": write_hf_checkpoint(root / "plain", seed=1),
        "tied-llama3": write_hf_checkpoint(
            root / "tied", tied=True, rope_scaling=LLAMA3_ROPE, seed=2
        ),
        "yarn": write_hf_checkpoint(root / "yarn", rope_scaling=YARN_ROPE, seed=4),
    }


def test_native_dense_kv_replication_4_ranks(distributed, checkpoints):
    """ulysses=4 > 2 KV heads (replicated); zigzag, p2p; float32 and bf16 against HF
    float64; activation checkpointing leaves the gradients unchanged."""
    ids = global_batch(2, 32, seed=3)
    labels = sft_labels(ids, [0])
    expected = hf_reference(checkpoints["plain"], ids, labels)
    results = distributed.run(
        native_case, str(checkpoints["plain"]), ids, labels, None, (4, 1), {},
        compare_ac=True, world_size=4, timeout=240,
    )  # fmt: skip
    _check(results, expected)
    assert results[0]["ac_grad_diff"] <= 1e-6, results[0]["ac_grad_diff"]
    bf16 = distributed.run(
        native_case, str(checkpoints["plain"]), ids, labels, None, (4, 1), {},
        dtype="bfloat16", world_size=4, timeout=240,
    )  # fmt: skip
    _check(bf16, expected, **{f"tol_{k}": v for k, v in TOL_BF16.items()})


def test_native_packed_sft_contiguous_allgather_4_ranks(distributed, checkpoints):
    """ulysses=2 x ring=2, contiguous layout, all-gather ring, activation checkpointing,
    loss chunks of 5 tokens, packed documents given as raw cu_seqlens, tied embeddings,
    llama3 RoPE, SFT prompts long enough that one rank has no label at all."""
    cu = cu_of([12, 4, 8, 8])  # every document a multiple of r=2 (contiguous layout)
    ids = global_batch(1, 32, seed=4)
    labels = sft_labels(ids, [11, 3, 3, 0], cu)  # rank 0: documents 0 and 1 to 6 and 2: prompt
    expected = hf_reference(checkpoints["tied-llama3"], ids, labels, cu)
    options = {
        "plan": {"layout": "contiguous", "ring_impl": "allgather"},
        "levers": {"activation_checkpointing": True, "loss_chunk_tokens": 5},
        "pack_first": False,
    }
    results = distributed.run(
        native_case, str(checkpoints["tied-llama3"]), ids, labels, cu, (2, 2), options,
        world_size=4, timeout=240,
    )  # fmt: skip
    assert min(r["local_labels"] for r in results) == 0, (
        "the case should leave a rank without labels"
    )
    _check(results, expected)


#: (activation_checkpointing, mlp_tile_tokens) run by levers_case; 16 local tokens
LEVERS = [(False, 0), (True, 0), ("offload", 0), (False, 5), (True, 5), ("offload", 5)]


def levers_case(ckpt, ids, labels, grid):
    """One model, each memory lever in turn: logits, losses and summed gradients."""
    u, r = grid
    plan = Plan(topology(u, r))
    model = Llama.from_pretrained(ckpt, plan, dtype=torch.float32)
    results = {}
    for ac, tile in LEVERS:
        Levers(activation_checkpointing=ac, mlp_tile_tokens=tile).apply(model)
        results[(ac, tile)] = _run_model(model, plan, ids, labels, None)
    return results if dist.get_rank() == 0 else None


def test_memory_levers_4_ranks(distributed, checkpoints):
    """ulysses=2 x ring=2: activation checkpointing off / on / offloaded to host memory,
    each untiled and with a tiled MLP (tiles that do not divide the 16 local tokens):
    every combination matches HF float64; offload equals on-device checkpointing
    bit for bit; tiled equals untiled within float32 rounding."""
    ids = global_batch(2, 32, seed=14)
    labels = sft_labels(ids, [3])
    expected = hf_reference(checkpoints["tied-llama3"], ids, labels)
    results = distributed.run(
        levers_case, str(checkpoints["tied-llama3"]), ids, labels, (2, 2),
        world_size=4, timeout=240,
    )[0]  # fmt: skip
    plain = results[(False, 0)]
    for key, result in results.items():
        _check([result], expected)
        grads = {n: relative_error(g, plain["grads"][n]) for n, g in result["grads"].items()}
        assert max(grads.values()) <= 1e-5, (key, grads)
        assert relative_error(result["logits"], plain["logits"]) <= 1e-5, key
    for tile in (0, 5):  # offload against on-device checkpointing: the same numbers
        on_device, offloaded = results[(True, tile)], results[("offload", tile)]
        assert offloaded["loss"] == on_device["loss"]
        assert torch.equal(offloaded["logits"], on_device["logits"])
        assert all(torch.equal(g, on_device["grads"][n]) for n, g in offloaded["grads"].items())
    assert results[("offload", 0)]["loss"] == plain["loss"]


def head_chunks_case(ckpt, ids, labels, grid, options):
    """One model with attention_head_chunks 1, then 2: logits, losses, summed gradients."""
    plan = Plan(topology(*grid))
    model = Llama.from_pretrained(ckpt, plan, dtype=torch.float32)
    results = {}
    for chunks in (1, 2):
        Levers(**options, attention_head_chunks=chunks).apply(model)
        results[chunks] = _run_model(model, plan, ids, labels, None)
    return results if dist.get_rank() == 0 else None


@pytest.mark.parametrize(
    "options", [{}, {"activation_checkpointing": "offload", "mlp_tile_tokens": 5}]
)
def test_attention_head_chunks_4_ranks(distributed, checkpoints, options):
    """ring=4 (2 KV heads per ring pass): the ring once per KV head matches HF float64
    and one pass over both heads within float32 rounding (heads are independent; the
    CPU kernel blocks its work by the head count, so the last bits may differ)."""
    ids = global_batch(2, 32, seed=15)
    labels = sft_labels(ids, [3])
    expected = hf_reference(checkpoints["tied-llama3"], ids, labels)
    results = distributed.run(
        head_chunks_case, str(checkpoints["tied-llama3"]), ids, labels, (1, 4), options,
        world_size=4, timeout=240,
    )[0]  # fmt: skip
    _check([results[2]], expected)
    one, two = results[1], results[2]
    assert abs(two["loss"] - one["loss"]) <= 1e-6 * abs(one["loss"])
    assert relative_error(two["logits"], one["logits"]) <= 1e-6
    grads = {n: relative_error(g, one["grads"][n]) for n, g in two["grads"].items()}
    assert max(grads.values()) <= 1e-6, grads


def test_yarn_checkpoint_float64_4_ranks(distributed, checkpoints):
    """A checkpoint whose config.json (written by transformers) has YaRN scaling with
    mscale attention scaling: float64 on ulysses=2 x ring=2, packed, against HF float64
    with the same rope_scaling (1e-10: exact up to summation order)."""
    cu = cu_of([24, 40])  # 64 tokens, multiples of 2r = 4; positions past the original 64
    ids = global_batch(1, 64, seed=15)
    labels = sft_labels(ids, [2, 5], cu)
    expected = hf_reference(checkpoints["yarn"], ids, labels, cu)
    options = {"plan": {"backend": "math"}, "levers": {"loss_chunk_tokens": 9}}
    results = distributed.run(
        native_case, str(checkpoints["yarn"]), ids, labels, cu, (2, 2), options,
        dtype="float64", world_size=4, timeout=240,
    )  # fmt: skip
    errors = _check(results, expected, tol_logits=1e-10, tol_loss=1e-10, tol_grad=1e-10)
    assert max(errors.values()) <= 1e-10, errors


def exactness_case(ckpt, ids, labels, cu, grid):
    """float64, math backend: SP against the same model in one process (no HF in between)."""
    u, r = grid
    # a Topology plus attention options (the model builds its Plan)
    model = Llama.from_pretrained(ckpt, topology(u, r), dtype=torch.float64, backend="math")
    Levers(loss_chunk_tokens=None).apply(model)
    plan = model.plan
    assert (plan.topology, plan.backend) == (topology(u, r), "math")
    sp = _run_model(model, plan, ids, labels, cu)
    single = Llama.from_pretrained(ckpt, None, dtype=torch.float64, backend="math")
    packed = None if cu is None else single.plan.pack(cu)
    with torch.no_grad():
        logits = single(ids, cu_seqlens=packed)
    loss = single(ids, labels=labels, cu_seqlens=packed)
    loss.backward()
    params = dict(single.named_parameters())
    return {
        "logits": relative_error(sp["logits"], logits),
        "loss": abs(sp["loss"] - loss.item()),
        "grad": max(relative_error(g, params[n].grad) for n, g in sp["grads"].items()),
    }


def test_native_float64_exact_ring_only_4_ranks(distributed, checkpoints):
    """ring=4 alone (zigzag), packed: float64 SP equals the single-process model."""
    cu = cu_of([8, 16, 8])  # zigzag at ring 4 cuts every document into 8 chunks
    ids = global_batch(1, 32, seed=5)
    labels = sft_labels(ids, [1, 2, 0], cu)
    errors = distributed.run(
        exactness_case, str(checkpoints["plain"]), ids, labels, cu, (1, 4),
        world_size=4, timeout=240,
    )[0]  # fmt: skip
    assert max(errors.values()) <= 1e-10, errors


def test_native_packed_8_ranks(distributed, checkpoints):
    """8 ranks, ulysses=4 x ring=2, zigzag, packed, tied + llama3, SFT prompts."""
    cu = cu_of([4, 20, 8, 32])  # documents in multiples of 2r = 4; S/r splits over u = 4
    ids = global_batch(1, 64, seed=6)
    labels = sft_labels(ids, [2, 9, 0, 4], cu)
    expected = hf_reference(checkpoints["tied-llama3"], ids, labels, cu)
    results = distributed.run(
        native_case, str(checkpoints["tied-llama3"]), ids, labels, cu, (4, 2), {},
        world_size=8, timeout=300,
    )  # fmt: skip
    _check(results, expected)


# ------------------------------------------------------------------ HF transformers path
def hf_case(ckpt, ids, labels, cu, grid, options, *, use_chunked_loss=False):
    import transformers

    import usp.models.hf as usp_hf

    u, r = grid
    # register builds its own plan from the topology and options; the test shards with
    # an equal one (a layout mismatch between the two would give wrong results)
    name = usp_hf.register(
        topology(u, r), name=f"usp-test-u{u}r{r}-{'-'.join(options.values())}", **options
    )
    plan = Plan(topology(u, r), **options)
    model = transformers.LlamaForCausalLM.from_pretrained(
        ckpt, dtype=torch.float32, attn_implementation=name
    )
    # the test's labels are already shifted on the global sequence: shard them like the tokens
    batch = shard_batch(plan, ids, cu_seqlens=cu, with_labels=False)
    batch = dataclasses.replace(batch, labels=plan.shard(labels, packed=batch.packed))
    with torch.no_grad():
        logits = model(**batch.hf_kwargs()).logits
    if use_chunked_loss:
        loss = usp_hf.causal_lm_loss(model, batch, plan, chunk_tokens=3)
    else:
        loss = usp_hf.sp_loss(model(**batch.hf_kwargs()).logits, batch.labels, plan)
    loss.backward()
    losses = [None] * plan.sp_degree
    dist.all_gather_object(losses, loss.item(), group=plan.sp_group)
    grads = _summed_grads(model, plan)
    full_logits = plan.gather(logits, packed=batch.packed)  # collective: on every rank
    if dist.get_rank() != 0:
        return None
    return {
        "logits": full_logits.double(),
        "loss": loss.item(),
        "losses": losses,
        "grads": {n: g.double() for n, g in grads.items()},
    }


def test_hf_llama_dense_and_packed_4_ranks(distributed, checkpoints):
    """transformers' LlamaForCausalLM with USP attention, ulysses=2 x ring=2: dense
    (sp_loss on its logits) and packed with tied embeddings and llama3 RoPE (the chunked
    causal_lm_loss)."""
    ids = global_batch(2, 32, seed=7)
    labels = sft_labels(ids, [6])
    expected = hf_reference(checkpoints["plain"], ids, labels)
    results = distributed.run(
        hf_case, str(checkpoints["plain"]), ids, labels, None, (2, 2), {},
        world_size=4, timeout=240,
    )  # fmt: skip
    _check(results, expected)

    cu = cu_of([8, 16, 8])
    ids = global_batch(1, 32, seed=8)
    labels = sft_labels(ids, [3, 5, 0], cu)
    expected = hf_reference(checkpoints["tied-llama3"], ids, labels, cu)
    results = distributed.run(
        hf_case, str(checkpoints["tied-llama3"]), ids, labels, cu, (2, 2),
        {"layout": "contiguous", "ring_impl": "allgather"}, use_chunked_loss=True,
        world_size=4, timeout=240,
    )  # fmt: skip
    _check(results, expected)


def test_hf_llama_8_ranks_ulysses_8(distributed, checkpoints):
    """8 ranks all Ulysses: 8 query heads, 2 KV heads replicated 4 times."""
    ids = global_batch(1, 64, seed=9)
    labels = sft_labels(ids, [10])
    expected = hf_reference(checkpoints["plain"], ids, labels)
    results = distributed.run(
        hf_case, str(checkpoints["plain"]), ids, labels, None, (8, 1), {},
        world_size=8, timeout=300,
    )  # fmt: skip
    _check(results, expected)


# ------------------------------------------------------------------ bad input
def bad_input_case(ckpt):
    """Every error a user can trigger on an SP rank (returns the messages), then a batch
    without any label: the loss and every gradient are 0 and backward does not hang."""
    messages = {}
    plan = Plan(topology(1, 4))
    six_heads = LlamaConfig(**TINY).replace(num_attention_heads=6)
    try:
        Llama(six_heads, Plan(topology(4, 1)))
    except ValueError as err:
        messages["heads"] = str(err)
    model = Llama.from_pretrained(ckpt, plan)
    try:
        model(torch.zeros(1, 3, dtype=torch.long))  # 12 tokens; zigzag at ring 4 needs 8k
    except ValueError as err:
        messages["length"] = str(err)
    try:
        model(torch.zeros(1, 4, dtype=torch.long), labels=torch.zeros(1, 3, dtype=torch.long))
    except ValueError as err:
        messages["labels"] = str(err)
    ids = torch.zeros(1, 8, dtype=torch.long)  # 32 global tokens
    loss = model(ids, labels=torch.full_like(ids, IGNORE))
    loss.backward()  # attention's backward collectives run on every rank
    messages["no labels"] = (
        loss.item(),
        max(p.grad.abs().max().item() for p in model.parameters()),
    )
    return messages


def test_bad_input_on_sp_ranks(distributed, checkpoints):
    messages = distributed.run(
        bad_input_case, str(checkpoints["plain"]), world_size=4, timeout=120
    )[0]
    assert "8 query heads" not in messages["heads"]
    assert "6 query heads / 2 KV heads" in messages["heads"]
    assert (
        "valid (ulysses, ring) pairs for sp_size=4 with 6 heads / 2 KV heads" in messages["heads"]
    )
    assert "(1, 4), (2, 2)" in messages["heads"]
    assert "multiple of 8" in messages["length"] and "12" in messages["length"]
    assert "labels shape (1, 3) differs from input_ids shape (1, 4)" in messages["labels"]
    assert messages["no labels"] == (0.0, 0.0)


def different_labels_case(packed: bool):
    """Every SP rank holds the same tokens; rank 1's labels differ in one position (a
    prompt token masked). Returns (the error, the fingerprint a valid call agrees on afterwards)."""
    from datetime import timedelta

    topo = topology(1, 2)
    plan = Plan(topo)
    topo.sp_group.set_timeout(timedelta(seconds=20))  # a missed agreement fails fast
    try:
        ids = global_batch(1, 16, seed=3)
        labels = ids.clone()
        if dist.get_rank() == 1:
            labels[0, 5] = IGNORE
        cu = cu_of([12, 4]) if packed else None
        try:
            shard_batch(plan, ids, labels=labels, cu_seqlens=cu)
            error = "no error"
        except Exception as err:  # noqa: BLE001 - the test compares type and text
            error = f"{type(err).__name__}: {err}"
        agreed = shard_batch(plan, ids, labels=ids, cu_seqlens=cu)  # the group still works
        dist.barrier(group=topo.sp_group)
    finally:
        topo.sp_group.set_timeout(timedelta(seconds=600))  # the harness's
    return error, agreed.fingerprint


@pytest.mark.parametrize("packed", [False, True], ids=["dense", "packed"])
def test_sp_ranks_with_the_same_tokens_but_different_labels_fail_every_rank(distributed, packed):
    """The batch fingerprint the SP ranks agree on covers the labels: ranks holding the
    same tokens with different labels raise one RankDisagreementError on every rank
    (dense: shard_batch's own agreement; packed: Plan.pack's)."""
    results = distributed.run(different_labels_case, packed, world_size=2, timeout=60)
    errors = {error for error, _ in results}
    assert len(errors) == 1, errors
    error = errors.pop()
    assert error.startswith("RankDisagreementError: "), error
    assert "the global batch they shard" in error, error
    fingerprints = [fingerprint for _, fingerprint in results]
    assert fingerprints[0] is not None and fingerprints[0] == fingerprints[1]
