"""``usp plan`` says on stderr what it measures (n of m) as it goes, marks the best row,
explains every column of its table in one line and prints the lines to paste and the
longest sequence (the text form: one plan of the one-layer tiny model on one rank; the
JSON form on two ranks, in process and in workers: tests/planner/test_planner.py);
``--quiet`` and ``--set``."""

from __future__ import annotations

import re

from planner_cases import write_config

from usp.cli import main
from usp.planner.report import COLUMNS


def test_progress_best_row_and_columns(tmp_path, capsys):
    path = write_config(tmp_path, gpus=1, layers=1, seq_len=256)
    code = main(
        ["plan", str(path), "--jobs", "1", "--gpu-memory-gib", "0.01", "--set", "train.seq_len=128"]
    )
    out, err = capsys.readouterr()
    assert code == 0, err
    lines = err.strip().splitlines()
    assert re.fullmatch(
        r"usp plan: measuring one rank's training step under fake tensors for (\d+) layouts at "
        r"128 tokens .*", lines[0]
    ), lines[0]  # fmt: skip
    choices = int(re.search(r"for (\d+) layouts", lines[0]).group(1))
    counts = [
        tuple(map(int, re.match(r"  \[(\d+)/(\d+)\] ulysses", line).groups())) for line in lines[1:]
    ]
    assert [done for done, _ in counts] == list(range(1, len(counts) + 1)), "n counts up by one"
    assert all(done <= asked for done, asked in counts) and counts[-1][0] == counts[-1][1]
    assert counts[0][1] == choices, "m starts at the layouts asked for; the search adds more"
    assert len(counts) > choices, "the longest-sequence search's measurements are shown too"
    # the table: the best row (the first, fitting and fastest) marked, every column explained
    table = out[out.index("  # ulysses") :].splitlines()
    rows = [line for line in table[1:] if re.match(r"[ *] *\d+ ", line)]
    assert rows[0].startswith("* 1 ") and not any(r.startswith("*") for r in rows[1:]), rows
    assert "best (* above):" in out
    legend = out[out.index("columns:\n") :].splitlines()[1 : 1 + len(COLUMNS)]
    for (name, _), line in zip(COLUMNS, legend, strict=True):
        assert line.startswith(f"  {name} "), (name, line)
    for column in ("comm GB", "device GiB", "step s (est.)", "tokens/rank", "fits"):
        assert column in table[0] and any(line.startswith(f"  {column} ") for line in legend)
    assert "bytes one rank sends per optimizer step" in out, "what comm GB counts"
    # the best layout's lines to paste, and the longest sequence
    assert "ulysses ring  dp" in out and "paste into the config:" in out
    assert "[parallel]\nulysses = " in out and "activation_checkpointing = " in out
    assert "longest sequence that fits:" in out


def test_quiet_and_json_keep_stderr_for_errors():
    from usp.cli import build_parser

    args = build_parser().parse_args(["plan", "c.toml", "--quiet", "--json"])
    assert args.quiet and args.json and args.sets == []
