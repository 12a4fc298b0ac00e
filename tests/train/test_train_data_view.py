"""``usp data CONFIG``: the rows the trainer would see (its pipeline, its cache), decoded,
the trained spans marked -- for chat records exactly the assistant turns -- with the counts
per file. One process, with a Llama-3-style tokenizer built in the test."""

from __future__ import annotations

import json

import pytest
from chat_cases import CONVERSATIONS, assistant_texts, write_chat_tokenizer

from usp.cli import main
from usp.train import components
from usp.train.config import load_train_config
from usp.train.data import DataLoader
from usp.train.preflight import grid_of

pytest.importorskip("tokenizers", reason="the test builds a tokenizer.json with tokenizers")
pytest.importorskip("jinja2", reason="chat templates are rendered with jinja2")

BOS, EOT = "<|begin_of_text|>", "<|eot_id|>"
TEXTS = [{"text": "Hello, world!"}, {"prompt": "Say hello", "completion": " to the world"}]
JOB = """
[cluster]
nodes = 1
gpus_per_node = 2
[parallel]
ulysses = 1
ring = 2
[model]
preset = "tiny"
[model.overrides]
vocab_size = {vocab}
[data]
files = ["chat.jsonl", "text.jsonl"]
tokenizer = "model"
shuffle = false
[train]
steps = 1
global_batch = 2
seq_len = 128
"""


def rendered_by_hand(conversation) -> str:
    """The Llama-3 format written out (independent of the template)."""
    turns = "".join(
        f"<|start_header_id|>{m['role']}<|end_header_id|>\n\n{m['content'].strip()}{EOT}"
        for m in conversation
    )
    return BOS + turns


@pytest.fixture
def job_file(tmp_path):
    ids = write_chat_tokenizer(tmp_path / "model")
    (tmp_path / "chat.jsonl").write_text(
        "".join(json.dumps({"messages": c}) + "\n" for c in CONVERSATIONS)
    )
    (tmp_path / "text.jsonl").write_text("".join(json.dumps(r) + "\n" for r in TEXTS))
    path = tmp_path / "job.toml"
    path.write_text(JOB.format(vocab=ids["vocab_size"]))
    return path


def data_json(capsys, *argv):
    code = main(["data", *map(str, argv), "--json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    return json.loads(out)


def test_chat_rows_show_the_assistant_turns_as_the_trained_spans(job_file, tmp_path, capsys):
    out = tmp_path / "out"
    view = data_json(capsys, job_file, "--rows", 3, "--output", out)
    assert view["document_multiple"] == 4, "zigzag on a ring of 2: the trainer's multiple"
    files = {f["file"].rsplit("/", 1)[-1]: f for f in view["files"]}
    assert files["chat.jsonl"]["records"] == 3 and files["chat.jsonl"]["documents"] == 3
    assert files["text.jsonl"]["records"] == 2 and files["text.jsonl"]["documents"] == 2
    seen = {}
    for row in view["rows"]:
        for doc in row["documents"]:
            seen.setdefault(doc["corpus_index"], doc)
        assert row["trained_tokens"] == sum(d["trained_tokens"] for d in row["documents"])
        assert row["tokens"] == 128 and row["padding"] == 128 - sum(
            d["tokens"] for d in row["documents"]
        )
    assert sorted(seen) == [0, 1, 2, 3, 4], "shuffle = false: the files' order, all shown"
    for index, conversation in enumerate(CONVERSATIONS):
        spans = seen[index]["spans"]
        assert "".join(s["text"] for s in spans) == rendered_by_hand(conversation)
        trained = [s["text"] for s in spans if s["trained"]]
        assert trained == assistant_texts(conversation), "exactly the assistant turns"
    text, pair = seen[3]["spans"], seen[4]["spans"]
    assert [s["trained"] for s in text] == [False, True], "text: all but the first token"
    assert [s["text"] for s in pair if s["trained"]] == [f" to the world{EOT}"]
    total = sum(d["trained_tokens"] for d in seen.values())
    assert view["totals"]["trained_tokens"] == total
    assert total == sum(f["trained_tokens"] for f in view["files"]), "per-file counts add up"

    # the trainer's own loader, on the cache usp data built, sees the same labels
    job = load_train_config(job_file, output_dir=str(out))
    resolved = components.topology_config(job).resolve()
    multiple = components.check_lengths(job, grid_of(resolved))
    inputs = components.prepare_data(job, components.model_source(job), multiple)
    dataset = components.load_dataset(job, inputs, cache_root=out / "cache")
    assert any("tokenised data reused from" in note for note in dataset.notes), dataset.notes
    step = DataLoader(dataset, global_batch=2, micro_batch=1, dp_degree=1, dp_rank=0).next_step()
    for row, micro in zip(view["rows"][:2], step.micro_batches, strict=True):
        assert (row["step"], row["dp_replica"]) == (1, 0)
        assert row["trained_tokens"] == micro.num_labels
    assert [r["micro_batch"] for r in view["rows"][:2]] == [0, 1]


def test_text_view_marks_spans_and_counts_files(job_file, tmp_path, capsys):
    code = main(["data", str(job_file), "--rows", "1", "--output", str(tmp_path / "out")])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert f"\u27e6Paris is the capital.{EOT}\u27e7" in out
    assert "chat.jsonl: 3 records -> 3 documents" in out
    assert "row 0 (step 1, dp replica 0, micro-batch 0)" in out
    # --set reaches usp data; a long prompt split into pieces: the untrained ones dropped
    long = {"prompt": "Say hello " * 30, "completion": " world"}
    (tmp_path / "text.jsonl").write_text(json.dumps(long) + "\n")
    view = data_json(
        capsys, job_file, "--output", tmp_path / "out", "--set", "data.long_documents=split",
        "--set", "train.seq_len=64",
    )  # fmt: skip
    notes = " ".join(view["notes"])
    assert "split into" in notes and "of them dropped, no trained token in them" in notes, notes
    files = {f["file"].rsplit("/", 1)[-1]: f for f in view["files"]}
    assert files["text.jsonl"]["records"] == 1 and files["text.jsonl"]["documents"] == 1


def test_documents_placement_shows_where_each_document_goes(job_file, tmp_path, capsys):
    """``[parallel] token_placement = "documents"``: each document (and the padding
    document) names the SP rank that computes it whole, or says it is split; the
    default placement adds nothing."""
    out = tmp_path / "out"
    # short documents (a few tokens each) and a longer one: some stay whole
    rows = [{"text": "Hi."}] * 9 + [{"text": "Hello, world! " * 4}]
    (tmp_path / "short.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    files = ("--set", f'data.files=["{tmp_path / "short.jsonl"}"]')
    plain = data_json(capsys, job_file, "--rows", 1, "--output", out, *files)
    assert plain["token_placement"] == "sequence"
    assert all("placed" not in d for d in plain["rows"][0]["documents"])
    setting = (*files, "--set", "parallel.token_placement=documents")
    view = data_json(capsys, job_file, "--rows", 1, "--output", out, *setting)
    assert view["token_placement"] == "documents" and view["sp"] == 2
    for row in view["rows"]:
        places = [d["placed"] for d in row["documents"]] + row["padding_placed"]
        assert set(places) <= {"split", 0, 1} and {0, 1} <= set(places), places
    code = main(["data", str(job_file), "--rows", "1", "--output", str(out), *setting])
    text = capsys.readouterr().out
    assert code == 0 and "[whole on SP rank 0]" in text and "[whole on SP rank 1]" in text
    assert "token_placement 'documents' over 2 SP ranks" in text


def test_errors_exit_2(job_file, capsys):
    assert main(["data", str(job_file), "--set", "data.files=missing.jsonl"]) == 2
    assert "usp data: error:" in capsys.readouterr().err


def test_an_auto_cluster_is_the_grids_own_world_or_the_world_size(job_file, tmp_path, capsys):
    """``gpus_per_node = "auto"`` (the launch's) without a launch: the grid's own world
    (ulysses 1 x ring 2, dp auto: 2 ranks, dp 1), or ``--world-size 4`` (dp 2); a grid
    that leaves the world open too is one error naming flags usp data has."""
    from cli_flags import assert_flags_are_the_commands

    text = job_file.read_text().replace("gpus_per_node = 2", 'gpus_per_node = "auto"')
    job_file.write_text(text)
    out = tmp_path / "out"
    assert data_json(capsys, job_file, "--output", out)["dp"] == 1
    assert data_json(capsys, job_file, "--output", out, "--world-size", "4")["dp"] == 2
    job_file.write_text(text.replace("ring = 2", 'ring = "auto"'))
    assert main(["data", str(job_file), "--output", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("usp data: error: ") and "Traceback" not in err, err
    assert 'gpus_per_node = "auto" is taken from the launch' in err, err
    assert assert_flags_are_the_commands(err, "data") == {"--world-size", "--set"}
    assert data_json(capsys, job_file, "--output", out, "--world-size", "2")["dp"] == 1
