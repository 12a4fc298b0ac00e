"""benchmarks/train_emulate.py on CPU at tiny sizes: one rank's whole training step
(FSDP2, USP attention, SP loss, AdamW) under the fake process group, in this process
(which has no default group; the ``distributed`` fixture's ranks are other processes)."""

from __future__ import annotations

import json

import pytest
import torch.distributed as dist

from benchmarks import train_emulate


def test_one_rank_of_a_dp2_sp4_job_with_fewer_layers(tmp_path, capsys):
    out = tmp_path / "row.json"
    row = train_emulate.main(
        ["--preset", "tiny", "--layers", "1", "--seqlen", "256", "--world", "8", "--ulysses", "2",
         "--ring", "2", "--rank", "5", "--repeats", "1", "--peak-tflops", "1", "--json", str(out)]
    )  # fmt: skip
    assert not dist.is_initialized(), "the fake world is torn down"
    assert json.loads(out.read_text()) == row
    assert (row["layers_measured"], row["layers_full"], row["local_tokens"]) == (1, 2, 64)
    assert row["step_s"] > 0 and row["step_s_full"] > row["step_s"], "extrapolated to 2 layers"
    assert row["tokens_per_s_per_gpu"] == pytest.approx(64 / row["step_s_full"])
    assert row["mfu"] == pytest.approx(row["tflops_per_s"] / 1.0)
    text = capsys.readouterr().out
    assert "rank 5 holds 64 tokens" in text and "scaled by FLOPs" in text


def test_contiguous_without_checkpointing_in_bf16():
    row = train_emulate.main(
        ["--preset", "tiny", "--seqlen", "128", "--world", "4", "--ulysses", "1", "--ring", "4",
         "--layout", "contiguous", "--dtype", "bf16", "--no-activation-checkpointing",
         "--warmup", "0", "--repeats", "1"]
    )  # fmt: skip
    assert row["layers_measured"] == row["layers_full"] == 2
    assert row["step_s"] == row["step_s_full"] and row["mfu"] is None  # no peak known on CPU


def test_bad_arguments_are_refused():
    with pytest.raises(SystemExit):
        train_emulate.parse_args(["--preset", "tiny", "--layers", "3"])
    with pytest.raises(SystemExit):
        train_emulate.parse_args(["--world", "6", "--ulysses", "2", "--ring", "2"])
