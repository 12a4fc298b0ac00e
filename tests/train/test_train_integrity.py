"""Integrity: what ``usp train`` wrote and trusts later (the tokenised-data cache,
checkpoints) is checked before it is used, and its damage ends in one clear message.

- checksums (:mod:`usp.train.checksums`) against an independent computation;
- a damaged token cache (ids permuted, ids overwritten with 0xFF, ``meta.json`` deleted,
  a file cut short, ...) is rebuilt with a note and never trained on: the losses equal
  those of the undamaged run (2 gloo ranks through the trainer);
- the temporary directory of a builder killed with ``kill -9`` is removed by the next
  build;
- one flipped byte in any rank's shard file (not only rank 0's) is the same error on
  every rank (checksums recorded and verified on 4 ranks, files of 4 or 8 writers);
- a checkpoint with 16 flipped bytes in a weight, or a missing or empty ``.metadata``,
  falls back to the previous checkpoint with one message naming the file, and DCP's own
  tracebacks stay off the console (in ``checkpoints/dcp.log``);
- a path usp train writes (``metrics.jsonl``, ...) that is of the wrong kind is one
  start-up error on every rank (exit 2), before the model is built;
- a divergence right after a resume names the step before the loaded checkpoint;
- a SIGTERM during a save stops the run at that checkpoint, without another step;
- the same under torchrun, as a user runs it (two launches).

The job runs on 2 ranks (ulysses 2): what is checked here (files, messages, every rank
agreeing) does not depend on the grid, and a resume on 4 ranks (ulysses 2 x ring 2) is
tested by tests/train/test_train_faults.py; the checksums of every rank's shard are
verified on 4 ranks (files of 4 or 8 writers). Every multi-rank body captures its
process's console (file descriptors 1 and 2): no traceback may reach it.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
import xxhash
from launch_cases import ROOT, free_port, run_agents, torchrun
from usp_cases import topology

from usp.train.checksums import CHUNK_BYTES, checksum_files, file_checksum, find_damage
from usp.train.components import build_plan
from usp.train.config import load_train_config
from usp.train.guard import TrainingDivergedError
from usp.train.lock import check_output_dir
from usp.train.trainer import train, user_errors

TIMEOUT = 240
LAUNCH_TIMEOUT_S = 240
#: the job's ranks (in-process and under torchrun)
RANKS = 2

CONFIG = """
[cluster]
nodes = 1
gpus_per_node = 2

[parallel]
ulysses = 2
ring = 1

[model]
preset = "tiny"

[data]
source = "jsonl"
files = ["train.jsonl"]
tokenizer = "byte"
document_multiple = 8

[train]
steps = 4
global_batch = 4
micro_batch = 2
seq_len = 64
lr = 3e-3
warmup_steps = 1
grad_clip = 0.5
seed = 3
dtype = "float32"
checkpoint_interval = 2
keep_checkpoints = 2
export = false
log_interval = 1
collective_timeout_s = 30        # a rank left waiting fails fast
"""


def write_job(directory: Path) -> Path:
    """The job's config and its JSONL data (text and prompt/completion records)."""
    directory.mkdir(parents=True, exist_ok=True)
    records = [{"text": f"document {i}: " + "abc" * (i % 7 + 3)} for i in range(32)]
    records += [{"prompt": f"q{i}?", "completion": f" a{i}" * 3} for i in range(32)]
    (directory / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (directory / "job.toml").write_text(CONFIG)
    return directory / "job.toml"


# ----------------------------------------------------------------------------- helpers
@contextlib.contextmanager
def console_captured():
    """What this process writes to its stdout and stderr while the block runs (at the
    file-descriptor level: Python's streams, logging's last-resort handler, C++)."""
    box = {"text": ""}
    with tempfile.TemporaryFile() as capture:
        sys.stdout.flush()
        sys.stderr.flush()
        saved = os.dup(1), os.dup(2)
        os.dup2(capture.fileno(), 1)
        os.dup2(capture.fileno(), 2)
        try:
            yield box
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])
            capture.seek(0)
            box["text"] = capture.read().decode("utf-8", "replace")


def run_job(config_path, out, resume=False, steps=None):
    """Body for every rank: the job as ``usp train`` runs it (on a cached ulysses 2
    topology).
    Returns ``(rows, log, error, exit_status, console)``: ``log`` is what rank 0 prints,
    ``error`` the message of an error (None: the run finished), ``exit_status`` the
    status ``usp train`` gives that error (2 for config, data, checkpoint errors)."""
    stream = io.StringIO()
    rows, error, status = [], None, 0
    with console_captured() as console:
        try:
            job = load_train_config(config_path, steps=steps)
            plan = build_plan(job, topology(2, 1))
            result = train(job, plan, output_dir=out, resume=resume, stream=stream)
            rows = [(r["step"], r["loss"], r["grad_norm"]) for r in result.metrics]
        except Exception as err:  # noqa: BLE001 - the message is what is tested
            error = f"{type(err).__name__}: {err}"
            diverged = isinstance(err, TrainingDivergedError)
            status = 3 if diverged else 2 if isinstance(err, user_errors()) else 1
    return rows, stream.getvalue(), error, status, console["text"]


def _assert_quiet(results) -> None:
    for rank, result in enumerate(results):
        console = result[4]
        assert "Traceback" not in console, f"rank {rank}'s console:\n{console}"


@pytest.fixture(scope="module")
def clean_run(distributed, tmp_path_factory):
    """The job run once, undamaged: checkpoints at steps 2 and 4, the token cache."""
    tmp = tmp_path_factory.mktemp("integrity")
    config = write_job(tmp / "job")
    out = tmp / "clean"
    results = distributed.run(run_job, str(config), str(out), world_size=RANKS, timeout=TIMEOUT)
    rows, _, error, _, _ = results[0]
    assert error is None, error
    assert [r[0] for r in rows] == [1, 2, 3, 4]
    _assert_quiet(results)
    return config, out, rows


# ----------------------------------------------------------------------------- checksums
def _independent_checksum(data: bytes) -> str:
    chunks = [data[i : i + (16 << 20)] for i in range(0, len(data), 16 << 20)]
    digests = b"".join(xxhash.xxh3_64_digest(c) for c in chunks)
    return hashlib.sha256(digests).hexdigest()


def test_checksums_match_an_independent_computation_and_find_damage(tmp_path):
    assert CHUNK_BYTES == 16 << 20
    data = os.urandom((16 << 20) * 2 + 12345)  # three chunks, the last one short
    (tmp_path / "big").write_bytes(data)
    (tmp_path / "empty").write_bytes(b"")
    (tmp_path / "small").write_bytes(b"usp")
    one = checksum_files([tmp_path / n for n in ("big", "empty", "small")], threads=1)
    three = checksum_files([tmp_path / n for n in ("big", "empty", "small")], threads=3)
    assert one == three, "the thread count does not change a checksum"
    assert one[0] == {"bytes": len(data), "xxh3": _independent_checksum(data)}
    assert one[1] == {"bytes": 0, "xxh3": hashlib.sha256(b"").hexdigest()}
    assert one[2]["xxh3"] == _independent_checksum(b"usp")
    recorded = {"big": one[0], "small": one[2]}
    assert find_damage(tmp_path, recorded) is None
    flipped = bytearray(data)
    flipped[(16 << 20) + 7] ^= 0x01  # one bit in the second chunk
    (tmp_path / "big").write_bytes(bytes(flipped))
    assert find_damage(tmp_path, recorded, threads=2) == (
        "big does not match the checksum recorded when it was written (its bytes changed since)"
    )
    (tmp_path / "small").write_bytes(b"us")
    assert find_damage(tmp_path, recorded) == "small has 2 bytes, 3 when it was written"
    (tmp_path / "small").unlink()
    assert find_damage(tmp_path, recorded) == "small is missing"
    assert file_checksum(tmp_path / "empty") == one[1]


def run_checksums_of_every_rank(directory, writers):
    """Record the checksums of ``writers`` ranks' shard files (and ``.metadata``) on
    this world, then damage each file in turn (one flipped byte) and verify: returns
    {file: the error every rank raised}. A 20 s world timeout: a rank skipping the
    agreement fails fast."""
    from datetime import timedelta
    from types import SimpleNamespace

    from usp.train.checkpoint_integrity import record_checksums, verify_checksums

    directory = Path(directory)
    rank = torch.distributed.get_rank()
    names = [f"__{w}_0.distcp" for w in range(writers)]
    if rank == 0:
        for index, name in enumerate([*names, ".metadata"]):
            (directory / name).write_bytes(bytes([index]) * 4096)
    torch.distributed.barrier()
    metadata = SimpleNamespace(
        storage_data={i: SimpleNamespace(relative_path=n) for i, n in enumerate(names)}
    )
    torch.distributed.group.WORLD.set_timeout(timedelta(seconds=20))
    errors = {}
    try:
        recorded, _ = record_checksums(directory, metadata)
        recorded = [recorded]
        torch.distributed.broadcast_object_list(recorded, src=0)
        assert sorted(recorded[0]["files"]) == sorted([*names, ".metadata"])
        verify_checksums(directory, recorded[0])  # undamaged: no error anywhere
        for name in [*names, ".metadata"]:
            path = directory / name
            data = path.read_bytes()
            torch.distributed.barrier()
            if rank == 0:
                path.write_bytes(data[:100] + bytes([data[100] ^ 0x01]) + data[101:])
            torch.distributed.barrier()
            try:
                verify_checksums(directory, recorded[0])
                errors[name] = "no error"
            except Exception as err:  # noqa: BLE001 - the test compares type and text
                errors[name] = f"{type(err).__name__}: {err}"
            torch.distributed.barrier()
            if rank == 0:
                path.write_bytes(data)
    finally:
        torch.distributed.group.WORLD.set_timeout(timedelta(seconds=600))  # the harness's
    return errors


@pytest.mark.parametrize("writers", [4, 8], ids=["4-writers", "8-writers"])
def test_a_flipped_byte_in_any_ranks_shard_is_found_on_every_rank(distributed, tmp_path, writers):
    """Every rank's shard files are verified, not only those rank 0 reads: one flipped
    byte in any file (each rank's shard, ``.metadata``) is one CheckpointDamagedError
    naming that file on all 4 ranks; also for a checkpoint written by 8 ranks."""
    results = distributed.run(
        run_checksums_of_every_rank, str(tmp_path), writers, world_size=4, timeout=120
    )
    names = [f"__{w}_0.distcp" for w in range(writers)] + [".metadata"]
    for name in names:
        seen = {errors[name] for errors in results}
        assert len(seen) == 1, (name, seen)  # the same error on every rank
        error = seen.pop()
        assert error.startswith("CheckpointDamagedError: "), (name, error)
        assert f"{name} does not match the checksum recorded when it was written" in error


# ----------------------------------------------------------------------------- token cache
def _cache_of(out: Path) -> Path:
    (directory,) = [p for p in (out / "cache").iterdir() if p.name.startswith("tokens-")]
    return directory


def _damage_cache(directory: Path, how: str) -> None:
    tokens = directory / "tokens.i32"
    if how == "ids permuted":  # same size, every id still in range
        ids = torch.from_file(str(tokens), size=tokens.stat().st_size // 4, dtype=torch.int32)
        order = torch.randperm(ids.numel(), generator=torch.Generator().manual_seed(0))
        assert not torch.equal(ids[order], ids)
        tokens.write_bytes(ids[order].clone().numpy().tobytes())
    elif how == "ids 0xFF":  # every id -1
        tokens.write_bytes(b"\xff" * tokens.stat().st_size)
    elif how == "meta.json deleted":
        (directory / "meta.json").unlink()
    elif how == "tokens cut short":
        tokens.write_bytes(tokens.read_bytes()[:100])


CACHE_DAMAGE = {
    "ids permuted": "tokens.i32 does not match the checksum recorded when it was written",
    "ids 0xFF": "tokens.i32 does not match the checksum recorded when it was written",
    "meta.json deleted": "no meta.json: a crashed build, or damaged",
}


@pytest.mark.parametrize("how", sorted(CACHE_DAMAGE))
def test_a_damaged_token_cache_is_rebuilt_and_never_trained_on(
    distributed, tmp_path, clean_run, how
):
    config, clean, rows = clean_run
    out = tmp_path / "run"
    shutil.copytree(clean / "cache", out / "cache")  # a new run over the same data
    directory = _cache_of(out)
    _damage_cache(directory, how)
    results = distributed.run(run_job, str(config), str(out), world_size=RANKS, timeout=TIMEOUT)
    _assert_quiet(results)
    assert all(r[2] is None for r in results), [r[2] for r in results]
    log = results[0][1]
    note = f"the tokenised data cache {directory} was damaged ({CACHE_DAMAGE[how]}"
    assert log.count(note) == 1, log
    assert "rebuilt from the data" in log, log
    assert [r[0] for r in results] == [rows] * RANKS, "the losses of the undamaged data, exactly"
    assert _cache_of(out) == directory and (directory / "meta.json").is_file()


def test_a_damaged_cache_in_one_process_is_rebuilt_with_a_note(tmp_path):
    from usp.train.data import ByteTokenizer
    from usp.train.data.build import DataInputs, build_corpus

    config = write_job(tmp_path / "job")
    inputs = DataInputs(
        ByteTokenizer(), (config.parent / "train.jsonl",), 64, "truncate", 1, 0, True
    )
    root = tmp_path / "cache"
    # a copy: the damage below rewrites the file the first corpus maps
    reference = build_corpus(inputs, cache_root=root).corpus.tokens.clone()
    directory = _cache_of(tmp_path)
    for how in ("tokens cut short", "ids permuted"):
        _damage_cache(directory, how)
        again = build_corpus(inputs, cache_root=root)
        assert again.notes[0].startswith(f"the tokenised data cache {directory} was damaged ")
        assert torch.equal(again.corpus.tokens, reference), how
    (directory / "meta.json").write_text("{")
    assert "meta.json is not readable" in build_corpus(inputs, cache_root=root).notes[0]
    shutil.rmtree(directory)
    directory.write_text("a file where the cache goes")
    again = build_corpus(inputs, cache_root=root)
    assert "(not a directory)" in again.notes[0] and directory.is_dir()
    assert torch.equal(again.corpus.tokens, reference)


def test_a_damaged_cache_that_cannot_be_removed_is_one_clear_error(tmp_path, monkeypatch):
    from usp.train.data import ByteTokenizer, DataError
    from usp.train.data import corpus as corpus_module
    from usp.train.data.build import DataInputs, build_corpus

    config = write_job(tmp_path / "job")
    inputs = DataInputs(
        ByteTokenizer(), (config.parent / "train.jsonl",), 64, "truncate", 1, 0, True
    )
    build_corpus(inputs, cache_root=tmp_path / "cache")
    directory = _cache_of(tmp_path)
    _damage_cache(directory, "ids 0xFF")

    def refused(path, *args, **kwargs):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(corpus_module.shutil, "rmtree", refused)  # (root ignores modes)
    with pytest.raises(DataError) as caught:
        build_corpus(inputs, cache_root=tmp_path / "cache")
    assert str(caught.value) == (
        f"the tokenised data cache {directory} is damaged (tokens.i32 does not match the "
        "checksum recorded when it was written (its bytes changed since)) and cannot be "
        "removed (Permission denied); delete it and start again (it is rebuilt from the data "
        "files)"
    )


DYING_BUILDER = """
import sys, time
from pathlib import Path
from usp.train.data import ByteTokenizer
from usp.train.data import corpus
from usp.train.data.build import DataInputs, build_corpus

written = corpus._write_raw
def write_then_hang(path, tensor):
    written(path, tensor)
    print("writing", flush=True)
    time.sleep(600)  # killed here, half-way through writing its temporary directory
corpus._write_raw = write_then_hang
inputs = DataInputs(ByteTokenizer(), (Path(sys.argv[1]),), 64, "truncate", 1, 0, True)
build_corpus(inputs, cache_root=Path(sys.argv[2]))
"""


def test_a_killed_builders_temporary_directory_is_removed_by_the_next_build(tmp_path):
    from usp.train.data import ByteTokenizer
    from usp.train.data.build import DataInputs, build_corpus

    config = write_job(tmp_path / "job")
    data, root = config.parent / "train.jsonl", tmp_path / "cache"
    builder = subprocess.Popen(
        [sys.executable, "-c", DYING_BUILDER, str(data), str(root)],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert builder.stdout.readline() == "writing\n"
    finally:
        builder.kill()  # kill -9
        builder.wait()
    (left,) = root.iterdir()
    assert left.name.startswith(".tokens-") and left.name.endswith(f".{builder.pid}"), left
    host = socket.gethostname()
    alive = root / f".tokens-0123abcd.{host}.{os.getpid()}"  # this process: alive
    elsewhere = root / ".tokens-0123abcd.node-17.cluster.4242"  # another host: unknown
    for keep in (alive, elsewhere):
        keep.mkdir()
    inputs = DataInputs(ByteTokenizer(), (data,), 64, "truncate", 1, 0, True)
    built = build_corpus(inputs, cache_root=root)
    assert built.notes[0] == (
        f"removed {left}, the temporary directory of a cache build that died (pid {builder.pid})"
    )
    names = sorted(p.name for p in root.iterdir())
    assert names == sorted([alive.name, elsewhere.name, _cache_of(tmp_path).name]), names


# ----------------------------------------------------------------------------- checkpoints
def _flip_weight_bytes(checkpoint: Path) -> str:
    """XOR 16 bytes in the middle of a weight's stored bytes; returns the file's name."""
    from torch.distributed.checkpoint import FileSystemReader

    storage = FileSystemReader(str(checkpoint)).read_metadata().storage_data
    index, info = max(
        ((i, s) for i, s in storage.items() if i.fqn.startswith("model.")),
        key=lambda item: item[1].length,
    )
    assert index.fqn.endswith("weight"), index.fqn
    path = checkpoint / info.relative_path
    data = bytearray(path.read_bytes())
    middle = info.offset + info.length // 2
    for i in range(middle, middle + 16):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))
    return info.relative_path


def _copy(clean: Path, tmp_path: Path) -> Path:
    out = tmp_path / "run"
    shutil.copytree(clean, out)
    return out


def test_flipped_bytes_in_a_weight_fall_back_to_the_previous_checkpoint(
    distributed, tmp_path, clean_run
):
    config, clean, rows = clean_run
    out = _copy(clean, tmp_path)
    newest = out / "checkpoints" / "step_000004"
    name = _flip_weight_bytes(newest)
    results = distributed.run(
        run_job, str(config), str(out), True, world_size=RANKS, timeout=TIMEOUT
    )
    _assert_quiet(results)
    assert all(r[2] is None for r in results), [r[2] for r in results]
    log = results[0][1]
    assert log.count("cannot be loaded") == 1, log
    assert f"checkpoint {newest} cannot be loaded (checking the files of step_000004 " in log
    assert f"{name} does not match the checksum recorded when it was written" in log, log
    assert "resuming from step_000002 instead" in log, log
    assert results[0][0] == rows[2:], "steps 3 and 4 from step 2's checkpoint, exactly"


@pytest.mark.parametrize("how", ["missing", "empty"])
def test_a_missing_or_empty_metadata_file_is_one_message(distributed, tmp_path, clean_run, how):
    config, clean, rows = clean_run
    out = _copy(clean, tmp_path)
    metadata = out / "checkpoints" / "step_000004" / ".metadata"
    metadata.unlink() if how == "missing" else metadata.write_bytes(b"")
    results = distributed.run(
        run_job, str(config), str(out), True, world_size=RANKS, timeout=TIMEOUT
    )
    _assert_quiet(results)
    log = results[0][1]
    expected = ".metadata is missing" if how == "missing" else ".metadata has 0 bytes"
    assert log.count("cannot be loaded") == 1 and expected in log, log
    assert results[0][0] == rows[2:]


def test_dcp_tracebacks_of_a_checkpoint_without_checksums_go_to_its_log(
    distributed, tmp_path, clean_run
):
    """An older checkpoint (no checksums recorded) with an empty ``.metadata``: DCP
    itself fails, logging a traceback per rank and attempt; they go to dcp.log."""
    config, clean, rows = clean_run
    out = _copy(clean, tmp_path)
    newest = out / "checkpoints" / "step_000004"
    meta = json.loads((newest / "usp_meta.json").read_text())
    del meta["checksums"]
    (newest / "usp_meta.json").write_text(json.dumps(meta))
    (newest / ".metadata").write_bytes(b"")
    results = distributed.run(
        run_job, str(config), str(out), True, world_size=RANKS, timeout=TIMEOUT
    )
    _assert_quiet(results)
    log = results[0][1]
    dcp_log = out / "checkpoints" / "dcp.log"
    assert log.count("cannot be loaded") == 1, log
    assert f"(DCP's messages: {dcp_log})" in log, log
    assert "Traceback" not in log, log
    text = dcp_log.read_text()
    assert "Global metadata is not found" in text and "Traceback" in text, text
    assert all(f"[rank {r}] " in text for r in range(RANKS)), text
    assert results[0][0] == rows[2:]


# ----------------------------------------------------------------------------- divergence
def run_diverging_after_resume(config_path, out, steps):
    """rank 1's first gradient norm of the run is NaN."""
    original = torch.nn.utils.clip_grad_norm_
    calls = {"n": 0}

    def patched(params, max_norm, *args, **kwargs):
        calls["n"] += 1
        norm = original(params, max_norm, *args, **kwargs)
        if calls["n"] == 1 and torch.distributed.get_rank() == 1:
            return torch.full((), float("nan"))
        return norm

    torch.nn.utils.clip_grad_norm_ = patched
    try:
        return run_job(config_path, out, True, steps)
    finally:
        torch.nn.utils.clip_grad_norm_ = original


@pytest.mark.parametrize("newest", ["loads", "damaged"])
def test_a_divergence_after_a_resume_names_the_step_before_it(
    distributed, tmp_path, clean_run, newest
):
    """Diverged at the first step after loading: --resume would load the same checkpoint
    again, so the message says which step to resume from (with the newest damaged, the
    run loaded step 2, and there is none before it)."""
    config, clean, _ = clean_run
    out = _copy(clean, tmp_path)
    if newest == "damaged":
        _flip_weight_bytes(out / "checkpoints" / "step_000004")
    results = distributed.run(
        run_diverging_after_resume, str(config), str(out), 6, world_size=RANKS, timeout=TIMEOUT
    )
    _assert_quiet(results)
    messages = {r[2] for r in results}
    assert len(messages) == 1, messages
    (message,) = messages
    assert {r[3] for r in results} == {3}, "diverged: exit 3"
    assert "(--resume continues from it)" not in message, message
    assert "--resume would load it again" in message, message
    if newest == "loads":
        loaded = out / "checkpoints" / "step_000004"
        assert "This run started from step_000004 and saved no checkpoint since" in message
        assert f"To resume from step 2 (step_000002) instead, move {loaded} out of the way" in (
            message
        )
    else:
        assert "This run started from step_000002 and saved no checkpoint since" in message
        assert "there is no earlier checkpoint: start again in another --output" in message


# ----------------------------------------------------------------------------- output paths
def test_a_metrics_file_that_is_a_directory_is_one_start_up_error(distributed, tmp_path, clean_run):
    config, _, _ = clean_run
    out = tmp_path / "run"
    (out / "metrics.jsonl").mkdir(parents=True)
    # (it used to fail rank 0 alone, after the model was built: the others hung)
    results = distributed.run(run_job, str(config), str(out), world_size=RANKS, timeout=60)
    _assert_quiet(results)
    assert len({r[2] for r in results}) == 1 and {r[3] for r in results} == {2}
    message = results[0][2]
    assert message == (
        "ConfigError: usp train set-up failed on ranks 0, 1 of 2: "
        f"{out / 'metrics.jsonl'} is a directory, but usp train writes its "
        "metrics there (a file): move it away, or choose another --output directory"
    )
    assert results[0][1] == "", "nothing was built or printed"
    assert not (out / "cache").exists()


@pytest.mark.parametrize(
    "name, make, shown",
    [
        ("checkpoints", "file", "a file"),
        ("cache", "file", "a file"),
        ("loss.png", "directory", "a directory"),
        (".usp.lock", "directory", "a directory"),
        ("hf", "file", "a file"),
    ],
)
def test_every_output_path_of_the_wrong_kind_is_refused(tmp_path, name, make, shown):
    from usp.config import ConfigError

    path = tmp_path / name
    path.mkdir() if make == "directory" else path.write_text("")
    with pytest.raises(ConfigError, match=f"{path} is {shown}, but usp train writes .*--output"):
        check_output_dir(tmp_path)
    if name == "hf":
        check_output_dir(tmp_path, export=False)  # not written without the export


# ----------------------------------------------------------------------------- SIGTERM
def run_signalled_during_a_save(config_path, out, rank_signalled):
    """Rank ``rank_signalled`` gets SIGTERM while the step-2 checkpoint is being saved."""
    from usp.train import checkpoint

    original = checkpoint.record_checksums  # runs after DCP wrote the shards

    def signalled(directory, metadata):
        if directory.name == "step_000002" and torch.distributed.get_rank() == rank_signalled:
            os.kill(os.getpid(), signal.SIGTERM)
        return original(directory, metadata)

    checkpoint.record_checksums = signalled
    try:
        job = load_train_config(config_path)
        plan = build_plan(job, topology(2, 1))
        result = train(job, plan, output_dir=out, stream=io.StringIO())
    finally:
        checkpoint.record_checksums = original
    return result.stopped_by, result.stopped_at, str(result.checkpoint), len(result.metrics)


def test_sigterm_during_a_save_stops_at_that_checkpoint(distributed, tmp_path, clean_run):
    config, _, _ = clean_run
    out = tmp_path / "run"
    results = distributed.run(
        run_signalled_during_a_save, str(config), str(out), 1, world_size=RANKS, timeout=TIMEOUT
    )
    assert results[1][0] == "SIGTERM"
    assert {r[0] for r in results[:1]} == {"a signal on another rank"}
    assert {r[1:] for r in results} == {(2, str(out / "checkpoints" / "step_000002"), 2)}
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2], "no step after the save"
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_000002"]


# ----------------------------------------------------------------------------- torchrun
def _usp_train(config: Path, out: Path, *flags: str) -> list[str]:
    port = free_port()
    return torchrun(
        "--nproc-per-node", str(RANKS), "--master-addr", "127.0.0.1", "--master-port", str(port),
        "--shutdown-timeout", "60",
        "-m", "usp", "train", str(config), "--output", str(out), "--device", "cpu", *flags,
    )  # fmt: skip


def test_under_torchrun_damage_is_reported_and_repaired_without_a_traceback(tmp_path, clean_run):
    """One resume launch meets a permuted token cache, 16 flipped bytes in the newest
    checkpoint and a dead builder's temporary directory; a second launch, at the same time
    (its own output directory and port: the two share nothing, and the refusal's start-up
    overlaps the resume's), meets a metrics.jsonl that is a directory."""
    config, clean, rows = clean_run
    out = _copy(clean, tmp_path)
    cache = _cache_of(out)
    _damage_cache(cache, "ids permuted")
    name = _flip_weight_bytes(out / "checkpoints" / "step_000004")
    dead = out / "cache" / f".{cache.name}.{socket.gethostname()}.{_dead_pid()}"
    dead.mkdir()
    bad = tmp_path / "bad"
    (bad / "metrics.jsonl").mkdir(parents=True)
    launches = [_usp_train(config, out, "--resume"), _usp_train(config, bad)]
    result, refusal = run_agents(launches, tmp_path, LAUNCH_TIMEOUT_S)
    text = result.stdout
    assert result.returncode == 0, text
    assert "Traceback" not in text, text
    assert f"removed {dead}, the temporary directory of a cache build that died" in text, text
    assert f"the tokenised data cache {cache} was damaged (tokens.i32 does not match" in text
    assert f"{name} does not match the checksum recorded when it was written" in text, text
    assert "resuming from step_000002 instead" in text, text
    assert "note: checkpoints: 1 saved, the slowest " in text, "what --shutdown-timeout needs"
    assert "torchrun's --shutdown-timeout must cover one step plus one save" in text, text
    logged = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in logged] == [1, 2, 3, 4]
    for row, (step, loss, _) in zip(logged[2:], rows[2:]):
        assert abs(row["loss"] - loss) <= 1e-6 * abs(loss), (step, row["loss"], loss)
    assert not dead.exists()

    text = refusal.stdout
    assert refusal.returncode != 0
    # printed once per node; torchrun's failure table (after its first "=====" line)
    # repeats usp's line per failed rank, from the error file (usp.train.error_file)
    printed = text.split("\n" + "=" * 20)[0]
    assert printed.count(f"{bad / 'metrics.jsonl'} is a directory") == 1, "once per node"
    assert "To enable traceback" not in text, text
    # every rank exits 2, or is stopped by torchrun (SIGTERM) once the first one did
    codes = re.findall(r"exitcode  : (-?\d+) \(pid", text)
    assert "2" in codes and set(codes) <= {"2", "-15"}, text
    assert f'File "{ROOT / "usp"}' not in text, "no usp traceback (torchrun prints its own)"


def _dead_pid() -> int:
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid
