"""The HF plug-in against every mask builder of ``transformers.masking_utils``.

transformers builds a layer's mask through the mask function registered with the
attention name (usp's returns None: the layers get no mask), telling it what to build:
``mask_function`` (causal, bidirectional, or one composed with a window or a chunk)
and, for windowed masks, ``local_size``. Each builder is called directly with usp's
name (causal, bidirectional, sliding-window causal and bidirectional, chunked; no
padding, right padding, left padding): what USP attention computes exactly passes,
the rest is refused with a message. Then whole models against sdpa: a model whose mask
builder is the bidirectional one while its attention modules say causal (a right-padded
batch would be attended bidirectionally by sdpa: refused), and Llama 4's chunked layers
(exact when the chunk holds the sequence, refused otherwise). One process, float64.
"""

from __future__ import annotations

import copy
import types

import pytest
import torch
from model_cases import (
    global_batch,
    hf_config,
    load_hf_reference,
    relative_error,
    write_hf_checkpoint,
)

transformers = pytest.importorskip("transformers", reason="the plug-in is for HF transformers")
pytest.importorskip("safetensors", reason="checkpoints are safetensors files")

import transformers.masking_utils as masking  # noqa: E402

import usp.models.hf as usp_hf  # noqa: E402
from usp.models.hf_inputs import HFInputError, window_problem  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")  # (tests/conftest.py)

TOL = 1e-12
BATCH, SEQ = 2, 8


def padding(kind: str) -> torch.Tensor | None:
    """A [2, 8] padding mask: none, all ones, zeros at the end of row 1, or at its start."""
    if kind == "none":
        return None
    mask = torch.ones(BATCH, SEQ, dtype=torch.long)
    if kind == "right":
        mask[1, 5:] = 0
    elif kind == "left":
        mask[1, :3] = 0
    return mask


BUILDERS = {
    "causal": masking.create_causal_mask,
    "bidirectional": masking.create_bidirectional_mask,
    "sliding causal": masking.create_sliding_window_causal_mask,
    "sliding bidirectional": masking.create_bidirectional_sliding_window_mask,
    "chunked": masking.create_chunked_causal_mask,
}
BIDIRECTIONAL = "bidirectional model (is_causal=False)"
LEFT = "padding before real tokens (row 1"
WINDOW = "a mask of attention limited to {} tokens"


@pytest.mark.parametrize(
    "builder, config, mask, refused",
    [
        ("causal", {}, "none", None),
        ("causal", {}, "ones", None),
        ("causal", {}, "right", None),  # exact: no real token attends to a later pad
        ("causal", {}, "left", LEFT),
        ("causal", {"is_causal": False}, "right", BIDIRECTIONAL),
        ("bidirectional", {}, "ones", None),
        ("bidirectional", {}, "right", BIDIRECTIONAL),  # whatever config.is_causal says
        ("sliding causal", {"sliding_window": SEQ}, "right", None),  # the window holds all
        # served: the layers get sliding_window, which USP attention computes
        ("sliding causal", {"sliding_window": SEQ - 1}, "none", None),
        ("sliding causal", {"sliding_window": 2}, "right", None),
        # what models set is_causal=False reach (gpt-oss, Gemma 3): the message says so
        (
            "sliding bidirectional",
            {"sliding_window": 4},
            "ones",
            "is_causal=False with sliding_window=4",
        ),
        ("chunked", {"attention_chunk_size": SEQ}, "right", None),
        ("chunked", {"attention_chunk_size": 4}, "none", WINDOW.format(4)),
        ("chunked", {"attention_chunk_size": 4}, "left", WINDOW.format(4)),
    ],
)
def test_each_mask_builder_is_served_exactly_or_refused(builder, config, mask, refused):
    name = usp_hf.register(None, name="usp-masks")
    hf = hf_config(**config)
    hf._attn_implementation = name
    kwargs = dict(config=hf, inputs_embeds=torch.zeros(BATCH, SEQ, hf.hidden_size),
                  attention_mask=padding(mask), cache=None)  # fmt: skip
    if refused is None:
        assert BUILDERS[builder](**kwargs) is None  # no mask reaches the layers
    else:
        with pytest.raises(HFInputError, match=rf"attn_implementation='{name}' .*") as err:
            BUILDERS[builder](**kwargs)
        assert refused in str(err.value), str(err.value)


def test_a_window_is_compared_with_the_global_sequence_under_sp():
    """Under SP the mask builder sees this rank's shard: the window must hold the whole
    sequence (shard x sp ranks)."""
    sp4 = types.SimpleNamespace(sp_degree=4)
    assert window_problem(sp4, 32, kv_length=8, kv_offset=0) is None
    assert "limited to 16 tokens" in window_problem(sp4, 16, kv_length=8, kv_offset=0)
    assert "for a sequence of 32 tokens" in window_problem(sp4, 16, kv_length=8, kv_offset=0)
    assert window_problem(sp4, None, kv_length=8, kv_offset=0) is None


# ------------------------------------------------------------------ whole models
@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_hf_checkpoint(tmp_path_factory.mktemp("hf_masks") / "tiny", seed=6)


def test_a_bidirectional_mask_builder_with_causal_modules_refuses_right_padding(ckpt, monkeypatch):
    """Llama with transformers' bidirectional mask builder in place of the causal one
    (what encoders whose attention modules keep ``is_causal=True`` do): without padding
    sdpa attends causally (it skips the all-true mask) and usp equals it; with right
    padding sdpa gets the padded bidirectional mask, which is not causal attention on
    the real tokens, and usp refuses it instead of computing causal attention."""
    name = usp_hf.register(None, name="usp-masks-bidirectional")
    plain = load_hf_reference(ckpt)
    ids = global_batch(BATCH, SEQ, seed=3)
    mask = padding("right")
    real = mask.bool()
    causal_padded = plain(ids, attention_mask=mask, use_cache=False).logits[real]

    def bidirectional_builder(config, inputs_embeds, attention_mask, **_):
        return masking.create_bidirectional_mask(
            config=config, inputs_embeds=inputs_embeds, attention_mask=attention_mask
        )

    monkeypatch.setattr(
        transformers.models.llama.modeling_llama, "create_causal_mask", bidirectional_builder
    )
    sdpa, model = load_hf_reference(ckpt), load_hf_reference(ckpt, attn_implementation=name)
    dense = model(ids, use_cache=False).logits
    assert relative_error(dense, sdpa(ids, use_cache=False).logits) <= TOL
    bidirectional_padded = sdpa(ids, attention_mask=mask, use_cache=False).logits[real]
    assert relative_error(bidirectional_padded, causal_padded) > 1e-3  # really not causal
    with pytest.raises(HFInputError, match="bidirectional model \\(is_causal=False\\)"):
        model(ids, attention_mask=mask, use_cache=False)


def llama4_pair(name: str, chunk: int):
    """(sdpa, usp) tiny Llama 4 text models with the same random float64 weights; layer
    0 chunked (attention within chunks of ``chunk`` tokens), layer 1 full attention."""
    config = transformers.Llama4TextConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, intermediate_size_mlp=64,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        attention_chunk_size=chunk, num_local_experts=2, num_experts_per_tok=1,
        no_rope_layers=[1, 0], max_position_embeddings=64,
    )  # fmt: skip
    assert config.layer_types == ["chunked_attention", "full_attention"]
    torch.manual_seed(0)
    models = [
        transformers.Llama4ForCausalLM._from_config(copy.deepcopy(config), attn_implementation=a)
        .double()
        .eval()
        for a in ("sdpa", name)
    ]
    with torch.no_grad():
        for p in models[0].parameters():
            p.normal_(0.0, 0.3)  # (the default init leaves the attention output at zero)
    models[1].load_state_dict(models[0].state_dict())
    return models


def test_llama4_chunked_attention_is_exact_within_a_chunk_and_refused_beyond():
    """Llama 4's chunked layers get no chunk keyword in the attention call, only the
    mask builder knows: a sequence of one chunk equals sdpa, 24 tokens in chunks of 8 are
    refused (they were computed as full causal attention, silently), and 24 tokens in
    one chunk of 24 equal sdpa again."""
    name = usp_hf.register(None, name="usp-masks-llama4")
    sdpa, model = llama4_pair(name, chunk=8)
    ids = global_batch(1, 8, seed=4)
    got, expected = model(ids, use_cache=False).logits, sdpa(ids, use_cache=False).logits
    assert relative_error(got, expected) <= TOL
    longer = global_batch(1, 24, seed=4)
    assert sdpa(longer, use_cache=False).logits.abs().max() > 0
    with pytest.raises(HFInputError, match="limited to 8 tokens .* sequence of 24 tokens"):
        model(longer, use_cache=False)
    # the same sequence with a chunk that holds it: causal attention, equal to sdpa
    sdpa, model = llama4_pair(name, chunk=24)
    got, expected = model(longer, use_cache=False).logits, sdpa(longer, use_cache=False).logits
    assert relative_error(got, expected) <= TOL
