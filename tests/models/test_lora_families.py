"""usp's LoRA on the 2026 families against transformers + PEFT (test_lora.py covers the
dense families and gpt-oss): Qwen3-MoE (attention adapters), Gemma 3 (every projection,
GeGLU's too, soft-capped logits), Qwen3.5 (attention, MLP and every Gated DeltaNet
projection) and Qwen3.5-MoE (attention and Gated DeltaNet projections), one process,
float64.

The reference is transformers' float64 model of each family (its float32 internals in
float64: tests/helpers/gemma3_cases.py, qwen3_5_cases.py) with PEFT's LoRA on it, the
adapters drawn by usp's documented recipe (tests/helpers/lora_cases.py). Checked: the
adapted model starts as the base model; with random B, logits, loss and every adapter's
gradient at 1e-12; only the adapters get gradients; the PEFT adapter export loaded by
``PeftModel.from_pretrained`` on transformers' model gives usp's logits. On 4 ranks
(u2 x r2, packed documents, keyed dropout): Qwen3.5 with adapters on its Gated DeltaNet
projections, 1e-10. Targets naming
the experts (and a shared expert, named like them) are refused with the targets that work.
"""

from __future__ import annotations

import gemma3_cases
import pytest
import qwen3_5_cases
import torch
from lora_cases import adapter_grads, peft_model, sp_adapter_step
from model_cases import (
    cu_of,
    global_batch,
    load_hf_reference,
    relative_error,
    sft_labels,
    write_family_checkpoint,
)
from usp_cases import topology

pytest.importorskip("transformers", minversion="5.24", reason="the reference is transformers")
pytest.importorskip("peft", reason="the reference is PEFT's LoRA")

import usp  # noqa: E402
from usp.models import Levers, Lora, LoraError, apply_lora  # noqa: E402
from usp.models.lora_export import save_peft_adapter  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")  # (tests/conftest.py)

SEED = 7
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP = ["gate_proj", "up_proj", "down_proj"]
#: every Linear of a Qwen3.5 Gated DeltaNet layer (usp's module calls each as transformers')
GDN = ["in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"]


def _qwen3_moe(directory):
    return write_family_checkpoint(directory, "qwen3_moe", seed=9), load_hf_reference


def _gemma3(directory):
    return gemma3_cases.write_checkpoint(directory, "capped", seed=9), gemma3_cases.load_reference


def _qwen3_5(directory):
    return qwen3_5_cases.write_checkpoint(directory, "biased", seed=9), qwen3_5_cases.load_reference


def _qwen3_5_moe(directory):
    # no aux term: the reference loss is transformers' cross-entropy alone
    ckpt = qwen3_5_cases.write_moe_checkpoint(directory, seed=9, output_router_logits=False)
    return ckpt, qwen3_5_cases.load_reference


#: family -> (a writer of its checkpoint, returning it and its reference loader; LoRA targets)
FAMILIES = {
    "qwen3_moe": (_qwen3_moe, ATTENTION),  # layer 0's dense MLP is named like the experts
    "gemma3": (_gemma3, ATTENTION + MLP),
    "qwen3_5": (_qwen3_5, ATTENTION + MLP + GDN),
    "qwen3_5_moe": (_qwen3_5_moe, ATTENTION + GDN),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_2026")
    return {name: write(root / name) for name, (write, _) in FAMILIES.items()}


def _randomise_b(model, reference) -> None:
    """The same random B on both (B = 0 would leave A's gradient 0)."""
    generator = torch.Generator().manual_seed(17)
    params = dict(reference.named_parameters())
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("lora_B"):
                value = 0.2 * torch.randn(p.shape, generator=generator, dtype=p.dtype)
                p.copy_(value)
                peft_name = "base_model.model." + name.replace("lora_B", "lora_B.default.weight")
                params[peft_name].copy_(value)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_float64_one_process_matches_peft_and_the_export_loads(checkpoints, family, tmp_path):
    ckpt, load = checkpoints[family]
    targets = FAMILIES[family][1]
    settings = dict(rank=4, alpha=10.0, targets=targets)
    ids = global_batch(2, 24, seed=41)
    labels = sft_labels(ids, [4])
    base = usp.models.from_pretrained(ckpt, dtype=torch.float64, backend="math")
    model = usp.models.from_pretrained(ckpt, dtype=torch.float64, backend="math")
    apply_lora(model, Lora(**settings), seed=SEED)
    reference, _ = peft_model(ckpt, **settings, seed=SEED, load=load)
    adapted = {n.rpartition(".")[0].rpartition(".")[2] for n, _ in model.named_parameters()
               if n.endswith("lora_A")}  # fmt: skip
    assert adapted == set(targets)
    with torch.no_grad():
        assert torch.equal(model(ids), base(ids)), "B = 0: the adapted model is the base"
        _randomise_b(model, reference)
        logits = model(ids)
        expected = reference(input_ids=ids, use_cache=False).logits
    assert relative_error(logits, expected) <= 1e-12
    assert relative_error(logits, base(ids).detach()) > 1e-3, "the adapters matter"

    reference.train()  # (the float64 forwards patched on its modules must survive it)
    logits = reference(input_ids=ids, use_cache=False).logits
    want = torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100
    )
    want.backward()
    want_grads = adapter_grads(reference)
    loss = model(ids, labels=labels)
    loss.backward()
    assert abs(loss.item() - want.item()) <= 1e-12 * want.item()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert grads.keys() == want_grads.keys(), "only the adapters have gradients"
    errors = {n: relative_error(grads[n], want_grads[n]) for n in grads}
    assert max(errors.values()) <= 1e-12, errors
    assert min(float(g.abs().max()) for g in grads.values()) > 0

    from peft import PeftModel

    state = {k: v.detach() for k, v in model.state_dict().items()}
    out = save_peft_adapter(tmp_path / "adapter", state, model.usp_lora, base_model=ckpt)
    loaded = PeftModel.from_pretrained(load(ckpt), out)
    with torch.no_grad():
        ours = model.eval()(ids)
        assert relative_error(loaded(input_ids=ids, use_cache=False).logits, ours) <= 1e-12


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen3_5_moe"])
def test_adapters_on_experts_are_refused_with_the_targets_that_work(checkpoints, family):
    """Every MLP projection name is refused on a mixture-of-experts model (its experts
    are grouped weights; Qwen3.5-MoE's shared expert and Qwen3-MoE's dense layer 0 are
    named like them), the router ``gate`` too; the model is left unchanged."""
    ckpt, _ = checkpoints[family]
    model = usp.models.from_pretrained(ckpt, dtype=torch.float64)
    for targets in (MLP, ["q_proj", "down_proj"], ["gate"]):
        with pytest.raises(LoraError, match=r"experts .* not supported; use targets = \["):
            apply_lora(model, Lora(targets=targets))
    assert all(p.requires_grad for p in model.parameters()), "a refused apply changes nothing"


def sp_case(checkpoint, ids, labels, cu, b_values):
    """Qwen3.5 float64 on ulysses 2 x ring 2 (zigzag), dropout 0.3, checkpointing: the
    loss on every rank and the adapters' gradients summed over the SP group."""
    plan = usp.Plan(topology(2, 2), backend="math")
    model = usp.models.from_pretrained(checkpoint, plan, dtype=torch.float64, backend="math")
    apply_lora(model, Lora(rank=4, alpha=10.0, targets=SP_TARGETS, dropout=0.3), seed=SEED)
    Levers(activation_checkpointing=True, loss_chunk_tokens=5).apply(model)
    return sp_adapter_step(model, plan, ids, labels, cu, b_values)


#: attention and Gated DeltaNet projections, one MLP projection
SP_TARGETS = ["q_proj", "o_proj", "in_proj_qkv", "in_proj_z", "in_proj_b", "out_proj", "up_proj"]


def test_qwen3_5_float64_4_ranks_match_peft_with_dropout(distributed, checkpoints):
    """Packed documents on u2 x r2 with adapters on the Gated DeltaNet layers' projections:
    every rank's tokens get the one-process dropout masks, so the loss and the adapters'
    gradients equal PEFT's on transformers' model (each document alone: its torch path
    has no documents) at 1e-10."""
    ckpt, load = checkpoints["qwen3_5"]
    cu = cu_of([12, 20])
    ids = global_batch(1, 32, seed=43)
    labels = sft_labels(ids, [3, 5], cu)
    reference, tokens = peft_model(
        ckpt, rank=4, alpha=10.0, targets=SP_TARGETS, seed=SEED, dropout=0.3, load=load
    )
    generator = torch.Generator().manual_seed(18)
    b_values = {}
    with torch.no_grad():
        for n, p in reference.named_parameters():
            if "lora_B" in n:
                p.copy_(0.2 * torch.randn(p.shape, generator=generator, dtype=p.dtype))
                name = n.removeprefix("base_model.model.").replace(".default.weight", "")
                b_values[name] = p.clone()
    reference.train()
    total, count, bounds = 0.0, int((labels != -100).sum()), cu.tolist()
    for a, b in zip(bounds, bounds[1:]):
        tokens.indices = torch.arange(640 + a, 640 + b).numpy()
        logits = reference(input_ids=ids[:, a:b], use_cache=False).logits
        part = torch.nn.functional.cross_entropy(
            logits[0], labels[0, a:b], ignore_index=-100, reduction="sum"
        ) / count  # fmt: skip
        part.backward()
        total += part.item()
    want = adapter_grads(reference)
    result = distributed.run(
        sp_case, str(ckpt), ids, labels, cu, b_values, world_size=4, timeout=240
    )[0]
    assert len(set(result["losses"])) == 1, result["losses"]
    assert abs(result["losses"][0] - total) <= 1e-10 * total
    assert result["grads"].keys() == want.keys()
    errors = {n: relative_error(result["grads"][n], want[n]) for n in want}
    assert max(errors.values()) <= 1e-10, errors
    assert any(".linear_attn.in_proj_b." in n for n in want)
