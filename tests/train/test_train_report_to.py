"""``[train] report_to``: TensorBoard's own reader and W&B's own run file hold the values
of metrics.jsonl; ``--set`` changes what is trained and is saved with the run; a missing
library is a start-up error naming the extra. One process, ``usp train`` in-process."""

from __future__ import annotations

import glob
import io
import json
import os
import struct
import sys
import types
from pathlib import Path

import pytest
import torch
from train_cases import base_config
from usp_cases import topology

from usp.cli import main
from usp.config import ConfigError
from usp.train.components import build_plan
from usp.train.config import load_train_config, train_config_from_dict
from usp.train.metrics import MetricsWriter, read_metrics
from usp.train.report_to import ReportingWriter, TensorBoardReporter, check_available, scalars
from usp.train.trainer import train

tensorboard = pytest.importorskip("tensorboard", reason="TensorBoard's reader checks the events")
pytest.importorskip("wandb", reason="the W&B reporter runs through wandb")

JOB = """
[cluster]
nodes = 1
gpus_per_node = 1
[parallel]
ulysses = 1
ring = 1
[model]
preset = "tiny"
[model.overrides]
num_hidden_layers = 1
[data]
source = "synthetic"
synthetic_documents = 32
synthetic_length = 16
[train]
steps = 3
global_batch = 2
seq_len = 32
lr = 3e-4
dtype = "float32"
export = false
"""
LR = 2.5e-3  # what --set gives; the file says 3e-4


def scalar_events(directory) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(directory))
    events.Reload()
    return {
        tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]
    }


def wandb_history(run_file) -> list[dict]:
    """The history rows of a W&B run file (its records: a leveldb-style log of protobuf
    ``Record`` messages after a 7-byte header, in blocks of 32 KiB)."""
    from wandb.proto import wandb_internal_pb2 as pb

    raw, block, position = Path(run_file).read_bytes(), 32768, 7
    assert raw[:4] == b":W&B", raw[:7]
    records, pending = [], b""
    while position + 7 <= len(raw):
        if block - position % block < 7:  # the block's tail is padding
            position += block - position % block
            continue
        _, length, kind = struct.unpack("<IHB", raw[position : position + 7])
        pending += raw[position + 7 : position + 7 + length]
        position += 7 + length
        if kind in (1, 4):  # a whole record, or its last fragment
            records.append(pending)
            pending = b""
    rows = []
    for data in records:
        record = pb.Record()
        record.ParseFromString(data)
        if record.WhichOneof("record_type") == "history":
            items = record.history.item  # a key is in ``key`` or in ``nested_key``
            rows.append({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in items})
    return rows


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """``usp train`` with --set lr and report_to both, W&B offline (no network)."""
    root = tmp_path_factory.mktemp("report_to")
    config = root / "job.toml"
    config.write_text(JOB)
    out = root / "out"
    env = {
        "WANDB_MODE": "offline",
        "WANDB_SILENT": "true",
        "WANDB_CONSOLE": "off",
        "WANDB_CONFIG_DIR": str(root / "wandb-config"),
        "WANDB_CACHE_DIR": str(root / "wandb-cache"),
        "WANDB_DATA_DIR": str(root / "wandb-data"),
    }
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    stderr, sys.stderr = sys.stderr, _Tee(sys.stderr)
    try:
        code = main(
            ["train", str(config), "--output", str(out), "--device", "cpu",
             "--set", f"train.lr={LR}", "--set", 'train.report_to=["tensorboard", "wandb"]']
        )  # fmt: skip
        printed = sys.stderr.text()
    finally:
        sys.stderr = stderr
        for k, v in saved.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    assert code == 0, printed
    return config, out, printed


class _Tee:
    """stderr, also kept (the start-up lines are printed there)."""

    def __init__(self, stream):
        self.stream, self.parts = stream, []

    def write(self, text):
        self.parts.append(text)
        return self.stream.write(text)

    def text(self):
        return "".join(self.parts)

    def __getattr__(self, name):
        return getattr(self.stream, name)


def test_set_changes_the_lr_that_metrics_report(run):
    _, out, printed = run
    rows = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert rows[0]["lr"] == LR, "no warmup: step 1 runs at the peak lr, the --set one"
    assert all(r["lr"] <= LR for r in rows) and rows[-1]["lr"] < LR, "then the cosine decay"
    assert f"set by the command line: [train] lr = {LR!r} (the file: 0.0003)" in printed
    saved = load_train_config(out / "config.toml")  # the effective config, readable as is
    assert saved.train.lr == LR and saved.train.report_to == ("tensorboard", "wandb")
    assert (out / "config.toml").read_text().count("# command line; the file has") >= 2


def test_tensorboard_reader_returns_the_metrics(run):
    _, out, _ = run
    rows = read_metrics(out / "metrics.jsonl")
    events = scalar_events(out / "tensorboard")
    for tag, key in (("train/loss", "loss"), ("train/lr", "lr"), ("train/grad_norm", "grad_norm"),
                     ("train/tokens_per_s", "tokens_per_s")):  # fmt: skip
        # TensorBoard keeps float32: the same value, rounded as float32 rounds it
        expected = [(r["step"], torch.tensor(r[key], dtype=torch.float32).item()) for r in rows]
        assert events[tag] == expected, (tag, events[tag], expected)
    assert not any(tag.startswith("eval/") for tag in events), "no eval rows, no eval scalars"


def test_wandb_offline_run_holds_the_metrics(run):
    _, out, _ = run
    (run_file,) = glob.glob(str(out / "wandb" / "offline-run-*" / "*.wandb"))
    history = wandb_history(run_file)
    rows = read_metrics(out / "metrics.jsonl")
    assert [h["_step"] for h in history] == [r["step"] for r in rows]
    assert [h["train/loss"] for h in history] == [r["loss"] for r in rows]
    assert [h["train/lr"] for h in history] == [r["lr"] for r in rows]
    assert (out / "wandb_run_id").read_text().strip() in run_file


def test_resume_compares_the_effective_config(run, capsys):
    config, out, _ = run
    code = main(
        ["train", str(config), "--output", str(out), "--resume", "--steps", "4",
         "--set", "train.seed=7", "--set", f"train.lr={LR}"]
    )  # fmt: skip
    assert code == 2
    err = capsys.readouterr().err
    assert "differs from the one that wrote the checkpoint" in err and "seed 0 -> 7" in err, err


def test_eval_rows_flow_through_as_eval_scalars(tmp_path):
    """Rows are consumed generically: an evaluation row (``eval_loss``, i33a's) becomes
    ``eval/loss``; text, flags and non-finite numbers are not scalars."""
    row = {"step": 4, "eval_loss": 1.25, "eval_tokens": 96, "skipped": True, "note": "x"}
    assert scalars(row) == {"eval/loss": 1.25, "eval/tokens": 96.0}
    assert scalars({"step": 1, "loss": float("nan"), "lr": 0.1}) == {"train/lr": 0.1}
    writer = ReportingWriter(
        MetricsWriter(tmp_path / "metrics.jsonl"), [TensorBoardReporter(tmp_path, start_step=0)]
    )
    writer.write({"step": 1, "loss": 2.0})
    writer.write({"step": 2, "eval_loss": 1.5, "eval_tokens": 10})
    writer.close()
    events = scalar_events(tmp_path / "tensorboard")
    assert events["train/loss"] == [(1, 2.0)] and events["eval/loss"] == [(2, 1.5)]
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [1, 2]


@pytest.mark.parametrize(
    "name, hidden",
    [("tensorboard", ("tensorboard", "torch.utils.tensorboard")), ("wandb", ("wandb",))],
)
def test_a_missing_library_names_the_extra(tmp_path, capsys, monkeypatch, name, hidden):
    for module in hidden:
        monkeypatch.setitem(sys.modules, module, None)  # import raises ImportError
    from usp.config import ConfigError

    with pytest.raises(ConfigError, match=rf"pip install 'usp\[{name}\]'"):
        check_available((name,))
    config = tmp_path / "job.toml"
    config.write_text(JOB)
    code = main(
        ["train", str(config), "--output", str(tmp_path / "out"), "--device", "cpu",
         "--set", f'train.report_to=["{name}"]']
    )  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2 and f'report_to = ["{name}"] needs the {name} package' in err, err
    assert not (tmp_path / "out" / "metrics.jsonl").exists(), "refused before training"


# ----------------------------------------------------------------------------- two ranks
def _fake_wandb(fail: bool) -> types.ModuleType:
    """A stand-in ``wandb`` that records what the reporter asks of it."""
    fake = types.ModuleType("wandb")
    fake.inits, fake.logged = [], []

    def init(**options):
        if fail:
            raise RuntimeError("api_key not configured (no-tty)")
        fake.inits.append(options)
        return types.SimpleNamespace(
            id="fake-run", log=lambda values, step: fake.logged.append(step), finish=lambda: None
        )

    fake.init = init
    return fake


def run_wandb_on_two_ranks(out: str, fail: bool):
    config = base_config(report_to=["wandb"])
    config["cluster"] = {"nodes": 1, "gpus_per_node": 2}
    config["parallel"] = {"ulysses": 1, "ring": 2, "dp": 1}
    fake, real = _fake_wandb(fail), sys.modules.get("wandb")
    sys.modules["wandb"] = fake
    try:
        job = train_config_from_dict(config)
        train(job, build_plan(job, topology(1, 2)), output_dir=out, stop_after=2,
              stream=io.StringIO())  # fmt: skip
    except ConfigError as err:
        return "error", str(err)
    finally:
        sys.modules["wandb"] = real
    return "ok", len(fake.inits), fake.logged


def test_rank_0_reports_and_a_reporter_that_fails_stops_every_rank(distributed, tmp_path):
    ran = distributed.run(run_wandb_on_two_ranks, str(tmp_path / "ok"), False, world_size=2)
    assert ran == [("ok", 1, [1, 2]), ("ok", 0, [])], "rank 0 only"
    failed = distributed.run(run_wandb_on_two_ranks, str(tmp_path / "no"), True, world_size=2)
    for kind, message in failed:  # the same error on both ranks, none left waiting
        assert kind == "error", message
        assert "a reporter did not start (RuntimeError: api_key not configured" in message
