"""What a resume refuses to change: the run record of a checkpoint against the run now.

Every key of the record is changed alone: ``[train]`` seed, seq_len and global_batch,
every ``[data]`` key (the data files' content included) and every RoPE setting are
refused with a message naming the key and both values; every other ``[train]`` key is
reported as allowed. The sets expected here are written out, not read from
``usp.train.resume``, so a key dropped there fails here. Then ``usp train --resume`` in
one process: a changed global_batch is refused before anything runs, a changed
micro_batch is reported and trained on. Single process."""

from __future__ import annotations

import dataclasses
import io
import json

import pytest
from train_cases import base_config

from usp.errors import CheckpointError
from usp.models import PRESETS
from usp.train.config import DataSection, TrainSection, train_config_from_dict
from usp.train.resume import check_resume, compare_runs, run_record
from usp.train.trainer import train

#: the [train] keys whose change alters which data a step sees (written out on purpose)
REFUSED_TRAIN = {"seed", "seq_len", "global_batch", "lora"}  # lora: which model is trained
ROPE = {"rope_theta", "rope_scaling", "max_position_embeddings"}


def job_of(**train):
    return train_config_from_dict(base_config(**train))


def record_of(job, *, model=None, document_multiple=8, files=()):
    model = model if model is not None else PRESETS["tiny"].replace(**job.model.overrides)
    return run_record(job, model, document_multiple, files)


def changed(value):
    """Another value of the same kind (the record is compared, not validated)."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, (int, float)):
        return value + 1
    if isinstance(value, str):
        return value + "-changed"
    if isinstance(value, (list, tuple)):
        return [*value, "changed"]
    if isinstance(value, dict):
        return {**value, "changed": 1}
    return "changed"  # None


def test_every_train_key_is_refused_or_allowed_as_written_out():
    saved = record_of(job_of())
    keys = {f.name for f in dataclasses.fields(TrainSection)}
    assert set(saved["train"]) == keys
    assert keys >= REFUSED_TRAIN
    for key in sorted(keys):
        now = json.loads(json.dumps(saved))
        now["train"][key] = changed(saved["train"][key])
        refused, allowed = compare_runs(saved, now)
        text = f"{key} {saved['train'][key]!r} -> {now['train'][key]!r}"
        if key in REFUSED_TRAIN:
            assert (refused, allowed) == ([text], []), key
        else:
            assert (refused, allowed) == ([], [text]), key


def test_every_data_key_and_every_rope_setting_is_refused():
    saved = record_of(job_of())
    data_keys = {f.name for f in dataclasses.fields(DataSection)}
    data_keys |= {"file_sha256", "document_multiple_used"}  # what the run resolved
    assert set(saved["data"]) == data_keys and set(saved["rope"]) == ROPE
    for section in ("data", "rope"):
        for key in sorted(saved[section]):
            now = json.loads(json.dumps(saved))
            now[section][key] = changed(saved[section][key])
            refused, allowed = compare_runs(saved, now)
            assert len(refused) == 1 and allowed == [], (section, key, refused, allowed)
            assert refused[0].startswith(f"[{section}] {key}: "), refused


@pytest.fixture
def data_file(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"text": "abc"}\n')
    return path


def test_check_resume_names_every_refused_change_and_the_way_out(tmp_path, data_file):
    """From jobs, not dicts: a data file whose content changed (same path), another
    long_documents policy, another resolved document multiple, another rope_theta and
    another global_batch are refused in one message naming each with both values (an
    lr change is only reported); ``--resume-changed`` accepts them and says so."""
    job = job_of()
    model = PRESETS["tiny"].replace(**job.model.overrides)
    saved = record_of(job, model=model, files=[data_file])
    same = json.loads(json.dumps(saved))  # as read back from usp_meta.json
    path = tmp_path / "step_000002"
    meta = {"run": same}
    assert check_resume(meta, record_of(job, model=model, files=[data_file]), path=path,
                        accept_changes=False) is None  # fmt: skip
    data_file.write_text('{"text": "abd"}\n')  # same path, other content
    later = job_of(global_batch=8, lr=1e-3)
    later_data = dataclasses.replace(later.data, long_documents="drop")
    later = dataclasses.replace(later, data=later_data)
    now = record_of(
        later, model=model.replace(rope_theta=model.rope_theta * 2), document_multiple=16,
        files=[data_file],
    )  # fmt: skip
    with pytest.raises(CheckpointError) as err:
        check_resume(meta, now, path=path, accept_changes=False)
    message = str(err.value)
    assert message.startswith(f"--resume from {path}: this run differs from the one that ")
    head, tail = message.split("what a step sees: ")
    refused = tail.split(". Restore")[0].split("; ")
    assert [r.split(":")[0].split(" ")[0] for r in refused] == [
        "[data]", "[data]", "[data]", "[rope]", "global_batch",
    ]  # fmt: skip
    assert refused[0] == "[data] document_multiple_used: 8 -> 16"
    assert refused[1].startswith("[data] file_sha256: ['")
    assert refused[2] == "[data] long_documents: 'truncate' -> 'drop'"
    assert refused[3] == f"[rope] rope_theta: {model.rope_theta!r} -> {model.rope_theta * 2!r}"
    assert refused[4] == "global_batch 4 -> 8"
    assert "--resume-changed" in tail and "lr" not in tail.split(". Restore")[0]
    note = check_resume(meta, now, path=path, accept_changes=True)
    assert note.startswith("accepted with --resume-changed: [data] document_multiple_used")
    assert note.endswith("; changed since the checkpoint: lr 0.003 -> 0.001")


def test_resume_in_one_process_refuses_another_global_batch(tmp_path):
    """``usp train --resume`` (one process): the checkpoint of step 1, then the same run
    with global_batch 8 is refused before any step (no metrics row, the checkpoint
    untouched); with micro_batch 1 instead of 2 (the same data per step) it is reported
    and step 2 trains."""
    out = tmp_path / "run"
    first = train(job_of(steps=1), None, output_dir=out, stream=io.StringIO())
    assert [r["step"] for r in first.metrics] == [1]
    before = sorted(p.name for p in (out / "checkpoints").iterdir())
    with pytest.raises(CheckpointError, match="what a step sees: global_batch 4 -> 8\\. Restore"):
        train(job_of(steps=2, global_batch=8), None, output_dir=out, resume=True,
              stream=io.StringIO())  # fmt: skip
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == before
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 1
    stream = io.StringIO()
    resumed = train(job_of(steps=2, micro_batch=1), None, output_dir=out, resume=True,
                    stream=stream)  # fmt: skip
    assert [r["step"] for r in resumed.metrics] == [2]
    assert "changed since the checkpoint: micro_batch 2 -> 1, steps 1 -> 2" in stream.getvalue()
    assert "the learning-rate schedule is re-planned over 2 steps: step 2 runs at lr" in (
        stream.getvalue()
    )


def test_a_resume_that_changes_the_schedule_says_what_the_next_step_runs_at():
    """``--resume --steps 40`` after a 30-step run: the cosine is re-planned over 40
    steps, so step 31 runs at a higher lr than the one the first run ended with; the note
    gives both (values from the schedule's closed form, not from usp)."""
    import math

    from usp.train.resume import schedule_note

    saved = {"lr": 1e-3, "steps": 30, "warmup_steps": 5, "min_lr_ratio": 0.1}
    longer = dict(saved, steps=40)
    new_lr = 1e-3 * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (30 - 5) / (35 - 1))))
    note = schedule_note(saved, longer, 30)
    assert note == (
        f"the learning-rate schedule is re-planned over 40 steps: step 31 runs at lr "
        f"{new_lr:.3g} (the checkpoint's run ended at step 30 with {1e-4:.3g})"
    )
    mid = schedule_note(saved, dict(saved, lr=2e-3), 10)  # a run not yet ended
    old_lr = 1e-3 * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (10 - 5) / (25 - 1))))
    assert mid.endswith(f"step 11 runs at lr {2 * old_lr:.3g} (the checkpoint's run would "
                        f"have used {old_lr:.3g})")  # fmt: skip
    assert schedule_note(saved, dict(saved, log_interval=5), 10) is None
    assert schedule_note(saved, longer, None) is None  # a record without its step
