"""Every model family against transformers' own models (one list of checkpoints:
tests/helpers/family_cases.py), and the family registry.

Each case's tiny checkpoint is written by transformers itself (norm weights away from
their start, random biases, Qwen3's head_dim != hidden / heads with biases on all four
projections, Mistral with a window longer than the sequence and Mistral and Qwen2 with
windows of 8 keys, gpt-oss and Qwen3-MoE with their load-balancing loss, Gemma 3's and
Qwen3.5's cases) and read back by usp through the registry. Checked for every case:
float64 logits, loss and every gradient in one process (1e-12: exact up to summation
order), dense rows and packed documents; on 4 gloo ranks (1e-10: each case's grids, dense
and packed, activation checkpointing and MLP tiles on, one launch per family); the export
read back by transformers with equal logits. Also: the config as transformers reads it
(defaults of absent keys included), sliding windows read as transformers reads them and
computed where they are shorter than the documents.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist
from family_cases import CASES, GROUPS
from family_checks import (
    assert_export_matches_transformers,
    one_process_errors,
    sp_failures,
    sp_float64_run,
)
from model_cases import (
    FAMILY_CASES,
    cu_of,
    global_batch,
    load_hf_reference,
    relative_error,
    sft_labels,
    transformers_reference,
)
from usp_cases import topology

transformers = pytest.importorskip("transformers", reason="the reference is HF transformers")
pytest.importorskip("safetensors", reason="checkpoints are safetensors files")

import usp  # noqa: E402
from usp.models import (  # noqa: E402
    FAMILIES,
    Levers,
    config_from_file,
    config_from_hf,
    family_for_hf,
    family_named,
)

pytestmark = pytest.mark.usefixtures("one_thread")  # (tests/conftest.py)

NAMES = list(FAMILY_CASES)


class _Written(dict):
    """Each case's checkpoint, written when first asked for."""

    def __init__(self, root):
        super().__init__()
        self.root = root

    def __missing__(self, name):
        self[name] = CASES[name].write(self.root / name)
        return self[name]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return _Written(tmp_path_factory.mktemp("families"))


class _References(dict):
    """Each case's transformers model (``case.load_reference``), loaded when first asked
    for and kept for the module: :meth:`run` clears its gradients before each batch."""

    def __init__(self, checkpoints):
        super().__init__()
        self.checkpoints = checkpoints

    def __missing__(self, name):
        self[name] = CASES[name].load_reference(self.checkpoints[name])
        return self[name]

    def run(self, name, rows, labels, cu_seqlens=None) -> dict:
        """:func:`model_cases.transformers_reference` of one batch on ``name``'s model."""
        model = self[name]
        model.zero_grad(set_to_none=True)
        return transformers_reference(model, rows, labels, cu_seqlens)


@pytest.fixture(scope="module")
def references(checkpoints):
    return _References(checkpoints)


def test_every_family_is_registered_once():
    registered = [f.name for f in FAMILIES]
    assert len(set(registered)) == len(registered)
    assert set(NAMES) | {case.family for case in CASES.values()} == set(registered)
    for family in FAMILIES:
        assert family_named(family.name) is family
        for name, config in family.presets.items():
            assert type(config) is family.config_class, name
            assert usp.models.preset(name) is config
    assert len(usp.models.PRESETS) == sum(len(f.presets) for f in FAMILIES)  # unique names


def hf_window(hf_config) -> int | None:
    """The sliding window transformers' model applies for ``hf_config``: its
    ``sliding_window`` when no ``layer_types`` are given or some layer slides."""
    types = getattr(hf_config, "layer_types", None)
    if types is not None and "sliding_attention" not in types:
        return None
    return getattr(hf_config, "sliding_window", None)


@pytest.mark.parametrize("name", NAMES)
def test_config_reads_as_transformers_reads_it(checkpoints, name):
    """The checkpoint's config.json through the registry; a config.json without the keys
    that have family defaults reads as transformers' class fills them; the export's
    config.json reads back equal."""
    path = checkpoints[name] / "config.json"
    config = config_from_file(path)
    assert config.family == name and family_for_hf(json.loads(path.read_text())).name == name
    hf = transformers.AutoConfig.from_pretrained(checkpoints[name])
    for field in ("hidden_size", "num_key_value_heads", "rms_norm_eps", "tie_word_embeddings"):
        assert getattr(config, field) == getattr(hf, field), field
    assert config.attention_head_dim == getattr(hf, "head_dim", None) or (
        hf.hidden_size // hf.num_attention_heads
    )
    assert config_from_hf(config.to_hf_dict()) == config
    bare = {  # Qwen's default of 32 KV heads needs 32 query heads
        "architectures": hf.architectures,
        "vocab_size": 64,
        "hidden_size": 128,
        "intermediate_size": 48,
        "num_hidden_layers": 2,
        "num_attention_heads": 32,
    }
    ours, theirs = config_from_hf(bare), type(hf)(**bare)
    for field in ("num_key_value_heads", "rms_norm_eps", "max_position_embeddings"):
        assert getattr(ours, field) == getattr(theirs, field), (name, field)
    # the window transformers applies to a bare config (Mistral's class assumes 4096)
    assert ours.attention_window == hf_window(theirs), name
    null = {**bare, "sliding_window": None}  # Mistral v0.2 on: an explicit null, no window
    if name != "gpt_oss":  # sliding layers without a window: transformers' mask raises,
        # usp refuses the config (tests/models/test_gpt_oss.py)
        assert config_from_hf(null).attention_window == hf_window(type(hf)(**null)), name
    assert ours.rope_theta == theirs.rope_parameters["rope_theta"]
    assert ours.attention_head_dim == (getattr(theirs, "head_dim", None) or 128 // 32)


@pytest.mark.parametrize("name", list(CASES))
def test_float64_one_process_matches_transformers(checkpoints, references, name):
    """Dense rows (loss chunked by 5) and packed documents, one model each side
    (gradients cleared between the batches)."""
    case = CASES[name]
    dense = global_batch(2, 24, seed=21)
    packed, cu_seqlens = dense[:1], cu_of([9, 15])
    model = usp.models.from_pretrained(checkpoints[name], dtype=torch.float64, backend="math")
    model = case.prepare(model)
    assert model.config.family == case.family
    Levers(loss_chunk_tokens=5).apply(model)
    for rows, cu, row_labels in (
        (dense, None, sft_labels(dense, [4])),
        (packed, cu_seqlens, sft_labels(packed, [2, 3], cu_seqlens)),
    ):
        expected = references.run(name, rows, row_labels, cu)
        model.zero_grad(set_to_none=True)
        errors = one_process_errors(model, rows, row_labels, cu, expected)
        assert max(errors.values()) <= 1e-12, (name, errors)


def sp_case(runs, batches):
    """float64 on each ``(checkpoint, prepare, (ulysses, ring, layout, head chunks))``
    of ``runs``, activation checkpointing and MLP tiles of 3 tokens (12 local tokens):
    :func:`family_checks.sp_float64_run` of each batch."""
    out = []
    for path, prepare, (ulysses, ring, layout, chunks) in runs:
        plan = usp.Plan(topology(ulysses, ring), backend="math", layout=layout)
        model = prepare(usp.models.from_pretrained(path, plan, dtype=torch.float64))
        Levers(activation_checkpointing=True, mlp_tile_tokens=3,
               attention_head_chunks=chunks).apply(model)  # fmt: skip
        out += sp_float64_run(plan, model, batches)
    return out if dist.get_rank() == 0 else None


@pytest.mark.parametrize("group", list(GROUPS))
def test_float64_4_ranks_match_transformers(distributed, checkpoints, references, group):
    """Each case of the family on each of its grids, dense rows (2 x 48) and packed
    documents (16 and 32 tokens: multiples of 2r for every grid) whose windows and
    states cross the ranks' shards; one launch."""
    dense, packed = global_batch(2, 48, seed=22), global_batch(1, 48, seed=23)
    # the pad token (id 0) in both: its embedding row gets no input-side gradient
    assert (dense == 0).any() and (packed == 0).any()
    cu = cu_of([16, 32])
    batches = [(dense, sft_labels(dense, [3]), None), (packed, sft_labels(packed, [3, 5], cu), cu)]
    runs, expected = [], []
    for name in GROUPS[group]:
        case = CASES[name]
        want = [references.run(name, *batch) for batch in batches]
        for grid in case.grids:
            runs.append((str(checkpoints[name]), case.prepare, grid))
            expected += [(name, grid, w) for w in want]
    results = distributed.run(sp_case, runs, batches, world_size=4, timeout=300)[0]
    assert len(results) == len(expected)
    failures = []
    for result, (name, grid, want) in zip(results, expected):
        failures += sp_failures(f"{name} {grid}", result, want, 1e-10)
    assert not failures, "\n".join(failures)


#: the checkpoints whose export is read back (one of each family and case of config)
EXPORTED = [name for name in CASES if not name.endswith(("-window", "-aux"))]


@pytest.mark.parametrize("name", EXPORTED)
def test_export_loads_in_transformers_with_equal_logits(checkpoints, tmp_path, name):
    case = CASES[name]
    out = assert_export_matches_transformers(
        checkpoints[name], tmp_path / "export", case.load_reference
    )
    written = json.loads((out / "config.json").read_text())
    assert written["architectures"] == list(family_named(case.family).architectures)[:1]


@pytest.mark.parametrize("name", ["mistral-window", "qwen2-window"])
def test_a_window_shorter_than_the_sequence_is_computed(checkpoints, name):
    """Windows of 8 keys: the checks above hold them exact on 24- and 48-token rows;
    here, that the window acts. The same weights without it (full causal attention)
    equal transformers' logits up to token 8 and differ after."""
    model = usp.models.from_pretrained(checkpoints[name], dtype=torch.float64, backend="math")
    config = model.config
    assert config.attention_window == 8
    windows = [config.layer_window(i) for i in range(config.num_hidden_layers)]
    assert windows == ([8, 8] if name == "mistral-window" else [None, 8])
    assert [layer.self_attn.window for layer in model.decoder_layers] == windows
    ids = global_batch(1, 16, seed=24)
    full_config = config.replace(sliding_window=None)
    unwindowed = type(model)(full_config, backend="math").double()
    unwindowed.load_state_dict(model.state_dict())
    with torch.no_grad():
        windowed = load_hf_reference(checkpoints[name])(ids, use_cache=False).logits
        ours, full = model(ids), unwindowed(ids)
    assert relative_error(ours, windowed) <= 1e-12
    assert relative_error(full[:, :8], windowed[:, :8]) <= 1e-12
    assert relative_error(full[:, 8:], windowed[:, 8:]) > 1e-3


def test_qwen_sliding_window_is_read_as_transformers_reads_it():
    base = {
        "architectures": ["Qwen2ForCausalLM"], "vocab_size": 64, "hidden_size": 32,
        "intermediate_size": 48, "num_hidden_layers": 4, "num_attention_heads": 8,
        "num_key_value_heads": 2, "sliding_window": 16,
    }  # fmt: skip
    assert config_from_hf(base).attention_window is None  # use_sliding_window: false
    on = config_from_hf({**base, "use_sliding_window": True, "max_window_layers": 2})
    assert on.attention_window == 16  # layers 2 and 3 slide
    assert config_from_hf({**base, "use_sliding_window": True}).attention_window is None
    types = ["full_attention", "sliding_attention", "full_attention", "full_attention"]
    assert (
        config_from_hf({**base, "use_sliding_window": True, "layer_types": types}).attention_window
        == 16
    )
