"""``usp plan`` of a vision-language checkpoint (a tiny Gemma 3 with its vision tower):
it plans the text decoder (usp's Gemma 3 family reads the composite config) and says, in
its notes, that the encoder's memory and time per rank are not counted yet (issue 55).
The notes of the model's source are checked directly: a whole plan measures every layout
and lever (minutes on 2 CPU cores)."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers", minversion="5.25")

import vl_cases  # noqa: E402

from usp.planner.plan import encoder_notes  # noqa: E402
from usp.train.components import model_source  # noqa: E402
from usp.train.config import load_train_config  # noqa: E402

CONFIG = """
[cluster]
nodes = 1
gpus_per_node = 1
[parallel]
ulysses = 1
ring = 1
[model]
path = "{path}"
[data]
source = "synthetic"
[train]
steps = 1
global_batch = 1
seq_len = 64
device = "cpu"
"""


def test_plan_of_a_vision_language_checkpoint_says_the_encoder_is_not_counted(tmp_path):
    vl_cases.write_gemma3_checkpoint(tmp_path / "gemma3")
    path = tmp_path / "plan.toml"
    path.write_text(CONFIG.format(path=tmp_path / "gemma3"))
    source = model_source(load_train_config(path))
    assert source.config.num_hidden_layers == 2  # the text decoder's
    [note] = encoder_notes(source.directory)
    assert "vision-language model (vision_config)" in note and "not counted yet" in note
    text = tmp_path / "text"  # the text config alone: nothing left out
    text.mkdir()
    (text / "config.json").write_text(json.dumps(vl_cases.gemma3_config().text_config.to_dict()))
    assert encoder_notes(text) == []
