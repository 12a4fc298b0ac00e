"""Hybrid models under the HF plug-in: exact or refused, never silently wrong.

Every hybrid architecture of the installed transformers (Mamba/SSM, linear attention,
short convolutions beside attention: tests/helpers/hybrid_cases.py) runs through the
plug-in on 4 gloo ranks under u1 x r2 (dp 2) and u2 x r2, against the same model in one
process. Each must either equal one process (logits within 1e-4, float32) or be refused
with one ``TokenMixerError`` message on every rank, before it computes anything; the
process groups stay usable. The hybrids are all refused today; the token-local controls
(Llama, LFM2 with attention layers only, a mixture of experts) run exactly.

A sweep over every causal-LM type of the installed transformers (built on the meta
device from its default config) checks the detection against the test's own oracle: a
model whose decoder holds a convolution or recurrent module, a module class named like a
token mixer, or non-attention layer kinds in its config is refused.
"""

from __future__ import annotations

import re
import types
import warnings

import pytest
import torch
import torch.distributed as dist
from hybrid_cases import HYBRID, TOKEN_LOCAL, build
from usp_cases import topology

transformers = pytest.importorskip("transformers", minversion="5.24")

import usp  # noqa: E402
from usp.errors import UspError  # noqa: E402
from usp.models import Levers, shard_batch  # noqa: E402
from usp.models import hf as usp_hf  # noqa: E402
from usp.models.hf_mixers import TokenMixerError, mixer_problem  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")  # (tests/conftest.py)

TOL = 1e-4
SEQ = 16


def _outcome(model_type, settings, plan, name, ids):
    """('refused', class, message), or ('ran', max |logit - one process|). The one-process
    reference is built only for a model that ran (a refused one never needs it)."""
    try:
        model = build(model_type, settings, attn_implementation=name)
        with torch.no_grad():
            local = model(**shard_batch(plan, ids).hf_kwargs()).logits  # [1, S/P, V]
            got = plan.gather(local)  # [1, S, V]
    except UspError as err:
        return ("refused", type(err).__name__, str(err))
    reference = build(model_type, settings)
    reference.load_state_dict(model.state_dict())
    with torch.no_grad():
        expected = reference(input_ids=ids, use_cache=False).logits
    return ("ran", (got - expected).abs().max().item())


def run_hybrids(ulysses: int, ring: int):
    plan = usp.Plan(topology(ulysses, ring))
    name = usp_hf.register(plan, name=f"usp_hybrid_u{ulysses}r{ring}")
    ids = torch.randint(0, 64, (1, SEQ), generator=torch.Generator().manual_seed(3))
    outcomes = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # transformers' "fast path not available" notices
        for label, cases in (("hybrid", HYBRID), ("local", TOKEN_LOCAL)):
            for model_type, settings in cases.items():
                outcomes[label, model_type] = _outcome(model_type, settings, plan, name, ids)
    # an HF hybrid model handed to the levers under SP: refused by the same check; in
    # one process the levers apply (layers without self_attn are no AttributeError)
    hybrid = build("qwen3_5_text", HYBRID["qwen3_5_text"])
    try:
        Levers(activation_checkpointing=True).apply(hybrid, plan)
        outcomes["levers"] = None
    except TokenMixerError as err:
        outcomes["levers"] = str(err)
    Levers(activation_checkpointing=True, attention_head_chunks=1).apply(hybrid, usp.Plan(None))
    total = torch.tensor([dist.get_rank()])
    dist.all_reduce(total)  # the groups still work after the refusals
    return outcomes, int(total)


@pytest.mark.parametrize("grid", [(1, 2), (2, 2)], ids=["u1r2-dp2", "u2r2"])
def test_hybrid_models_are_exact_or_refused_on_every_rank(distributed, grid):
    results = distributed.run(run_hybrids, *grid, world_size=4, timeout=600)
    assert all(total == 0 + 1 + 2 + 3 for _, total in results)
    per_rank = [outcomes for outcomes, _ in results]
    grid_text = f"ulysses {grid[0]} x ring {grid[1]}"
    for key in per_rank[0]:
        seen = [outcomes[key] for outcomes in per_rank]
        assert all(s == seen[0] for s in seen), (key, seen)  # one verdict, one message
    for model_type in HYBRID:
        outcome = per_rank[0]["hybrid", model_type]
        assert outcome[:2] == ("refused", "TokenMixerError"), (model_type, outcome)
        message = outcome[2]
        assert f"model_type {model_type!r}" in message, message
        assert grid_text in message and "silently wrong" in message, message
        assert "ulysses = ring = 1" in message, message  # what to do
    for model_type in TOKEN_LOCAL:
        kind, error = per_rank[0]["local", model_type]
        assert kind == "ran" and error <= TOL, (model_type, kind, error)
    levers = per_rank[0]["levers"]
    assert levers is not None and "Qwen3_5GatedDeltaNet" in levers, levers


def test_the_message_names_layers_and_modules():
    """Qwen3.5 (GDN in layers 0 and 2 of 4) names the layers, the module and its class."""
    settings = {**HYBRID["qwen3_5_text"], "num_hidden_layers": 4,
                "layer_types": ["linear_attention", "full_attention"] * 2}  # fmt: skip
    model = build("qwen3_5_text", settings)
    plan = types.SimpleNamespace(sp_degree=2, ulysses_degree=1, ring_degree=2)
    message = mixer_problem(model, plan)
    assert "layers 0, 2: linear_attn (Qwen3_5GatedDeltaNet" in message, message
    assert "layers.0 (layer_types='linear_attention'" in message or "layer kind" in message
    one_rank = types.SimpleNamespace(sp_degree=1, ulysses_degree=1, ring_degree=1)
    assert mixer_problem(model, one_rank) is None  # one process: nothing to refuse


def test_the_plug_in_in_one_process_runs_hybrids():
    """Plan(None): a hybrid runs through the plug-in as in transformers (no shard)."""
    name = usp_hf.register(usp.Plan(None), name="usp_hybrid_one_process")
    reference = build("qwen3_5_text", HYBRID["qwen3_5_text"])
    model = build("qwen3_5_text", HYBRID["qwen3_5_text"], attn_implementation=name)
    model.load_state_dict(reference.state_dict())
    ids = torch.randint(0, 64, (1, SEQ), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        want = reference(input_ids=ids, use_cache=False).logits
        got = model(input_ids=ids, use_cache=False).logits
    assert (got - want).abs().max().item() <= TOL


# ---------------------------------------------------------------- every causal-LM type
#: the test's own oracle of token mixers (not the code under test's rules)
MIXING_MODULES = (torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.RNNBase)
MIXING_NAMES = re.compile(r"Mamba|Mixer|DeltaNet|Lightning|Rglru|Recurrent|ShortConv|Rwkv|LSTM")
MIXING_KINDS = {"linear_attention", "mamba", "conv", "recurrent", "hybrid", "kda"}
#: model types that mix tokens only in attention: never refused
EXACT_TYPES = ("llama", "qwen2", "qwen3", "mistral", "qwen3_moe", "gemma3_text", "gpt_oss")


def _meta_model(model_type: str):
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        try:  # few layers where the config allows it (the sweep's time is per module)
            return AutoModelForCausalLM.from_config(
                AutoConfig.for_model(model_type, num_hidden_layers=4)
            )
        except Exception:  # noqa: BLE001 - layer lists of a fixed length: the default
            return AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type))


def _oracle_mixes(model) -> bool:
    decoder = model.get_decoder()
    for module in decoder.modules():
        if isinstance(module, MIXING_MODULES) or MIXING_NAMES.search(type(module).__name__):
            return True
    config = model.config
    kinds = [getattr(config, f, None) for f in ("layer_types", "layers_block_type", "block_types")]
    return any(isinstance(k, list) and MIXING_KINDS & set(k) for k in kinds)


def test_every_causal_lm_type_that_mixes_tokens_is_refused():
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    plan = types.SimpleNamespace(sp_degree=4, ulysses_degree=2, ring_degree=2)
    built, mixing, missed = 0, [], []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        transformers.logging.set_verbosity_error()
        for model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
            try:
                model = _meta_model(model_type)
            except Exception:  # noqa: BLE001 - default configs that do not build (extras)
                continue
            built += 1
            if _oracle_mixes(model):
                mixing.append(model_type)
                if mixer_problem(model, plan) is None:
                    missed.append(model_type)
    assert built >= 150, built  # the sweep saw the installed transformers
    assert not missed, f"token mixers run under SP without a refusal: {missed}"
    for model_type in ("qwen3_5", "qwen3_next", "bamba", "jamba", "falcon_h1", "minimax",
                       "granitemoehybrid", "zamba2", "nemotron_h", "recurrent_gemma"):  # fmt: skip
        assert model_type in mixing, (model_type, mixing)
    for model_type in EXACT_TYPES:
        assert mixer_problem(_meta_model(model_type), plan) is None, model_type
