"""The HF plug-in sees every model before its first forward under SP computes anything,
whatever the order of the recipe; and the inputs it cannot serve under SP (a KV cache, a
bidirectional sliding window) are refused by name.

On 2 gloo ranks (ulysses 1 x ring 2), tiny float32 models (tests/helpers/causal_lm_sweep.py):

- a model that never calls attention (Mamba) is refused with a ``TokenMixerError`` in
  every order: ``register(plan)`` then a model built with the name, ``from_pretrained(path,
  attn_implementation=name)``, and a model built first then ``register(plan,
  model=model)``; its embedding never ran (nothing computed);
- a Llama in the same three orders runs with usp's attention (the name switched on by
  ``register(plan, model=model)``) and equals transformers in one process;
- gpt-oss and Gemma 3 with ``use_cache=True`` (given, or the config's default) and with
  ``is_causal=False`` and a sliding window shorter than the sequence: one ``HFInputError``
  per case, the same on both ranks, naming ``use_cache`` / ``is_causal=False``.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from causal_lm_sweep import build, errors, reference, tiny_config, token_ids
from usp_cases import topology

transformers = pytest.importorskip("transformers", minversion="5.24")

import usp  # noqa: E402
from usp.errors import ModelConfigError  # noqa: E402
from usp.models import hf as usp_hf  # noqa: E402
from usp.models import shard_batch  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")  # (tests/conftest.py)

TOL = 1e-4


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Tiny Mamba and Llama checkpoints (HF directories) for from_pretrained."""
    root = tmp_path_factory.mktemp("hf_model_check")
    for model_type in ("mamba", "llama"):
        build(model_type).save_pretrained(root / model_type)
    return {t: str(root / t) for t in ("mamba", "llama")}


def _embedding_calls(model) -> list:
    calls = []
    model.get_input_embeddings().register_forward_pre_hook(lambda *_: calls.append(1))
    return calls


def _built(order: str, model_type: str, path: str, plan, name: str):
    """The model of ``order`` (registering ``name`` on ``plan`` as that order does)."""
    from transformers import AutoModelForCausalLM

    if order == "register, then build":
        usp_hf.register(plan, name=name)
        return build(model_type, attn_implementation=name)
    if order == "register, then from_pretrained":
        usp_hf.register(plan, name=name)
        return AutoModelForCausalLM.from_pretrained(path, attn_implementation=name).eval()
    model = AutoModelForCausalLM.from_pretrained(path).eval()  # "build, then register"
    usp_hf.register(plan, name=name, model=model)
    return model


ORDERS = ("register, then build", "register, then from_pretrained", "build, then register")


def run_orders(paths: dict):
    transformers.logging.set_verbosity_error()
    plan = usp.Plan(topology(1, 2))
    ids = token_ids(tiny_config("llama"))
    batch = shard_batch(plan, ids)
    outcomes = {}
    for model_type, path in paths.items():
        for index, order in enumerate(ORDERS):
            name = f"usp_order_{model_type}_{index}"
            calls = None
            try:
                model = _built(order, model_type, path, plan, name)
                calls = _embedding_calls(model)
                with torch.no_grad():
                    logits = plan.gather(model(**batch.hf_kwargs()).logits)
                outcomes[model_type, order] = ("ran", model.config._attn_implementation, logits)
            except usp.UspError as err:
                outcomes[model_type, order] = ("refused", type(err).__name__, str(err))
            outcomes[model_type, order, "embedding calls"] = None if calls is None else len(calls)
    total = torch.tensor([dist.get_rank()])
    dist.all_reduce(total)  # the groups still work after the refusals
    return outcomes, int(total)


def test_every_order_checks_the_model_before_it_computes(distributed, checkpoints):
    results = distributed.run(run_orders, checkpoints, world_size=2, timeout=600)
    assert all(total == 1 for _, total in results)
    first, second = (outcomes for outcomes, _ in results)
    want = reference("llama", token_ids(tiny_config("llama")))["logits"]
    for order in ORDERS:
        refused = first["mamba", order]
        assert refused[:2] == ("refused", "TokenMixerError"), (order, refused)
        assert "MambaForCausalLM (model_type 'mamba')" in refused[2], refused
        assert "MambaMixer" in refused[2] and "ulysses = ring = 1" in refused[2], refused
        assert second["mamba", order] == refused  # one message on every rank
        assert first["mamba", order, "embedding calls"] in (None, 0), order  # nothing ran
        ran = first["llama", order]
        assert ran[:2] == ("ran", f"usp_order_llama_{ORDERS.index(order)}"), (order, ran[:2])
        got = {"logits": ran[2], "grads": {}}
        assert errors(got, {"logits": want, "grads": {}})["logits"] <= TOL, order


# --------------------------------------------------------- inputs refused under SP
def run_cache_and_causality():
    transformers.logging.set_verbosity_error()
    plan = usp.Plan(topology(1, 2))
    name = usp_hf.register(plan, name="usp_cache_causality")
    outcomes = {}
    for model_type in ("gpt_oss", "gemma3_text"):
        window = {"sliding_window": 4}  # shorter than the 16 tokens
        model = build(model_type, config_changes=window, attn_implementation=name)
        batch = shard_batch(plan, token_ids(model.config))
        cases = {
            "use_cache=True": {**batch.hf_kwargs(), "use_cache": True},
            "the config's use_cache": {
                k: v for k, v in batch.hf_kwargs().items() if k != "use_cache"
            },
        }
        for what, kwargs in cases.items():
            outcomes[model_type, what] = _refusal(model, kwargs)
        model.config.is_causal = False
        outcomes[model_type, "is_causal=False"] = _refusal(model, batch.hf_kwargs())
    return outcomes


def _refusal(model, kwargs):
    try:
        with torch.no_grad():
            model(**kwargs)
    except usp.UspError as err:
        return type(err).__name__, str(err)
    return None


def test_a_cache_and_a_bidirectional_window_are_refused_by_name(distributed):
    results = distributed.run(run_cache_and_causality, world_size=2, timeout=600)
    assert results[0] == results[1]  # the same error, the same message, on both ranks
    for model_type in ("gpt_oss", "gemma3_text"):
        for what in ("use_cache=True", "the config's use_cache"):
            error, message = results[0][model_type, what]
            assert error == "HFInputError", (model_type, what, message)
            assert "use_cache=True under sequence parallelism" in message, message
            assert "8 of 16 tokens" in message and "use_cache=False" in message, message
        error, message = results[0][model_type, "is_causal=False"]
        assert error == "HFInputError", (model_type, message)
        assert "is_causal=False with sliding_window=4" in message, message
        assert "leave is_causal at True" in message, message


# --------------------------------------------------------- is_causal=False, one process
def test_a_decoder_marked_bidirectional_is_never_computed_bidirectional():
    """BigBird-Pegasus's decoder self-attention is marked is_causal=False and gets its
    causal mask from transformers (eager applies it); its decoder also builds a
    bidirectional mask (for cross-attention), so which one a layer gets cannot be told:
    refused, in one process too, before any attention ran."""
    plan = usp.Plan(None)
    calls = []
    attention = plan.attention
    plan.attention = lambda *args, **kwargs: calls.append(1) or attention(*args, **kwargs)
    name = usp_hf.register(plan, name="usp_bigbird_one_process")
    model = build("bigbird_pegasus", attn_implementation=name)
    ids = token_ids(model.config)
    with pytest.raises(usp.UspError, match="marked is_causal=False, and this forward built both"):
        model(input_ids=ids, use_cache=False)
    assert not calls


@pytest.mark.parametrize("model_type, cls", [("git", "GitModel"), ("gpt_neo", "GPTNeoModel")])
def test_an_attention_table_of_its_own_is_refused_while_built(model_type, cls):
    """In one process too: transformers would raise a bare KeyError for the name."""
    name = usp_hf.register(usp.Plan(None), name="usp_own_table")
    with pytest.raises(ModelConfigError) as err:
        build(model_type, attn_implementation=name)
    assert f"{cls} (model_type {model_type!r}) picks its attention from a table" in str(err.value)
    assert "attn_implementation='sdpa' or 'eager'" in str(err.value)
