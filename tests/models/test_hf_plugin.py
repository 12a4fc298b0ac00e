"""The HF attention plug-in in one process against transformers' own sdpa on the same
weights: our equivalents of transformers' modeling checks (its test files are not
installed). Padding left and right, HF padding-free packing both ways (position_ids that
restart, cu_seq_lens kwargs) and through ``DataCollatorWithFlattening``, ``is_causal``
from the config and the module, generation without a cache, torch.compile; every input
the plug-in cannot compute exactly is refused with a message that names it.

Models are float64 (SDPA and a float64 RMSNorm, tests/helpers/model_cases.py), so "equal" means
relative error <= 1e-12 (only summation order differs).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from model_cases import (
    IGNORE,
    TINY,
    global_batch,
    load_hf_reference,
    relative_error,
    write_hf_checkpoint,
)

transformers = pytest.importorskip("transformers", reason="the plug-in is for HF transformers")
pytest.importorskip("safetensors", reason="checkpoints are safetensors files")

import usp  # noqa: E402
import usp.models.hf as usp_hf  # noqa: E402
from usp.models.hf_inputs import HFInputError  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")  # (tests/conftest.py)

TOL = 1e-12
LAYERS = 2  # model_cases.TINY


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_hf_checkpoint(tmp_path_factory.mktemp("hf_plugin") / "tiny", seed=5)


class Counting:
    """A Plan(None) whose attention and pack calls are counted (proof usp really ran)."""

    def __init__(self, name: str, **options):
        self.plan = usp.Plan(None, **options)
        self.attention_calls = self.pack_calls = 0
        attention, pack = self.plan.attention, self.plan.pack

        def counted_attention(*args, **kwargs):
            self.attention_calls += 1
            return attention(*args, **kwargs)

        def counted_pack(*args, **kwargs):
            self.pack_calls += 1
            return pack(*args, **kwargs)

        self.plan.attention, self.plan.pack = counted_attention, counted_pack
        self.name = usp_hf.register(self.plan, name=name)


def models(ckpt, name):
    """(sdpa model, usp model) with the same float64 weights."""
    return load_hf_reference(ckpt), load_hf_reference(ckpt, attn_implementation=name)


def forward_backward(model, **inputs):
    """Logits and every parameter's gradient of the sum of the logits' squares on the
    positions ``keep`` (default all)."""
    keep = inputs.pop("keep", None)
    model.zero_grad()
    logits = model(**inputs, use_cache=False).logits
    chosen = logits if keep is None else logits[keep]
    (chosen.square().sum()).backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    return chosen.detach(), grads


def assert_same(actual, expected):
    (a_logits, a_grads), (e_logits, e_grads) = actual, expected
    assert relative_error(a_logits, e_logits) <= TOL
    errors = {n: relative_error(a_grads[n], e_grads[n]) for n in e_grads}
    assert max(errors.values()) <= TOL, errors


# ------------------------------------------------------------------ dense and padding
def test_dense_batch_equals_sdpa_and_really_runs_usp(ckpt):
    spy = Counting("usp-plugin-dense")
    sdpa, model = models(ckpt, spy.name)
    ids = global_batch(3, 17, seed=1)
    assert_same(forward_backward(model, input_ids=ids), forward_backward(sdpa, input_ids=ids))
    assert spy.attention_calls == LAYERS and spy.pack_calls == 0


def test_all_ones_mask_and_right_padding_equal_sdpa_on_real_tokens(ckpt):
    spy = Counting("usp-plugin-right")
    sdpa, model = models(ckpt, spy.name)
    ids = global_batch(3, 12, seed=2)
    ones = torch.ones_like(ids)
    assert_same(
        forward_backward(model, input_ids=ids, attention_mask=ones),
        forward_backward(sdpa, input_ids=ids, attention_mask=ones),
    )
    mask = ones.clone()
    mask[1, 7:] = 0  # right padding: rows of 12, 7 and 12 real tokens
    mask[2, 11:] = 0
    real = mask.bool()
    assert_same(
        forward_backward(model, input_ids=ids, attention_mask=mask, keep=real),
        forward_backward(sdpa, input_ids=ids, attention_mask=mask, keep=real),
    )
    assert spy.attention_calls == 2 * LAYERS  # two forwards


@pytest.mark.parametrize("where", ["left", "hole"])
def test_padding_before_real_tokens_is_refused_in_forward_and_generate(ckpt, where):
    spy = Counting(f"usp-plugin-{where}")
    _, model = models(ckpt, spy.name)
    ids = global_batch(2, 10, seed=3)
    mask = torch.ones_like(ids)
    if where == "left":
        mask[1, :4] = 0
    else:
        mask[1, 5] = 0
    with pytest.raises(HFInputError, match="padding before real tokens \\(row 1") as err:
        model(ids, attention_mask=mask, use_cache=False)
    assert "usp_packed=plan.pack(cu)" in str(err.value) and "DataCollatorWithFlattening" in str(
        err.value
    )
    with pytest.raises(HFInputError, match="padding before real tokens"):
        model.generate(ids, attention_mask=mask, use_cache=False, max_new_tokens=2, do_sample=False)
    assert spy.attention_calls == 0  # refused before any layer ran


def test_generate_without_cache_equals_sdpa(ckpt):
    spy = Counting("usp-plugin-generate")
    sdpa, model = models(ckpt, spy.name)
    ids = global_batch(2, 9, seed=4)
    options = dict(use_cache=False, max_new_tokens=4, do_sample=False, pad_token_id=0)
    expected = sdpa.generate(ids, attention_mask=torch.ones_like(ids), **options)
    got = model.generate(ids, attention_mask=torch.ones_like(ids), **options)
    assert torch.equal(got, expected) and got.shape == (2, 13)
    assert spy.attention_calls == 4 * LAYERS


# ------------------------------------------------------------------ is_causal
def test_config_and_module_is_causal_false_equal_sdpa(ckpt):
    spy = Counting("usp-plugin-bidirectional")
    sdpa, model = models(ckpt, spy.name)
    ids = global_batch(2, 11, seed=5)
    causal = forward_backward(model, input_ids=ids)
    for m in (sdpa, model):
        m.config.is_causal = False
    bidirectional = forward_backward(model, input_ids=ids)
    assert_same(bidirectional, forward_backward(sdpa, input_ids=ids))
    assert relative_error(bidirectional[0], causal[0]) > 1e-3  # really not causal
    # padding in a bidirectional model would be attended to: refused
    mask = torch.ones_like(ids)
    mask[0, 9:] = 0
    with pytest.raises(HFInputError, match="bidirectional model \\(is_causal=False\\)"):
        model(ids, attention_mask=mask, use_cache=False)
    # the module's flag alone, in a model whose config is causal: the model builds a
    # causal mask, and the mask wins, as in eager attention (sdpa skips an all-ones causal
    # mask and then follows the module: transformers' two paths disagree): causal, never
    # bidirectional; right padding then is exact on the real tokens, as for causal layers
    sdpa, model = models(ckpt, spy.name)
    for module in model.modules():
        if type(module).__name__ == "LlamaAttention":
            module.is_causal = False  # what an encoder's attention module says
    assert_same(forward_backward(model, input_ids=ids), forward_backward(sdpa, input_ids=ids))
    real = (slice(None, 1), slice(None, 9))  # row 0's real tokens
    padded = dict(input_ids=ids, attention_mask=mask, keep=real)
    assert_same(forward_backward(model, **padded), forward_backward(sdpa, **padded))
    # the keyword of model(...)
    sdpa, model = models(ckpt, spy.name)
    assert_same(forward_backward(model, input_ids=ids, is_causal=False), bidirectional)
    assert spy.attention_calls == 5 * LAYERS  # the refused batch never reached a layer


# ------------------------------------------------------------------ padding-free packing
LENGTHS = (5, 3, 6, 2)


def flattened(lengths=LENGTHS, *, seed=6, flash_kwargs=True):
    """What DataCollatorWithFlattening makes of documents of these lengths."""
    ids = global_batch(1, sum(lengths), seed=seed)[0].tolist()
    features, start = [], 0
    for n in lengths:
        features.append({"input_ids": ids[start : start + n]})
        start += n
    collator = transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=flash_kwargs)
    return collator(features, return_tensors="pt")


def test_restarting_position_ids_are_packed_documents(ckpt):
    spy = Counting("usp-plugin-positions")
    sdpa, model = models(ckpt, spy.name)
    batch = flattened(flash_kwargs=False)
    inputs = {"input_ids": batch["input_ids"], "position_ids": batch["position_ids"]}
    got = forward_backward(model, **inputs)
    assert_same(got, forward_backward(sdpa, **inputs))
    assert spy.pack_calls == 1  # one PackedSequence for both layers (and the backward)
    # each document equals the same document alone
    start = 0
    for n in LENGTHS:
        alone = model(batch["input_ids"][:, start : start + n], use_cache=False).logits
        assert relative_error(got[0][:, start : start + n], alone) <= TOL
        start += n
    # a batch whose rows start at other positions but count up by one is dense
    shifted = torch.arange(7, 7 + 14).unsqueeze(0)
    assert_same(
        forward_backward(model, input_ids=batch["input_ids"][:, :14], position_ids=shifted),
        forward_backward(sdpa, input_ids=batch["input_ids"][:, :14], position_ids=shifted),
    )


def test_cu_seq_lens_kwargs_are_packed_documents(ckpt):
    spy = Counting("usp-plugin-cu")
    sdpa, model = models(ckpt, spy.name)
    batch = flattened()
    cu = batch["cu_seq_lens_q"]
    assert cu.tolist() == [0, 5, 8, 14, 16] and batch["max_length_q"] == 6
    expected = forward_backward(
        sdpa, input_ids=batch["input_ids"], position_ids=batch["position_ids"]
    )
    assert_same(
        forward_backward(model, **{k: v for k, v in batch.items() if k != "labels"}), expected
    )
    # the kwargs alone: HF numbers the positions 0..S-1. RoPE is relative, so attention is
    # the same up to rounding of HF's float32 cos/sin tables at other absolute positions
    only_cu = {k: batch[k] for k in ("input_ids", "cu_seq_lens_q", "cu_seq_lens_k")}
    logits, _ = forward_backward(model, **only_cu)
    assert relative_error(logits, expected[0]) <= 1e-6
    assert spy.pack_calls == 2


@pytest.mark.parametrize("flash_kwargs", [False, True])
def test_data_collator_with_flattening_trains_like_sdpa(ckpt, flash_kwargs):
    """model(**collator(features)) with HF's own labels= loss: the loss and every
    gradient equal sdpa's; shard_flattened + sp_loss give the same loss."""
    spy = Counting(f"usp-plugin-collator-{flash_kwargs}")
    sdpa, model = models(ckpt, spy.name)
    batch = flattened(flash_kwargs=flash_kwargs)
    results = []
    for m in (sdpa, model):
        m.zero_grad()
        loss = m(**batch, use_cache=False).loss
        loss.backward()
        results.append((loss.item(), {n: p.grad.clone() for n, p in m.named_parameters()}))
    (expected, expected_grads), (got, grads) = results
    assert abs(got - expected) <= TOL * abs(expected)
    assert max(relative_error(grads[n], expected_grads[n]) for n in grads) <= TOL
    # HF's loss runs in float32; usp's in the logits' dtype: compare with float64 here
    labels = usp.models.shift_labels(batch["labels"], cu_seqlens=_cu(batch))
    reference = F.cross_entropy(sdpa(**inputs_of(batch), use_cache=False).logits[0], labels[0])
    sharded = usp_hf.shard_flattened(spy.plan, batch)
    assert torch.equal(sharded.input_ids, batch["input_ids"])
    assert torch.equal(sharded.labels, labels)
    assert sharded.real.shape == labels.shape and bool(sharded.real.all())  # no pads here
    logits = model(**sharded.hf_kwargs()).logits
    loss = usp_hf.sp_loss(logits, sharded.labels, spy.plan)
    assert abs(loss.item() - reference.item()) <= TOL * reference.item()


def _cu(batch):
    starts = (torch.diff(batch["position_ids"][0]) != 1).nonzero().flatten() + 1
    return torch.tensor([0, *starts.tolist(), batch["input_ids"].shape[1]], dtype=torch.int32)


def inputs_of(batch):
    return {"input_ids": batch["input_ids"], "position_ids": batch["position_ids"]}


def test_packing_refusals_name_the_input(ckpt):
    spy = Counting("usp-plugin-refusals")
    _, model = models(ckpt, spy.name)
    batch = flattened()
    ids, pos, cu = batch["input_ids"], batch["position_ids"], batch["cu_seq_lens_q"]
    two_rows = torch.cat([ids, ids])
    cases = [
        (dict(input_ids=two_rows, position_ids=torch.cat([pos, pos])), "batch of 2"),
        (dict(input_ids=ids, cu_seq_lens_q=cu), "only one of cu_seq_lens_q"),
        (
            dict(input_ids=ids, cu_seq_lens_q=cu, cu_seq_lens_k=torch.tensor([0, 8, 16])),
            "differ from cu_seq_lens_k",
        ),
        (
            dict(input_ids=ids, cu_seq_lens_q=cu, cu_seq_lens_k=cu, usp_packed=spy.plan.pack(cu)),
            "both usp_packed and cu_seq_lens",
        ),
        (dict(input_ids=ids, cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=4), "max_length_q=4"),
        (
            dict(input_ids=ids, cu_seq_lens_q=cu, cu_seq_lens_k=cu, position_ids=pos.flip(-1)),
            "do not count up by one inside the documents of cu_seq_lens_q/k",
        ),
        (dict(input_ids=two_rows, cu_seq_lens_q=cu, cu_seq_lens_k=cu), "need batch size 1, got 2"),
        (
            dict(input_ids=ids, cu_seq_lens_q=cu[:-1], cu_seq_lens_k=cu[:-1]),
            "14",  # boundaries that end before the sequence does
        ),
    ]
    for inputs, message in cases:
        with pytest.raises(usp.UspError) as err:
            model(**inputs, use_cache=False)
        assert message in str(err.value), (message, str(err.value))
    four_d = torch.zeros(1, 1, 16, 16)
    with pytest.raises(HFInputError, match="a 4-D attention_mask"):
        model(ids, attention_mask=four_d, use_cache=False)
    with pytest.raises(HFInputError, match="input_ids \\[1, S\\]"):
        usp_hf.shard_flattened(spy.plan, {"input_ids": two_rows})
    with pytest.raises(HFInputError, match="needs its documents"):
        usp_hf.shard_flattened(spy.plan, {"input_ids": ids})


def test_register_replaces_its_own_mask_function_only(ckpt):
    from transformers.masking_utils import AttentionMaskInterface

    name = usp_hf.register(None, name="usp-plugin-again")
    first = AttentionMaskInterface._global_mapping[name]
    assert usp_hf.register(None, name=name) == name  # ours: replaced
    assert AttentionMaskInterface._global_mapping[name] is not first


# ------------------------------------------------------------------ torch.compile
def test_plugin_code_compiles_fullgraph_around_a_stand_in_attention(ckpt):
    """The plug-in's own code (mask function, packed-input check, is_causal) adds no
    graph break: with the attention core replaced by torch's SDPA, fullgraph compiles
    and equals eager; position_ids that restart fail the on-device check."""
    torch._dynamo.reset()
    plan = usp.Plan(None)

    def stand_in(q, k, v, *, causal, softmax_scale, packed, head_chunks, window, sinks):
        assert packed is None and head_chunks == 1 and window is None and sinks is None
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
            is_causal=causal, scale=softmax_scale, enable_gqa=True,
        )  # fmt: skip
        return out.transpose(1, 2)

    plan.attention = stand_in
    name = usp_hf.register(plan, name="usp-plugin-compile-stand-in")
    sdpa, model = models(ckpt, name)
    ids = global_batch(2, 16, seed=8)
    # what is tested is the trace (fullgraph: no break) and the check in the graph, not
    # Inductor's code generation (test_fullgraph_compile_at_plan_none_equals_eager below):
    # aot_eager runs the traced graph with eager kernels (7 s here; Inductor took 39)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    got = compiled(ids, use_cache=False).logits
    assert relative_error(got, sdpa(ids, use_cache=False).logits) <= 1e-6
    restart = torch.tensor([[*range(8), *range(8)]])
    with pytest.raises(RuntimeError, match="position_ids restart"):
        compiled(ids[:1], position_ids=restart, use_cache=False)


def test_fullgraph_compile_at_plan_none_equals_eager():
    """Inductor's code generation around the plug-in at Plan(None) (the plug-in's query a
    transposed view into usp's kernel op, its mask function, the float64 graph): the
    compiled forward equals eager. One layer of the tiny Llama, float64 (until
    2026-12-07 the checkpoint's two: the second compiled the first's code again); the
    plug-in's fwd+bwd graph against eager is tests/models/test_compile.py's
    test_hf_plugin_compiles_fullgraph_at_plan_none (AOT autograd)."""
    torch._dynamo.reset()
    name = usp_hf.register(None, name="usp-plugin-compile")
    torch.manual_seed(9)
    config = transformers.LlamaConfig(**{**TINY, "num_hidden_layers": 1}, attn_implementation=name)
    model = transformers.LlamaForCausalLM(config).double()
    ids = global_batch(2, 16, seed=9)
    eager = model(ids, use_cache=False).logits
    compiled = torch.compile(model, fullgraph=True)(ids, use_cache=False).logits
    assert relative_error(compiled, eager) <= 1e-6  # float32 RoPE tables, fused


def test_labels_ignore_the_pads_of_shard_flattened():
    plan = usp.Plan(None)
    batch = flattened((3, 2))
    sharded = usp_hf.shard_flattened(plan, batch, pad_token_id=7)
    ids = batch["input_ids"][0].tolist()
    assert sharded.input_ids[0].tolist() == ids
    assert sharded.labels[0].tolist() == [ids[1], ids[2], IGNORE, ids[4], IGNORE]
    assert sharded.position_ids[0].tolist() == [0, 1, 2, 0, 1]
