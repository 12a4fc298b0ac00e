"""``usp train`` on a tiny Granite 4 hybrid checkpoint written by transformers (Mamba-2
layers 0 and 2, attention without RoPE on layer 1, muP multipliers, tied; the layers under
SP: tests/models/test_families.py, test_granite_hybrid.py): the step-1 loss of one process
equals transformers' float64 loss on the same tokens (each packed document alone; 1e-5
relative, the trainer runs float32); ulysses 2 x ring 2 on 4 gloo ranks with activation
checkpointing equals the one-process run step by step; the export loads in transformers
with equal logits. ``[train] compile`` is refused at set-up, saying why. The model on
ulysses 1 x ring 4 (logits, loss and every gradient against transformers, float64):
tests/models/test_families.py; Mamba-2 under SP on u1r4, zigzag and contiguous, dense and
packed: tests/attention/test_mamba2_usp.py; the trainer on u1r4: test_train_gpt_oss.py."""

from __future__ import annotations

import io

import pytest
import torch
from granite_cases import load_reference, write_checkpoint
from model_cases import relative_error
from train_cases import _train_on_ranks, assert_matches_single, base_config, transformers_first_loss

import usp
from usp.train.config import train_config_from_dict
from usp.train.setup import user_errors
from usp.train.trainer import train

pytest.importorskip("transformers", minversion="5.25")
pytest.importorskip("safetensors", reason="HF checkpoints are safetensors files")
pytestmark = [pytest.mark.filterwarnings("ignore"), pytest.mark.usefixtures("one_thread")]

TIMEOUT = 400


def test_usp_train_on_granite_hybrid(distributed, tmp_path):
    checkpoint = write_checkpoint(tmp_path / "granite", "nope", seed=11, vocab_size=256)
    config = base_config(steps=2, export=True, checkpoint_interval=0)
    config["model"] = {"path": str(checkpoint)}
    config["data"] = {**config["data"], "tokenizer": "byte"}
    config["train"]["activation_checkpointing"] = True
    single = train(train_config_from_dict(config), None, output_dir=tmp_path / "one",
                   stream=io.StringIO())  # fmt: skip
    expected = transformers_first_loss(config, load=load_reference)
    first = single.metrics[0]["loss"]
    assert abs(first - expected) <= 1e-5 * expected, (first, expected)

    rows = distributed.run(
        _train_on_ranks, config, 2, 2, str(tmp_path / "u2r2"), world_size=4, timeout=TIMEOUT
    )
    assert all(r == rows[0] for r in rows)
    assert_matches_single(rows[0], single.metrics)

    exported = usp.models.from_pretrained(single.export_dir)
    assert exported.config.family == "granitemoehybrid"
    hf = load_reference(single.export_dir, dtype=torch.float32)
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        assert relative_error(exported(ids), hf(ids, use_cache=False).logits) <= 1e-5


def test_compile_is_refused_at_set_up(tmp_path):
    config = base_config(steps=1, checkpoint_interval=0)
    config["model"] = {"preset": "granite4h-tiny"}
    config["train"]["compile"] = True
    with pytest.raises(user_errors(), match=r"compile = true does not support granitemoehybrid "
                       r"models here yet: its Mamba-2 layers run eagerly only"):  # fmt: skip
        train(train_config_from_dict(config), None, output_dir=tmp_path, stream=io.StringIO())
    assert not (tmp_path / "checkpoints").exists(), "nothing ran"
