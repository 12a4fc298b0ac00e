"""The mixture-of-experts block (usp.models.moe) and the Qwen3-MoE family beyond what
test_families.py checks for every family (float64 logits, loss and gradients against
transformers, with the aux loss off and on -- ``qwen3_moe-aux`` and ``gpt_oss-aux``, in
one process and on 4 gloo ranks, u2 x r2 and u1 x r4 --, the export).

Checked here: grouped experts (sorted segments, and torch's grouped GEMM in float32)
against the per-expert loop, forward and backward, with experts that get no token; the
load-balancing loss of both MoE families with their aux loss on (Qwen3-MoE; gpt-oss with
explicit layer kinds) against transformers' own ``aux_loss`` (which it takes in float32)
and against a float64 closed form of the same formula over transformers' router logits,
the router statistics' rows, the loss and every gradient with the aux term, the loss
without ``output_router_logits`` (the cross-entropy alone); dp2 x r2 on 4 gloo ranks
(each replica's row adds its own aux term, as each micro-batch does); a shared expert
against transformers' Qwen2-MoE block; transformers' layer rule (``decoder_sparse_step``,
``mlp_only_layers``); total vs active parameters; refusals (configs, checkpoints missing
an expert, LoRA on experts).
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from family_cases import AUX_COEF, CASES, OSS_LAYER_TYPES
from model_cases import (
    FAMILY_CASES,
    IGNORE,
    TINY,
    closed_form_aux,
    cu_of,
    global_batch,
    grad_errors,
    load_hf_reference,
    relative_error,
    router_float64,
    sft_labels,
    write_family_checkpoint,
)
from usp_cases import topology

transformers = pytest.importorskip("transformers", reason="the reference is HF transformers")
pytest.importorskip("safetensors", reason="checkpoints are safetensors files")

import usp  # noqa: E402
from usp.models import (  # noqa: E402
    CheckpointError,
    Lora,
    LoraError,
    ModelConfigError,
    Qwen3Moe,
    Qwen3MoeConfig,
    apply_lora,
    config_from_hf,
    model_counts,
    preset,
)
from usp.models.mlp import MLP  # noqa: E402
from usp.models.moe import (  # noqa: E402
    Experts,
    Router,
    SparseMoE,
    experts_loop,
    grouped_gemm_available,
    router_stat_rows,
    sp_router_aux_loss,
)

pytestmark = pytest.mark.usefixtures("one_thread")  # (tests/conftest.py)

MOE = {**TINY, **FAMILY_CASES["qwen3_moe"][1]}
#: the MoE cases with their aux loss on (family_cases: 3 layers; Qwen3-MoE's layer 0
#: dense, 1 and 2 sparse; gpt-oss's full, sliding, sliding with window 5) and the
#: (token, layer) rows of router statistics per token
AUX_CASES = {"qwen3_moe-aux": 2, "gpt_oss-aux": 3}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe")
    return {name: CASES[name].write(root / name) for name in AUX_CASES}


@pytest.fixture(scope="module")
def checkpoint(checkpoints):
    """The tiny Qwen3-MoE with the aux loss on."""
    return checkpoints["qwen3_moe-aux"]


# ---------------------------------------------------------------------- the experts
def _experts(num_experts=6, hidden=12, inner=8, top_k=3, dtype=torch.float64, seed=0):
    torch.manual_seed(seed)
    experts = Experts(num_experts, hidden, inner, top_k).to(dtype)
    experts.init_weights(0.3)
    return experts


def _routing(tokens, num_experts, top_k, *, skip=(), seed=1, dtype=torch.float64):
    """Random top-k routing that never picks the experts in ``skip``."""
    gen = torch.Generator().manual_seed(seed)
    scores = torch.rand(tokens, num_experts, generator=gen, dtype=torch.float64)
    scores[:, list(skip)] = -1
    weights, experts = scores.topk(top_k, dim=-1)
    return experts, weights.to(dtype)


@pytest.mark.parametrize("grouped", [False, None])
def test_grouped_experts_equal_the_loop(grouped):
    """Sorted segments (float64, and forced with grouped_gemm=False in float32) and
    torch's grouped GEMM (float32 where torch has one) against the per-expert loop:
    outputs and the gradients of input, routing weights and both grouped weights; experts
    2 and 4 get no token."""
    dtype = torch.float64 if grouped is False else torch.float32
    for dt in {dtype, torch.float32}:
        experts = _experts(dtype=dt)
        experts.grouped_gemm = grouped
        x = torch.randn(10, 12, dtype=dt, requires_grad=True)
        idx, weights = _routing(10, 6, 3, skip=(2, 4), dtype=dt)
        weights.requires_grad_(True)
        ours = experts(x, idx, weights)
        ref_params = [p.detach().clone().requires_grad_(True) for p in experts.parameters()]
        x_ref = x.detach().clone().requires_grad_(True)
        w_ref = weights.detach().clone().requires_grad_(True)
        ref = experts_loop(x_ref, idx, w_ref, *ref_params)
        probe = torch.randn_like(ref)
        (ours * probe).sum().backward()
        (ref * probe).sum().backward()
        tol = 1e-13 if dt == torch.float64 else 2e-6
        assert relative_error(ours, ref) <= tol
        assert relative_error(x.grad, x_ref.grad) <= tol
        assert relative_error(weights.grad, w_ref.grad) <= tol
        for p, r in zip(experts.parameters(), ref_params):
            assert relative_error(p.grad, r.grad) <= tol
        assert experts.gate_up_proj.grad[[2, 4]].abs().max() == 0  # untouched experts
    assert grouped_gemm_available(torch.float64, torch.device("cpu")) is False


def test_router_top_k_and_renormalisation():
    """Softmax in float32 for a bf16 input (its weights cast back to bf16); the top-k
    weights renormalised to sum to 1 only with norm_topk_prob."""
    torch.manual_seed(0)
    x = torch.randn(7, 12)
    for norm in (False, True):
        router = Router(12, 5, 2, norm)
        router.init_weights(0.5)
        probs, weights, experts = router(x)
        expected = torch.softmax(x @ router.weight.T, dim=-1)
        assert torch.allclose(probs, expected, atol=1e-7)
        top = expected.gather(1, experts)
        assert torch.equal(experts, expected.topk(2, dim=-1).indices)
        assert torch.allclose(weights, top / top.sum(-1, keepdim=True) if norm else top)
        probs16, weights16, _ = router.to(torch.bfloat16)(x.bfloat16())
        assert probs16.dtype == torch.float32 and weights16.dtype == torch.bfloat16


def test_shared_expert_equals_transformers_qwen2_moe_block():
    """A SparseMoE with a shared expert (its SwiGLU MLP and sigmoid gate) against
    transformers' Qwen2MoeSparseMoeBlock in float64 (experts by its loop, router softmax
    in float64), without top-k renormalisation (Qwen2-MoE's default): output and the
    gradients of input and every parameter; transformers' block's state dict loads
    strictly (the same names and shapes)."""
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock

    hf_config = transformers.Qwen2MoeConfig(
        hidden_size=12,
        moe_intermediate_size=8,
        shared_expert_intermediate_size=20,
        num_experts=5,
        num_experts_per_tok=2,
        norm_topk_prob=False,
    )
    hf_config._experts_implementation = "eager"  # its grouped GEMM has no float64
    torch.manual_seed(5)
    reference = Qwen2MoeSparseMoeBlock(hf_config).double()
    with torch.no_grad():
        for param in reference.parameters():
            param.normal_(0.0, 0.3)
    reference.gate.forward = router_float64.__get__(reference.gate)
    shared = MLP(Qwen3MoeConfig(**{**MOE, "hidden_size": 12}), intermediate_size=20)
    ours = SparseMoE(12, 8, 5, 2, False, shared_expert=shared).double()
    ours.load_state_dict(reference.state_dict())  # strict: the same names and shapes
    x = torch.randn(2, 7, 12, dtype=torch.float64, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_(True)
    (out, stats), expected = ours(x), reference(x_ref)
    assert stats.shape == (2 * 5 + 1,) and stats[-1].item() == 14  # [2E + 1]: 14 token rows
    assert stats[:5].sum().item() == 14 * 2  # top-2 assignments of every token
    probe = torch.randn_like(expected)
    (out * probe).sum().backward()
    (expected * probe).sum().backward()
    assert relative_error(out, expected) <= 1e-13
    assert relative_error(x.grad, x_ref.grad) <= 1e-13
    ref_grads = {n: p.grad for n, p in reference.named_parameters()}
    grads = {n: p.grad for n, p in ours.named_parameters()}
    assert max(grad_errors(grads, ref_grads).values()) <= 1e-13
    # the gate matters: the shared expert's gradient carries sigmoid(gate(x)) per token
    assert grads["shared_expert_gate.weight"].abs().max() > 0
    assert ours.shared_expert_gate.weight.shape == (1, 12)


# ---------------------------------------------------------------------- the aux loss
def _reference(ckpt, ids, labels, cu=None):
    """transformers in float64 (router softmax in float64), document by document: logits,
    CE mean + AUX_COEF * closed-form aux, every gradient; and transformers' own float32
    aux_loss of the unpacked rows."""
    model = load_hf_reference(ckpt)
    experts, top_k = model.config.num_experts, model.config.num_experts_per_tok
    bounds = [0, ids.shape[1]] if cu is None else cu.tolist()
    logits, router = [], []
    for a, b in zip(bounds, bounds[1:]):
        out = model(ids[:, a:b], use_cache=False, output_router_logits=True)
        logits.append(out.logits)
        router.extend(out.router_logits)
    logits = torch.cat(logits, dim=1)
    ce = F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=IGNORE
    )
    aux = closed_form_aux(router, experts, top_k)
    (ce + AUX_COEF * aux).backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    hf_aux = None
    if cu is None:
        with torch.no_grad():
            hf_aux = model(ids, use_cache=False, output_router_logits=True).aux_loss.item()
    return {"loss": (ce + AUX_COEF * aux).item(), "aux": aux.item(), "hf_aux": hf_aux,
            "ce": ce.item(), "grads": grads}  # fmt: skip


@pytest.mark.parametrize("name", list(AUX_CASES))
def test_aux_loss_one_process_matches_transformers(checkpoints, name):
    """Dense rows (2 x 20) and a packed row; the aux statistics over every token of the
    batch and every MoE layer. transformers' own aux_loss agrees to its float32; without
    output_router_logits the loss is the cross-entropy alone (as transformers)."""
    ckpt = checkpoints[name]
    model = usp.models.from_pretrained(ckpt, dtype=torch.float64, backend="math")
    config = model.config
    assert config.output_router_logits and config.router_aux_loss_coef == AUX_COEF
    if name == "gpt_oss-aux":  # explicit layer kinds read from config.json
        assert config.layer_types == tuple(OSS_LAYER_TYPES)
        assert [layer.self_attn.window for layer in model.decoder_layers] == [None, 5, 5]
    dense = global_batch(2, 20, seed=31)
    packed, cu = global_batch(1, 24, seed=32), cu_of([9, 15])
    for ids, labels, cu_seqlens in (
        (dense, sft_labels(dense, [3]), None),
        (packed, sft_labels(packed, [2, 4], cu), cu),
    ):
        expected = _reference(ckpt, ids, labels, cu_seqlens)
        model.zero_grad()
        stats = []
        model.hidden_states(ids, cu_seqlens=cu_seqlens, router_stats=stats)
        aux = sp_router_aux_loss(stats[0], config.num_experts)
        assert len(stats) == 1 and router_stat_rows(stats[0]) == AUX_CASES[name] * ids.numel()
        assert abs(aux.item() - expected["aux"]) <= 1e-12 * expected["aux"]
        if expected["hf_aux"] is not None:
            assert abs(aux.item() - expected["hf_aux"]) <= 1e-6 * expected["hf_aux"]
        loss = model(ids, labels=labels, cu_seqlens=cu_seqlens)
        loss.backward()
        assert abs(loss.item() - expected["loss"]) <= 1e-12 * expected["loss"]
        grads = {n: p.grad for n, p in model.named_parameters()}
        assert max(grad_errors(grads, expected["grads"]).values()) <= 1e-11
    # without output_router_logits the loss is the cross-entropy alone (as transformers)
    plain = type(model)(config.replace(output_router_logits=False), backend="math").double()
    plain.load_state_dict(model.state_dict())
    assert not plain.adds_aux_loss and model.adds_aux_loss
    ce = plain(dense, labels=sft_labels(dense, [3])).item()
    expected_ce = _reference(ckpt, dense, sft_labels(dense, [3]))["ce"]
    assert abs(ce - expected_ce) <= 1e-12 * expected_ce


def _replicas_reference(ckpt, replicas):
    """transformers in float64 on each dp replica's packed row alone: the step's loss
    sum_d (CE sum_d / the step's label count + COEF * aux_d) -- each replica's forward
    adds its own aux term, as each micro-batch does -- and every gradient."""
    model = load_hf_reference(ckpt)
    total = sum(int((labels != IGNORE).sum()) for _, labels, _ in replicas)
    loss = 0
    for ids, labels, cu in replicas:
        bounds = cu.tolist()
        logits, router = [], []
        for a, b in zip(bounds, bounds[1:]):
            out = model(ids[:, a:b], use_cache=False, output_router_logits=True)
            logits.append(out.logits)
            router.extend(out.router_logits)
        logits = torch.cat(logits, dim=1)
        ce = F.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=IGNORE,
            reduction="sum",
        )  # fmt: skip
        aux = closed_form_aux(router, MOE["num_experts"], MOE["num_experts_per_tok"])
        loss = loss + ce / total + AUX_COEF * aux
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    return {"loss": loss.item(), "grads": grads, "labels": total}


def dp_aux_case(ckpt, replicas, total_labels):
    """float64 on dp2 x r2, replica d training ``replicas[d]`` (the step's loss: the
    replicas' losses summed; the gradients summed over all 4 ranks)."""
    plan = usp.Plan(topology(1, 2), backend="math")
    model = usp.models.from_pretrained(ckpt, plan, dtype=torch.float64)
    ids, labels, cu = replicas[plan.topology.dp_rank]
    batch = usp.models.shard_batch(plan, ids, labels=labels, cu_seqlens=cu, shift=False)
    loss = model(batch.input_ids, **batch.model_kwargs(), num_items_in_batch=total_labels)
    loss.backward()
    losses = [None] * 4  # (replica, its loss) of every rank
    dist.all_gather_object(losses, (plan.topology.dp_rank, loss.item()))
    grads = {}
    for n, p in model.named_parameters():
        grads[n] = p.grad.detach().clone()
        dist.all_reduce(grads[n])  # every rank: both replicas' SP shares
    return {"losses": losses, "grads": grads} if dist.get_rank() == 0 else None


def test_data_parallel_replicas_add_their_own_aux_terms(distributed, checkpoint):
    """dp2 x r2: two replicas' packed rows (documents of multiples of 2r = 4 tokens)."""
    replicas = []
    for seed, lengths, prompts in ((34, [8, 16], [2, 3]), (35, [12, 12], [4, 1])):
        row, row_cu = global_batch(1, sum(lengths), seed=seed), cu_of(lengths)
        replicas.append((row, sft_labels(row, prompts, row_cu), row_cu))
    expected = _replicas_reference(checkpoint, replicas)
    dp = distributed.run(
        dp_aux_case, str(checkpoint), replicas, expected["labels"], world_size=4, timeout=240
    )[0]
    by_replica = {d: {loss for r, loss in dp["losses"] if r == d} for d in (0, 1)}
    assert all(len(losses) == 1 for losses in by_replica.values()), dp["losses"]
    step_loss = sum(losses.pop() for losses in by_replica.values())
    assert abs(step_loss - expected["loss"]) <= 1e-10 * expected["loss"]
    assert max(grad_errors(dp["grads"], expected["grads"]).values()) <= 1e-10


# ---------------------------------------------------------------------- the family
def test_layer_kinds_follow_transformers(tmp_path):
    """decoder_sparse_step 2 with mlp_only_layers [3] over 4 layers: only layer 1 sparse,
    as in transformers' model (the same parameter names and shapes); the export reads
    back equal and loads in transformers with equal logits."""
    ckpt = write_family_checkpoint(
        tmp_path / "step", "qwen3_moe", num_hidden_layers=4, decoder_sparse_step=2,
        mlp_only_layers=[3], norm_topk_prob=False,
    )  # fmt: skip
    model = usp.models.from_pretrained(ckpt)
    config = model.config
    assert [config.is_sparse(i) for i in range(4)] == [False, True, False, False]
    hf = load_hf_reference(ckpt, dtype=torch.float32)
    assert {n: p.shape for n, p in model.named_parameters()} == {
        n: p.shape for n, p in hf.named_parameters()
    }
    written = json.loads((ckpt / "config.json").read_text())
    assert "num_local_experts" in written  # transformers 5's name for num_experts
    assert config.num_experts == written["num_local_experts"] == 4
    assert config_from_hf(config.to_hf_dict()) == config
    ids = global_batch(2, 12, seed=34)
    with torch.no_grad():
        assert relative_error(model(ids), hf(ids, use_cache=False).logits) <= 1e-5


def test_grouped_checkpoint_layout_loads_and_missing_experts_are_refused(tmp_path, checkpoint):
    """A file with the grouped names (transformers 5's in-memory layout) loads to the same
    model; a checkpoint without one expert's tensor is refused, naming it."""
    from safetensors.torch import load_file, save_file

    model = usp.models.from_pretrained(checkpoint)
    grouped = tmp_path / "grouped"
    grouped.mkdir()
    (grouped / "config.json").write_text((checkpoint / "config.json").read_text())
    save_file({n: p.detach().contiguous() for n, p in model.named_parameters()},
              str(grouped / "model.safetensors"))  # fmt: skip
    again = usp.models.from_pretrained(grouped)
    assert all(torch.equal(p, again.get_parameter(n)) for n, p in model.named_parameters())
    tensors = load_file(str(checkpoint / "model.safetensors"))
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text((checkpoint / "config.json").read_text())
    del tensors["model.layers.2.mlp.experts.3.up_proj.weight"]
    save_file(tensors, str(broken / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"layers\.2\.mlp\.experts\.3\.up_proj\.weight"):
        usp.models.from_pretrained(broken)


def test_total_and_active_parameters():
    """The tiny config's counts from its model; Qwen3-30B-A3B: 30.5B parameters, 3.35B
    active (the published 30B / 3B)."""
    config = Qwen3MoeConfig(**{**MOE, "num_hidden_layers": 3, "mlp_only_layers": (1,)})
    model = Qwen3Moe(config)
    counts = model_counts(config)
    assert counts.total == sum(p.numel() for p in model.parameters())
    experts = [m for m in model.modules() if isinstance(m, Experts)]
    assert counts.experts == sum(p.numel() for m in experts for p in m.parameters())
    per_expert = 3 * config.hidden_size * config.moe_intermediate_size
    assert counts.routed == 2 * config.num_experts_per_tok * per_expert  # two sparse layers
    assert counts.active == counts.total - 2 * (4 - 2) * per_expert
    big = model_counts(preset("qwen3-30b-a3b"))
    assert round(big.total / 1e9, 2) == 30.53 and round(big.active / 1e9, 2) == 3.35


def test_bad_configs_are_refused():
    base = {k: v for k, v in MOE.items() if k != "mlp_only_layers"}
    for change, message in (
        ({"num_experts_per_tok": 5}, r"num_experts_per_tok\(5\) must be at most num_experts\(4\)"),
        ({"mlp_only_layers": [-1]}, r"mlp_only_layers must hold layer indices \(integers >= 0\)"),
        ({"decoder_sparse_step": 0}, "decoder_sparse_step must be an integer >= 1"),
        ({"router_aux_loss_coef": -1.0}, "router_aux_loss_coef must be a number >= 0"),
        ({"hidden_act": "gelu"}, "hidden_act='gelu' is not supported"),
    ):
        with pytest.raises(ModelConfigError, match=message):
            config_from_hf({"architectures": ["Qwen3MoeForCausalLM"], **base, **change})
    with pytest.raises(ModelConfigError, match=r"num_experts\(4\) and num_local_experts\(8\)"):
        config_from_hf({"model_type": "qwen3_moe", **base, "num_local_experts": 8})


def test_lora_on_experts_is_refused_and_attention_adapters_train():
    model = Qwen3Moe(preset("qwen3-moe-tiny"))
    with pytest.raises(LoraError, match=r"\['gate_proj', 'up_proj', 'down_proj'\].*experts"):
        apply_lora(model, Lora())
    apply_lora(model, Lora(rank=2, targets=("q_proj", "v_proj")))
    trained = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trained and all("lora_" in n and "self_attn" in n for n in trained)
