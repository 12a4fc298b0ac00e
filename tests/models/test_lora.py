"""usp's LoRA (usp.models.lora) against transformers + PEFT, in one process and on 4 gloo
ranks, and its export.

The reference (tests/helpers/lora_cases.py) is transformers' float64 model of each
family's checkpoint with ``peft.get_peft_model(LoraConfig(...))`` on it, its adapters
drawn by the recipe usp documents and, with dropout, PEFT's dropout replaced by the
documented keyed mask (numpy's uint64 arithmetic, not usp's code). Checked: the adapted
model starts as the base model (bit for bit); float64 logits, loss and every adapter's
gradient at 1e-12 in one process for every family, with dropout and with every lever
(checkpointing offload, the tiled MLP); the same on ulysses 2 x ring 2 (packed
documents, 1e-10); the base gets no gradient; the keyed mask against the formula, its
drop rate, its independence of the sharding; the PEFT adapter export loaded by
``PeftModel.from_pretrained`` and the merged weights give usp's logits; bad settings.
"""

from __future__ import annotations

import pytest
import torch
from lora_cases import KeyedDropout, adapter_grads, keep, peft_model, salt, sp_adapter_step
from model_cases import (
    FAMILY_CASES,
    cu_of,
    global_batch,
    relative_error,
    sft_labels,
    write_family_checkpoint,
)
from usp_cases import topology

pytest.importorskip("transformers", reason="the reference is HF transformers")
pytest.importorskip("peft", reason="the reference is PEFT's LoRA")
pytest.importorskip("safetensors", reason="checkpoints are safetensors files")

import usp  # noqa: E402
from usp.models import Levers, Lora, LoraError, apply_lora  # noqa: E402
from usp.models.lora import initial_adapters, set_stream_position  # noqa: E402
from usp.models.lora_dropout import keep_mask, module_salt  # noqa: E402
from usp.models.lora_export import merged_state, save_peft_adapter  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")  # (tests/conftest.py)

# MoE families: targets on their experts are refused (tests/models/test_moe.py)
NAMES = [name for name in FAMILY_CASES if not name.endswith("_moe")]
SEED = 5
LORA = dict(rank=4, alpha=12.0, targets=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])  # fmt: skip


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_families")
    return {name: write_family_checkpoint(root / name, name, seed=9) for name in NAMES}


#: a subset of the projections (the default is all seven)
SOME = dict(LORA, targets=["q_proj", "v_proj", "o_proj", "up_proj", "down_proj"])
#: mixture-of-experts families take adapters on the attention projections only (targets
#: naming the experts are refused: test_moe.py, test_gpt_oss.py)
MOE_FAMILIES = ("qwen3_moe", "gpt_oss")
ATTENTION = dict(LORA, targets=["q_proj", "k_proj", "v_proj", "o_proj"])


def usp_lora(checkpoint, plan=None, *, dropout=0.0, levers=None, settings=LORA):
    model = usp.models.from_pretrained(checkpoint, plan, dtype=torch.float64, backend="math")
    apply_lora(model, Lora(**settings, dropout=dropout), seed=SEED)
    (levers or Levers(loss_chunk_tokens=5)).apply(model)
    return model


def randomise_b(usp_model, reference) -> None:
    """The same random B on both (B = 0 would leave A's gradient 0)."""
    generator = torch.Generator().manual_seed(17)
    params = dict(reference.named_parameters())
    with torch.no_grad():
        for name, p in usp_model.named_parameters():
            if name.endswith("lora_B"):
                value = 0.2 * torch.randn(p.shape, generator=generator, dtype=p.dtype)
                p.copy_(value)
                peft_name = "base_model.model." + name.replace("lora_B", "lora_B.default.weight")
                params[peft_name].copy_(value)


def reference_step(reference, tokens, ids, labels, start=0):
    """The reference's loss and adapter gradients, one forward over the whole rows (the
    keyed dropout sees tokens start, start + 1, ... in row-major order)."""
    tokens.indices = torch.arange(start, start + ids.numel()).numpy()
    reference.train()
    norms = [m for m in reference.modules() if type(m).__name__.endswith("RMSNorm")]
    assert all("forward" in vars(m) for m in norms), "train() dropped the float64 RMSNorm"
    logits = reference(input_ids=ids, use_cache=False).logits
    count = (labels != -100).sum()
    loss = torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100,
        reduction="sum",
    ) / count  # fmt: skip
    reference.zero_grad(set_to_none=True)
    loss.backward()
    return loss.item(), adapter_grads(reference)


@pytest.mark.parametrize("name", NAMES)
def test_float64_one_process_matches_peft(checkpoints, name):
    """Starts as the base model; then (random B) logits, loss and adapter gradients."""
    ids = global_batch(2, 24, seed=31)
    labels = sft_labels(ids, [4])
    base = usp.models.from_pretrained(checkpoints[name], dtype=torch.float64, backend="math")
    settings = ATTENTION if name in MOE_FAMILIES else LORA
    model = usp_lora(checkpoints[name], settings=settings)
    reference, tokens = peft_model(checkpoints[name], **settings, seed=SEED)
    with torch.no_grad():
        assert torch.equal(model(ids), base(ids)), "B = 0: the adapted model is the base"
        base_params = dict(base.named_parameters())
        for n, p in model.named_parameters():
            if "lora" not in n:
                assert torch.equal(p, base_params.pop(n)), n
        assert not base_params, "every base parameter is still there"
        randomise_b(model, reference)
        logits = model(ids)
        expected = reference(input_ids=ids, use_cache=False).logits
    assert relative_error(logits, expected) <= 1e-12
    want_loss, want_grads = reference_step(reference, tokens, ids, labels)
    loss = model(ids, labels=labels)
    loss.backward()
    assert abs(loss.item() - want_loss) <= 1e-12 * want_loss
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert grads.keys() == want_grads.keys(), "only the adapters have gradients"
    assert all(not p.requires_grad for n, p in model.named_parameters() if "lora" not in n)
    errors = {n: relative_error(grads[n], want_grads[n]) for n in grads}
    assert max(errors.values()) <= 1e-12, errors
    assert min(float(g.abs().max()) for g in grads.values()) > 0


@pytest.mark.parametrize("levers", [
    Levers(loss_chunk_tokens=7),
    Levers(activation_checkpointing="offload", mlp_tile_tokens=5, loss_chunk_tokens=7),
    Levers(activation_checkpointing=True, mlp_tile_tokens=24),  # a tile per row
])  # fmt: skip
def test_dropout_one_process_matches_the_keyed_reference(checkpoints, levers):
    """dropout 0.3 (masks from the stream position 1000 on) with each lever, Qwen3."""
    ids = global_batch(2, 24, seed=32)
    labels = sft_labels(ids, [3])
    model = usp_lora(checkpoints["qwen3"], dropout=0.3, levers=levers)
    reference, tokens = peft_model(checkpoints["qwen3"], **LORA, seed=SEED, dropout=0.3)
    randomise_b(model, reference)
    want_loss, want_grads = reference_step(reference, tokens, ids, labels, start=1000)
    set_stream_position(model, 1000)
    loss = model(ids, labels=labels)
    loss.backward()
    assert abs(loss.item() - want_loss) <= 1e-12 * want_loss
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert max(relative_error(grads[n], want_grads[n]) for n in want_grads) <= 1e-12
    # the dropout changed something: without it the loss differs
    set_stream_position(model, 1000)
    with torch.no_grad():
        model.eval()
        assert abs(model(ids, labels=labels).item() - want_loss) > 1e-6, "eval: no dropout"


def test_keyed_mask_is_the_formula_and_shard_independent():
    tokens = torch.tensor([0, 1, 63, 4096, 123_456_789_012, 2**40 + 5])
    for p, seed, index in [(0.3, 0, 0), (0.05, 7, 13)]:
        got = keep_mask(tokens, 37, p, module_salt(seed, index))
        assert module_salt(seed, index) == _signed(salt(seed, index))
        assert torch.equal(got, torch.from_numpy(keep(tokens.numpy(), 37, p, salt(seed, index))))
    many = torch.arange(50_000)
    mask = keep_mask(many, 64, 0.3, module_salt(3, 1))
    assert abs(1 - mask.double().mean().item() - 0.3) < 0.003, "drop rate p"
    other = keep_mask(many, 64, 0.3, module_salt(3, 2))
    assert (mask != other).double().mean() > 0.3, "another module, another mask"
    order = torch.randperm(50_000, generator=torch.Generator().manual_seed(0))
    assert torch.equal(keep_mask(many[order], 64, 0.3, module_salt(3, 1)), mask[order])


def _signed(value: int) -> int:
    return value - (1 << 64) if value >> 63 else value


def sp_case(checkpoint, ids, labels, cu, b_values):
    """float64 on ulysses 2 x ring 2 with dropout and every lever: the loss on every
    rank and the adapters' gradients summed over the SP group."""
    plan = usp.Plan(topology(2, 2), backend="math")
    levers = Levers(activation_checkpointing="offload", mlp_tile_tokens=3)  # 8 local tokens
    model = usp_lora(checkpoint, plan, dropout=0.3, levers=levers, settings=SOME)
    return sp_adapter_step(model, plan, ids, labels, cu, b_values)


def test_float64_4_ranks_match_peft_with_dropout(distributed, checkpoints):
    """Packed documents on u2 x r2 (zigzag), five of the seven projections: every rank's
    tokens get the one-process masks, so the loss and gradients are exact."""
    cu = cu_of([12, 20])
    ids = global_batch(1, 32, seed=33)
    labels = sft_labels(ids, [3, 5], cu)
    reference, tokens = peft_model(checkpoints["llama"], **SOME, seed=SEED, dropout=0.3)
    generator = torch.Generator().manual_seed(18)
    b_values = {}
    with torch.no_grad():
        for n, p in reference.named_parameters():
            if "lora_B" in n:
                p.copy_(0.2 * torch.randn(p.shape, generator=generator, dtype=p.dtype))
                b_values[n.removeprefix("base_model.model.").replace(".default.weight", "")] = (
                    p.clone()
                )
    # each document alone through HF (no packing there): its tokens' stream indices
    tokens_all, total, grads = [], 0.0, None
    reference.zero_grad(set_to_none=True)
    bounds = cu.tolist()
    count = int((labels != -100).sum())
    for a, b in zip(bounds, bounds[1:]):
        tokens.indices = torch.arange(640 + a, 640 + b).numpy()
        tokens_all.append(tokens.indices)
        logits = reference(input_ids=ids[:, a:b], use_cache=False).logits
        part = torch.nn.functional.cross_entropy(
            logits[0], labels[0, a:b], ignore_index=-100, reduction="sum"
        ) / count  # fmt: skip
        part.backward()
        total += part.item()
    grads = adapter_grads(reference)
    result = distributed.run(
        sp_case, str(checkpoints["llama"]), ids, labels, cu, b_values, world_size=4, timeout=240
    )[0]
    assert len(set(result["losses"])) == 1, result["losses"]
    assert abs(result["losses"][0] - total) <= 1e-10 * total
    assert result["grads"].keys() == grads.keys()
    assert max(relative_error(result["grads"][n], grads[n]) for n in grads) <= 1e-10


def test_export_loads_in_peft_and_merges(checkpoints, tmp_path):
    """The adapter directory on transformers' base model via PeftModel.from_pretrained,
    and the merged weights as a plain checkpoint: usp's logits (float64)."""
    from model_cases import load_hf_reference
    from peft import PeftModel

    model = usp_lora(checkpoints["qwen2"])
    reference, _ = peft_model(checkpoints["qwen2"], **LORA, seed=SEED)
    randomise_b(model, reference)
    state = {k: v.detach() for k, v in model.state_dict().items()}
    out = save_peft_adapter(
        tmp_path / "adapter", state, model.usp_lora, base_model=checkpoints["qwen2"]
    )
    loaded = PeftModel.from_pretrained(load_hf_reference(checkpoints["qwen2"]), out)
    ids = global_batch(2, 20, seed=34)
    with torch.no_grad():
        ours = model(ids)
        assert relative_error(loaded(input_ids=ids, use_cache=False).logits, ours) <= 1e-12
        plain = usp.models.from_pretrained(
            checkpoints["qwen2"], dtype=torch.float64, backend="math"
        )
        plain.load_state_dict(merged_state(state, model.usp_lora))
        assert relative_error(plain(ids), ours) <= 1e-12


def test_initial_adapters_follow_the_recipe(checkpoints):
    """A: one generator seeded with the seed, float32 kaiming_uniform(a=sqrt(5)) module
    after module; B zero; a float32 model gets float32 adapters, bf16 ones float32."""
    for dtype in (torch.float32, torch.bfloat16):
        model = usp.models.from_pretrained(checkpoints["llama"], dtype=dtype)
        apply_lora(model, Lora(rank=3), seed=11)
        values = initial_adapters(model, 11)
        reference, _ = peft_model(
            checkpoints["llama"], rank=3, alpha=32, targets=list(Lora().targets), seed=11
        )
        want = {n: p for n, p in adapter_grads_names(reference).items()}
        assert values.keys() == want.keys()
        for name, value in values.items():
            assert value.dtype == torch.float32 and model.get_parameter(name).dtype == torch.float32
            assert torch.equal(value.double(), want[name]), name
            assert torch.equal(model.get_parameter(name), value), name


def adapter_grads_names(reference) -> dict:
    from lora_cases import usp_name

    return {usp_name(n): p.detach() for n, p in reference.named_parameters() if p.requires_grad}


def test_bad_settings_are_refused(checkpoints):
    model = usp.models.from_pretrained(checkpoints["llama"])
    with pytest.raises(LoraError, match=r"targets \['lm_head'\] name no Linear .*'down_proj'"):
        apply_lora(model, Lora(targets=["q_proj", "lm_head"]))
    assert all(p.requires_grad for p in model.parameters()), "a refused apply changes nothing"
    apply_lora(model, Lora())
    with pytest.raises(LoraError, match="already has LoRA"):
        apply_lora(model, Lora())
    for bad, message in [
        (dict(rank=0), "rank must be an integer >= 1"),
        (dict(alpha=0), "alpha must be a number > 0"),
        (dict(dropout=1.0), r"dropout must be a number in \[0, 1\)"),
        (dict(targets=["q_proj", "q_proj"]), "distinct module names"),
    ]:
        with pytest.raises(LoraError, match=message):
            Lora(**bad)


def test_dropout_outside_a_model_forward_is_refused(checkpoints):
    """A layer called alone in training mode has no token positions for its masks."""
    model = usp_lora(checkpoints["llama"], dropout=0.1)
    layer = model.decoder_layers[0]
    with pytest.raises(LoraError, match="call the whole model"):
        layer.self_attn.q_proj(torch.randn(1, 5, 32, dtype=torch.float64))
    with torch.no_grad():  # no grad: no dropout, nothing to key
        layer.self_attn.q_proj(torch.randn(1, 5, 32, dtype=torch.float64))


def test_keyed_dropout_reference_scales_kept_elements():
    """The test's own reference dropout: zeros where dropped, x / (1 - p) elsewhere."""
    from lora_cases import Tokens

    tokens = Tokens()
    tokens.indices = torch.arange(6).numpy()
    module = KeyedDropout(0.5, salt(0, 0), tokens)
    x = torch.ones(6, 8, dtype=torch.float64)
    y = module(x)
    assert set(y.unique().tolist()) <= {0.0, 2.0} and 0 < int((y == 0).sum()) < 48
