"""benchmarks/placement.py and benchmarks/length_mix.py: the issue's acceptance mix (90%
of the documents under 4K tokens, a few over 100K) on ulysses 8 x ring 8 at 1M tokens a
step: ``"documents"`` sends at most half the bytes per rank of ``"sequence"`` with the
busiest rank's work within 5% of the mean; the text and JSON outputs; the checks on
the lengths file. Closed forms only: no process group, no device.
"""

from __future__ import annotations

import json

import pytest

from benchmarks import length_mix, placement


@pytest.fixture(scope="module")
def finetune(tmp_path_factory):
    path = tmp_path_factory.mktemp("mix") / "finetune.txt"
    lengths = length_mix.lengths("finetune", 2000)
    assert sum(n < 4096 for n in lengths) == 1800 and sum(n > 100_000 for n in lengths) == 6
    path.write_text("\n".join(map(str, lengths)) + "\n")
    return path


def test_documents_halve_the_bytes_with_balanced_work(finetune, capsys):
    argv = ["--lengths", str(finetune), "--ulysses", "8", "--ring", "8", "--seq-len", "1048576"]
    result = placement.main([*argv, "--json"])
    totals = json.loads(capsys.readouterr().out)
    assert totals == json.loads(json.dumps(result["totals"]))
    seq, doc = totals["sequence"], totals["documents"]
    assert doc["bytes_max"] <= 0.5 * seq["bytes_max"], (doc, seq)
    assert doc["work_max_over_mean"] <= 1.05 and seq["work_max_over_mean"] == pytest.approx(1.0)
    assert doc["bytes_mean"] <= doc["bytes_max"] and doc["step_s"] > 0 and seq["step_s"] > 0
    steps = result["steps"]
    assert len(steps) > 1
    for step in steps:  # every step: every document split by "sequence", a few by "documents"
        assert step["sequence"]["split"] == step["documents_in_step"]
        assert step["documents"]["split"] < step["documents_in_step"]
        for name in placement.PLACEMENTS:
            assert sum(step[name]["tokens"]) == 1048576
    text = placement.text(result)
    assert "documents / sequence: bytes" in text and text.count("documents ") >= len(steps)


def test_another_model_and_its_gated_deltanet_layers():
    """``--model``: Qwen3.5-9B's Gated DeltaNet layers add their traffic (a row of one
    long document: the same split under both placements, the same bytes)."""
    result = placement.measure([65536], ulysses=2, ring=4, seq_len=65536, model="qwen3.5-9b")
    llama = placement.measure([65536], ulysses=2, ring=4, seq_len=65536)
    seq, doc = result["totals"]["sequence"], result["totals"]["documents"]
    assert seq["bytes_max"] == doc["bytes_max"] > 0 and result["model"] == "qwen3.5-9b"
    assert seq["bytes_max"] != llama["totals"]["sequence"]["bytes_max"]


def test_lengths_file_is_checked(tmp_path):
    bad = tmp_path / "bad.txt"
    bad.write_text("12\n-3\n")
    with pytest.raises(SystemExit, match=r"bad.txt:2: expected a document length >= 1"):
        placement.read_lengths(str(bad))
    empty = tmp_path / "empty.txt"
    empty.write_text("\n")
    with pytest.raises(SystemExit, match="no document lengths"):
        placement.read_lengths(str(empty))
    good = tmp_path / "good.txt"
    good.write_text("4\n\n700000\n")
    assert placement.read_lengths(str(good)) == [4, 700000]
    with pytest.raises(SystemExit, match="must be a multiple of 64"):
        placement.measure([4], ulysses=8, ring=8, seq_len=1000)
