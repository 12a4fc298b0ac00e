"""``usp plan --lengths``: a length mix's rows on the best layout's grid, both token
placements (the split documents' traffic alone for ``"documents"``): the numbers of
:func:`usp.planner.plan.length_mix` against :mod:`usp.planner.placement` on a u2 x r2
and a u1 x r4 grid, the configured placement and the training data's own lengths
(``"data"``); the flag's way through the command to the JSON and the text (the search
itself stubbed: tests/planner/test_planner.py runs it); a bad lengths file is one
error line."""

from __future__ import annotations

import json

import pytest
from planner_cases import write_config

from usp.cli import main
from usp.models import PRESETS
from usp.planner import plan as plan_module
from usp.planner.footprint import Choice
from usp.planner.hardware import CPU_TFLOPS
from usp.planner.placement import Machine, mix_steps, mix_totals
from usp.planner.report import mix_lines, text, to_json
from usp.planner.search import Cluster
from usp.train.components import model_source
from usp.train.config import load_train_config

#: 512-token rows of a long document and many short ones
LENGTHS = [300, 9, 20, 13, 30, 7, 40, 5, 16, 11, 25, 3] * 3


@pytest.fixture
def job(tmp_path):
    return load_train_config(write_config(tmp_path, gpus=4, seq_len=512, global_batch=2))


@pytest.mark.parametrize("grid", [(2, 2), (1, 4)])
def test_the_mix_on_a_grid_is_the_placement_modules(job, grid):
    ulysses, ring = grid
    cluster = Cluster(1, 4, 1.0, 64.0)
    mix = plan_module.length_mix(
        job, model_source(job), Choice(ulysses, ring, 1), cluster, "cpu", LENGTHS
    )
    assert mix["grid"] == grid and mix["document_count"] == 36
    assert mix["configured"] == "sequence"
    model = PRESETS["tiny"].replace(num_hidden_layers=2)
    machine = Machine(4, cluster.intra_node_gbps, cluster.inter_node_gbps, CPU_TFLOPS, CPU_TFLOPS)
    steps = mix_steps(LENGTHS, model=model, ulysses=ulysses, ring=ring, seq_len=512,
                      item_bytes=4, machine=machine)  # fmt: skip
    totals = mix_totals(steps)
    assert mix["rows"] == len(steps) > 1
    for placement in ("sequence", "documents"):
        want = totals[placement]
        got = mix[placement]
        assert got["bytes_per_rank_per_row"] == pytest.approx(want["bytes_mean"] / len(steps))
        assert got["step_s"] == pytest.approx(want["step_s"] / len(steps) * 2)  # 2 rows a step
        assert got["tokens_max"] == want["tokens_max"]
    seq, doc = mix["sequence"], mix["documents"]
    assert doc["bytes_per_rank_per_row"] < seq["bytes_per_rank_per_row"]
    assert doc["tokens_max"] > 512 // 4 == seq["tokens_max"]  # a rank's whole documents
    assert doc["work_max_over_mean"] <= 1.02 + 1e-9 and seq["step_s"] > 0 and doc["step_s"] > 0
    text = "\n".join(mix_lines(mix))
    assert "length mix: 36 documents in" in text and "against sequence" in text


def test_the_datas_own_lengths(job):
    """``--lengths data``: the documents of the config's training data (synthetic here)."""
    mix = plan_module.length_mix(
        job, model_source(job), Choice(2, 2, 1), Cluster(1, 4, 1.0, 64.0), "cpu", "data"
    )
    assert mix["document_count"] == 2048 and mix["rows"] > 1  # [data] synthetic_documents


def test_the_flag_reaches_the_json(tmp_path, capsys, monkeypatch):
    path = write_config(tmp_path, gpus=4, seq_len=512, global_batch=2)
    lengths = tmp_path / "lengths.txt"
    lengths.write_text("\n".join(map(str, LENGTHS)) + "\n\n")
    seen = {}

    def stub(config, **kwargs):  # the search is test_planner.py's; here only the plumbing
        seen.update(kwargs)
        raise plan_module.ConfigError("stubbed")

    monkeypatch.setattr(plan_module, "plan", stub)
    assert main(["plan", str(path), "--lengths", str(lengths), "--jobs", "1"]) == 2
    assert seen["lengths"] == LENGTHS
    assert main(["plan", str(path), "--lengths", "data", "--jobs", "1"]) == 2
    assert seen["lengths"] == "data"
    capsys.readouterr()
    # the JSON and text of a result holding a mix
    result = plan_module.PlanResult(
        config=str(path), model_name="tiny", seq_len=512, cluster=Cluster(1, 4, 1.0, 64.0),
        device="cpu", gpu="cpu", candidates=[], max_seq_len=0, max_seq_choice=None, notes=[],
        seconds=0.0, length_mix={"document_count": 1, "rows": 1, "grid": (2, 2),
                                 "configured": "documents",
                                 **{p: {"bytes_per_rank_per_row": 1.0, "tokens_max": 1,
                                        "work_max_over_mean": 1.0, "step_s": 1.0}
                                    for p in ("sequence", "documents")}},
    )  # fmt: skip
    assert json.loads(json.dumps(to_json(result)))["length_mix"]["configured"] == "documents"
    assert "token_placement = 'documents'" in text(result)


def test_a_bad_lengths_file_is_one_error(tmp_path, capsys):
    path = write_config(tmp_path, gpus=4, seq_len=512, global_batch=2)
    lengths = tmp_path / "lengths.txt"
    lengths.write_text("12\nseven\n")
    assert main(["plan", str(path), "--device", "cpu", "--lengths", str(lengths)]) == 2
    assert "lengths.txt:2: expected a document length >= 1" in capsys.readouterr().err
    assert main(["plan", str(path), "--device", "cpu", "--lengths", str(tmp_path / "no")]) == 2
    assert "--lengths" in capsys.readouterr().err
