"""``--set SECTION.KEY=VALUE`` on ``usp train``, ``usp plan`` and ``usp topo``: any field,
parsed as a TOML value, checked by the file's own validators (with the ``--set`` named);
the effective config round-trips through its TOML text."""

from __future__ import annotations

import json

import pytest

from usp.cli import main
from usp.config import ConfigError
from usp.config.overrides import apply_settings, changed_keys, parse_setting, toml_value
from usp.config.toml import toml_dumps, tomllib
from usp.train.config import load_train_config

JOB = """
[cluster]
nodes = 1
gpus_per_node = 4
[parallel]
ulysses = 2
ring = 2
[model]
preset = "tiny"
[data]
source = "synthetic"
[train]
steps = 10
global_batch = 4
seq_len = 64
"""


@pytest.fixture
def job_file(tmp_path):
    path = tmp_path / "job.toml"
    path.write_text(JOB)
    return path


def test_values_are_toml_values_and_bare_words_strings():
    assert toml_value("1e-4") == 1e-4 and toml_value("3") == 3 and toml_value("true") is True
    assert toml_value("[0.9, 0.99]") == [0.9, 0.99]
    assert toml_value('{rope_type = "yarn", factor = 4.0}') == {"rope_type": "yarn", "factor": 4.0}
    assert toml_value('"split"') == "split" and toml_value("split") == "split"
    assert toml_value("offload") == "offload" and toml_value("1e-3x") == "1e-3x"
    s = parse_setting("model.overrides.num_hidden_layers=4")
    assert (s.path, s.value) == (("model", "overrides", "num_hidden_layers"), 4)
    assert apply_settings({"model": {"preset": "tiny"}}, [s]) == {
        "model": {"preset": "tiny", "overrides": {"num_hidden_layers": 4}}
    }
    for bad in ("lr=1", "train.lr", ".lr=1", "train.=1"):
        with pytest.raises(ConfigError, match="--set expects SECTION.KEY=VALUE"):
            parse_setting(bad)


def test_any_field_of_any_section(job_file):
    job = load_train_config(
        job_file,
        sets=[
            "train.lr=2e-3", "train.adam_betas=[0.8, 0.9]", "data.long_documents=split",
            "attention.layout=contiguous", "parallel.ulysses=4", "parallel.ring=1",
            "model.overrides.num_hidden_layers=3", "train.activation_checkpointing=offload",
            "train.lr=1e-3",  # the last of two wins
        ],
    )  # fmt: skip
    assert job.train.lr == 1e-3 and job.train.adam_betas == (0.8, 0.9)
    assert job.data.long_documents == "split" and job.topology.attention.layout == "contiguous"
    assert (job.topology.parallel.ulysses, job.topology.parallel.ring) == (4, 1)
    assert job.model.overrides == {"num_hidden_layers": 3}
    assert job.train.activation_checkpointing == "offload"
    assert job.tables["train"]["lr"] == 1e-3, "the effective config keeps the settings"
    assert job.with_overrides(steps=3).train.lr == 1e-3, "and so does a later override"
    changes = [name for name, _, _ in changed_keys(tomllib.loads(JOB), job.tables)]
    assert "[train] lr" in changes and "[model] overrides.num_hidden_layers" in changes
    assert "[train] steps" not in changes


@pytest.mark.parametrize(
    "setting, message",
    [
        ("train.lr=-1", r"\[train\] lr must be a number > 0, got -1 \(from --set train.lr=-1\)"),
        ("train.steps=many", r'\[train\] steps must be an integer >= 1, got "many" \(from --set'),
        ("train.lrr=1", r"\[train\] unknown key 'lrr'; expected one of steps, .* \(from --set"),
        ("trian.lr=1", r"unknown section \[trian\]; expected .* \(from --set trian.lr=1\)"),
        ("data.long_documents=cut", r'long_documents must be one of "truncate", "split"'),
        ('train.report_to=["mlflow"]', r"report_to must be a list of distinct names among"),
        ("train.lr.x=1", r"--set train.lr.x=1: train.lr is 0.0003 in the config, not a table"),
    ],
)
def test_bad_keys_and_values_get_the_validators_message(job_file, setting, message):
    text = JOB.replace("steps = 10", "steps = 10\nlr = 3e-4")
    job_file.write_text(text)
    with pytest.raises(ConfigError, match=message) as caught:
        load_train_config(job_file, sets=[setting])
    assert str(caught.value).startswith(f"{job_file}: "), "located in the file, as its errors"


def test_a_key_given_by_a_flag_and_by_set_is_refused(job_file):
    with pytest.raises(
        ConfigError, match=r"\[train\] steps is given twice, by --steps and by --set"
    ):
        load_train_config(job_file, sets=["train.steps=4"], steps=3)
    assert load_train_config(job_file, sets=["train.steps=4"], steps=None).train.steps == 4


def test_effective_config_round_trips():
    data = {
        "cluster": {"nodes": 1, "gpus_per_node": "auto"},
        "model": {"preset": "tiny", "overrides": {"num_hidden_layers": 2}},
        "train": {"lr": 1e-5, "adam_betas": [0.9, 0.95], "odd key": 'a"b\\c\n\x7f☕', "x": 1e300},
    }
    assert tomllib.loads(toml_dumps(data)) == data


def test_usp_train_reports_a_bad_set_with_status_2(job_file, capsys):
    assert main(["train", str(job_file), "--set", "train.micro_batch=0"]) == 2
    err = capsys.readouterr().err
    assert "[train] micro_batch must be an integer >= 1, got 0 (from --set" in err, err


def test_usp_topo_takes_set(job_file, capsys):
    assert main(["topo", str(job_file), "--json", "--set", "parallel.ulysses=1",
                 "--set", "parallel.ring=4"]) == 0  # fmt: skip
    degrees = json.loads(capsys.readouterr().out)["degrees"]
    assert (degrees["ulysses"], degrees["ring"]) == (1, 4)
    assert main(["topo", str(job_file), "--set", "parallel.ulysses=0"]) == 2
    err = capsys.readouterr().err
    assert 'ulysses must be an integer >= 1 or "auto", got 0 (from --set parallel.ulysses=0)' in err
    # the [train] checks usp topo makes see the settings too
    assert main(["topo", str(job_file), "--set", "train.seq_len=63"]) == 2
    assert "seq_len(63) must be a multiple of" in capsys.readouterr().err


def test_usp_plan_takes_set(job_file, capsys):
    assert main(["plan", str(job_file), "--set", "train.lrr=1", "--jobs", "1"]) == 2
    assert "[train] unknown key 'lrr'" in capsys.readouterr().err
    argv = ["plan", str(job_file), "--seq-len", "128", "--set", "train.seq_len=256"]
    assert main(argv) == 2
    assert "seq_len is given twice, by --seq-len and by --set" in capsys.readouterr().err
