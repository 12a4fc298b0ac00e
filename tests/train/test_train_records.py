"""Training records: the ``long_documents`` policy, ``input_ids`` + ``labels``, ambiguous
records, data-file errors (file and line), ``files`` globs. Single process."""

from __future__ import annotations

import json
import sys

import pytest
import torch

from usp.models import PRESETS
from usp.train.data import (
    ByteTokenizer,
    DataError,
    Document,
    LengthReport,
    PackedDataset,
    build_tokenizer,
    fit_document,
    micro_batch_of,
    read_jsonl,
    resolve_files,
)

TOK = ByteTokenizer()


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def pair(prompt_len: int, completion_len: int) -> Document:
    """BOS, prompt tokens 10.., completion tokens 200.., EOS (as a prompt/completion record)."""
    tokens = [TOK.bos_id, *range(10, 10 + prompt_len), *range(200, 200 + completion_len)]
    tokens.append(TOK.eos_id)
    target = [False] * (1 + prompt_len) + [True] * (completion_len + 1)
    return Document(torch.tensor(tokens), torch.tensor(target))


# ----------------------------------------------------------------------------- long documents
def test_truncate_cuts_the_prompt_start_and_keeps_the_completion():
    report = LengthReport("truncate", 32)
    doc = pair(100, 10)  # 112 tokens, 11 trained (10 + EOS)
    (kept,) = fit_document(doc, report, where="x")
    assert len(kept) == 32
    assert kept.tokens[0] == TOK.bos_id, "the first token (BOS) stays"
    assert torch.equal(kept.tokens[1:], doc.tokens[-31:]), "then the document's last 31 tokens"
    assert int(kept.target.sum()) == 11, "the whole completion and its EOS are trained"
    assert (report.too_long, report.cut_start, report.cut_end, report.longest) == (1, 1, 0, 112)
    # through packing: every completion token is a label
    ds = PackedDataset([kept], seq_len=32, document_multiple=4, pad_id=0, seed=0, shuffle=False)
    labels = micro_batch_of([ds.sequence(0)]).labels[0]
    assert sorted(labels[labels != -100].tolist()) == sorted([*range(200, 210), TOK.eos_id])


def test_truncate_cuts_the_end_when_the_trained_part_does_not_fit():
    report = LengthReport("truncate", 16)
    text = Document(torch.arange(4, 54), torch.ones(50, dtype=torch.bool))
    (kept,) = fit_document(text, report, where="x")
    assert kept.tokens.tolist() == list(range(4, 20)), "plain text: its first 16 tokens"
    long_answer = pair(5, 30)  # the completion alone is longer than seq_len - 1
    (kept,) = fit_document(long_answer, report, where="x")
    assert torch.equal(kept.tokens, long_answer.tokens[:16]) and int(kept.target.sum()) == 10
    all_prompt = pair(40, 30)  # the first 16 tokens are all prompt: nothing left to train
    assert fit_document(all_prompt, report, where="x") == []
    assert (report.too_long, report.cut_start, report.cut_end, report.emptied) == (3, 0, 3, 1)
    assert "1 dropped, no trained token left" in report.describe()


def test_split_drop_and_error():
    doc = pair(40, 5)  # 47 tokens: 41 of prompt, then 5 + EOS trained
    split = LengthReport("split", 16)
    (piece,) = fit_document(doc, split, where="x")
    assert torch.equal(piece.tokens, doc.tokens[32:]), "the one piece with a trained token"
    assert (split.pieces, split.emptied) == (3, 2), "two prompt-only pieces dropped, counted"
    assert split.describe().endswith(
        "split into 3 pieces of at most 16; 2 of them dropped, no trained token in them"
    )
    text = Document(torch.arange(4, 51), torch.ones(47, dtype=torch.bool))
    every = LengthReport("split", 16)
    pieces = fit_document(text, every, where="x")
    assert [len(p) for p in pieces] == [16, 16, 15] and (every.pieces, every.emptied) == (3, 0)
    assert torch.equal(torch.cat([p.tokens for p in pieces]), text.tokens), "nothing lost"
    assert "split into 3 pieces of at most 16" in every.describe()
    assert "dropped" not in every.describe()
    tail = LengthReport("split", 16)  # a last piece of one token predicts nothing
    text33 = Document(torch.arange(4, 37), torch.ones(33, dtype=torch.bool))
    assert [len(p) for p in fit_document(text33, tail, where="x")] == [16, 16]
    assert (tail.pieces, tail.emptied) == (3, 1)
    drop = LengthReport("drop", 16)
    assert fit_document(doc, drop, where="x") == [] and fit_document(pair(3, 3), drop, where="x")
    assert drop.describe() == "1 document longer than seq_len(16) (longest 47 tokens): dropped"
    with pytest.raises(DataError, match=r"f.jsonl:7: a document of 47 tokens is longer than"):
        fit_document(doc, LengthReport("error", 16), where="f.jsonl:7")
    short = LengthReport("error", 16)
    fits = pair(3, 3)
    assert fit_document(fits, short, where="x")[0] is fits, "a document that fits is unchanged"
    assert short.describe() == "no document longer than seq_len(16)"


def truncated(doc: Document, seq_len: int) -> tuple[list[Document], LengthReport]:
    report = LengthReport("truncate", seq_len)
    return fit_document(doc, report, where="x"), report


def test_truncate_keeps_a_completion_that_fits_exactly_among_the_last_tokens():
    """The boundary: seq_len - 1 trained tokens fit exactly after the kept BOS, so the
    prompt's start is cut and every trained token stays; one trained token more and the
    end is cut instead (the first seq_len tokens)."""
    exact = pair(9, 14)  # 25 tokens; trained: 14 + EOS = 15 = seq_len - 1, indices 10..24
    (kept,), report = truncated(exact, 16)
    assert kept.tokens.tolist() == [TOK.bos_id, *exact.tokens[-15:].tolist()]
    assert kept.target.tolist() == [False] + [True] * 15, "all 15 trained tokens kept"
    assert (report.cut_start, report.cut_end) == (1, 0)
    over = pair(9, 15)  # 16 trained tokens: more than seq_len - 1 can hold after the BOS
    (kept,), report = truncated(over, 16)
    assert torch.equal(kept.tokens, over.tokens[:16]) and int(kept.target.sum()) == 6
    assert (report.cut_start, report.cut_end) == (0, 1)
    # the shortest too-long document: seq_len + 1 tokens, trained from index 2 on (fits)
    tokens = torch.arange(50, 67)  # 17 tokens
    target = torch.tensor([False, False] + [True] * 15)
    (kept,), report = truncated(Document(tokens, target), 16)
    assert kept.tokens.tolist() == [50, *range(52, 67)] and bool(kept.target[1:].all())
    assert report.cut_start == 1
    # trained from index 1 on: 16 trained tokens do not fit, the last one is cut
    (kept,), report = truncated(Document(tokens, torch.tensor([False] + [True] * 16)), 16)
    assert kept.tokens.tolist() == list(range(50, 66)) and report.cut_end == 1


def test_long_document_boundaries_of_every_policy():
    """seq_len tokens fit as they are under every policy (the same object, nothing
    reported); seq_len + 1 is too long: dropped, refused, truncated to seq_len; split cuts
    pieces of exactly seq_len. A document with no trained token left is dropped by truncate and counted;
    under 2 tokens is skipped by every policy."""
    fits = Document(torch.arange(16), torch.ones(16, dtype=torch.bool))
    longer = Document(torch.arange(17), torch.ones(17, dtype=torch.bool))
    for policy in ("truncate", "split", "drop", "error"):
        report = LengthReport(policy, 16)
        assert fit_document(fits, report, where="x")[0] is fits, policy
        assert (report.too_long, report.longest) == (0, 0), policy
    split = LengthReport("split", 16)  # (a 1-token last piece trains nothing: not used here)
    two_more = Document(torch.arange(18), torch.ones(18, dtype=torch.bool))
    assert [p.tokens.tolist() for p in fit_document(two_more, split, where="x")] == [
        list(range(16)),
        [16, 17],
    ]
    assert (split.too_long, split.longest, split.pieces) == (1, 18, 2)
    twice = Document(torch.arange(32), torch.ones(32, dtype=torch.bool))
    assert [len(p) for p in fit_document(twice, LengthReport("split", 16), where="x")] == [16, 16]
    drop = LengthReport("drop", 16)
    assert fit_document(longer, drop, where="x") == [] and drop.too_long == 1
    with pytest.raises(
        DataError, match=r"^y: a document of 17 tokens is longer than seq_len\(16\)"
    ):
        fit_document(longer, LengthReport("error", 16), where="y")
    (kept,), report = truncated(longer, 16)
    assert kept.tokens.tolist() == list(range(16)) and report.cut_end == 1
    # no trained token at all (a prompt without completion), too long: nothing to keep
    untrained = Document(torch.arange(40), torch.zeros(40, dtype=torch.bool))
    assert truncated(untrained, 16)[0] == []
    assert truncated(untrained, 16)[1].emptied == 1
    # only the first token is flagged: it is never predicted (nothing comes before it)
    first_only = Document(torch.arange(40), torch.tensor([True] + [False] * 39))
    assert truncated(first_only, 16)[0] == []
    for policy in ("truncate", "split", "drop", "error"):
        report = LengthReport(policy, 16)
        one = Document(torch.tensor([7]), torch.tensor([True]))
        assert fit_document(one, report, where="x") == [] and report.short == 1, policy


def test_policy_from_a_file_names_the_line(tmp_path):
    path = write_jsonl(
        tmp_path / "d.jsonl",
        [{"text": "short"}, {"prompt": "p" * 60, "completion": "answer"}, {"text": "x" * 50}],
    )
    with pytest.raises(DataError, match=rf"{path}:2: a document of 68 tokens"):
        read_jsonl([path], TOK, seq_len=32, long_documents="error")
    documents, report = read_jsonl([path], TOK, seq_len=32, long_documents="truncate")
    assert [len(d) for d in documents] == [7, 32, 32]
    assert TOK.decode(documents[1].tokens[-7:-1].tolist()) == "answer"
    assert (report.cut_start, report.cut_end) == (1, 1)
    documents, report = read_jsonl([path], TOK, seq_len=32, long_documents="drop")
    assert [len(d) for d in documents] == [7] and report.too_long == 2


# ----------------------------------------------------------------------------- labels
def test_input_ids_with_labels_train_exactly_the_labelled_tokens(tmp_path):
    path = write_jsonl(
        tmp_path / "d.jsonl",
        [
            {"input_ids": [5, 6, 7, 8, 9], "labels": [-100, -100, 7, -100, 9]},
            {"input_ids": [5, 6, 7]},
        ],
    )
    (labelled, plain), _ = read_jsonl([path], TOK)
    assert labelled.tokens.tolist() == [5, 6, 7, 8, 9], "no specials added to input_ids"
    assert labelled.target.tolist() == [False, False, True, False, True]
    assert plain.target.all()
    ds = PackedDataset([labelled], seq_len=8, document_multiple=1, pad_id=0, seed=0, shuffle=False)
    mb = micro_batch_of([ds.sequence(0)])
    assert mb.labels[0, :5].tolist() == [-100, 7, -100, 9, -100], "position i predicts label i+1"
    assert mb.num_labels == 2


@pytest.mark.parametrize(
    "record, message",
    [
        (
            {"input_ids": [1, 2], "labels": [1]},
            '"labels" must be a list as long as "input_ids" (2)',
        ),
        ({"input_ids": [1, 2], "labels": [2, 3]}, "labels[0] = 2 but input_ids[0] = 1"),
        ({"input_ids": [1, 2], "labels": [-100, True]}, "labels[1] = True"),
        ({"input_ids": [True, False]}, "found True"),
        ({"labels": [1, 2]}, '"labels" needs the "input_ids"'),
        ({"text": "a", "prompt": "b", "completion": "c"}, "several formats at once"),
        ({"text": "a", "messages": []}, "keys ['messages', 'text']"),
        ({"input_ids": [1], "text": "a"}, "several formats at once"),
        ({"prompt": "a"}, '"prompt" and "completion" go together; "completion" is missing'),
    ],
)
def test_bad_or_ambiguous_records_name_file_and_line(tmp_path, record, message):
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": "fine"}, record])
    with pytest.raises(DataError) as info:
        read_jsonl([path], TOK)
    assert str(info.value).startswith(f"{path}:2: ") and message in str(info.value), info.value


# ----------------------------------------------------------------------------- file errors
def test_non_utf8_byte_names_file_line_and_column(tmp_path):
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(b'{"text": "ok"}\n{"text": "caf\xe9"}\n')
    with pytest.raises(DataError, match=rf"{path}:2: not valid UTF-8 \(byte 0xe9 at column 14\)"):
        read_jsonl([path], TOK)
    bom = tmp_path / "bom.jsonl"
    bom.write_bytes(b'\xef\xbb\xbf{"text": "ok"}\n')
    (doc,), _ = read_jsonl([bom], TOK)
    assert TOK.decode(doc.tokens[1:-1].tolist()) == "ok", "a byte-order mark is not data"


def test_directories_globs_and_missing_files(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    for name in ("b.jsonl", "a.jsonl", "c.txt"):
        write_jsonl(data / name, [{"text": name}])
    (data / "sub").mkdir()
    write_jsonl(data / "sub" / "d.jsonl", [{"text": "d"}])
    with pytest.raises(
        DataError, match=r"data/? is a directory, expected a JSONL file.*data/\*\.jsonl"
    ):
        resolve_files(["data"], tmp_path)
    assert resolve_files(["data/*.jsonl"], tmp_path) == [data / "a.jsonl", data / "b.jsonl"]
    assert resolve_files(["data/**/*.jsonl"], tmp_path) == [
        data / "a.jsonl",
        data / "b.jsonl",
        data / "sub" / "d.jsonl",
    ]
    assert resolve_files([str(data / "c.txt")], tmp_path / "elsewhere") == [data / "c.txt"]
    with pytest.raises(DataError, match=r"files pattern 'data/\*\.parquet' matches no file"):
        resolve_files(["data/*.parquet"], tmp_path)
    with pytest.raises(
        DataError, match=r"a.jsonl is listed twice \(by 'data/a.jsonl' and 'data/\*"
    ):
        resolve_files(["data/a.jsonl", "data/*.jsonl"], tmp_path)
    with pytest.raises(DataError, match=r"data file .*nope.jsonl does not exist"):
        resolve_files(["nope.jsonl"], tmp_path)
    with pytest.raises(DataError, match=r"is a directory, expected a JSONL file"):
        read_jsonl([data], TOK)


def test_missing_tokenizer_is_no_such_file_before_any_install_hint(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # as if not installed
    config = PRESETS["tiny"]
    with pytest.raises(DataError, match=r"tokenizer file .*absent.json: no such file"):
        build_tokenizer("absent.json", model_dir=None, model_config=config, config_dir=tmp_path)
    (tmp_path / "tokenizer.json").write_text("{}")
    with pytest.raises(DataError, match="needs the tokenizers library: pip install tokenizers"):
        build_tokenizer(str(tmp_path), model_dir=None, model_config=config, config_dir=tmp_path)


# ----------------------------------------------------------------------------- usp train
def test_a_run_on_long_prompts_trains_every_answer_and_says_what_was_cut(tmp_path):
    """The issue's case: prompts much longer than seq_len with short answers. Each is
    truncated to exactly seq_len tokens (one per sequence), keeping the answer."""
    import io

    from usp.train.config import train_config_from_dict
    from usp.train.trainer import train

    answers = [f" answer {i}" for i in range(8)]
    records = [{"prompt": "p" * (200 + 10 * i), "completion": a} for i, a in enumerate(answers)]
    write_jsonl(tmp_path / "long.jsonl", records)
    config = {
        "cluster": {"nodes": 1, "gpus_per_node": 1},
        "parallel": {"ulysses": 1, "ring": 1, "dp": 1},
        "model": {"preset": "tiny"},
        "data": {"files": ["long.jsonl"], "tokenizer": "byte", "shuffle": False},
        "train": {"steps": 2, "global_batch": 4, "seq_len": 64, "export": False},
    }
    job = train_config_from_dict(config, source=str(tmp_path / "job.toml"))
    stream = io.StringIO()
    result = train(job, None, output_dir=tmp_path / "out", stream=stream)
    per_answer = [len(a) + 1 for a in answers]  # the completion's bytes and the EOS
    assert [r["label_tokens"] for r in result.metrics] == [sum(per_answer[:4]), sum(per_answer[4:])]
    header = stream.getvalue()
    assert (
        "8 documents longer than seq_len(64) (longest 281 tokens): truncated to 64 tokens "
        "(the prompt's start cut for 8, the end cut for 0)"
    ) in header, header
    assert "8 sequences per epoch; the run's 8 sequences cover 1.00 epochs" in header, header


def test_batched_tokenising_keeps_order_and_reports_the_first_bad_line(tmp_path, monkeypatch):
    import usp.train.data.records as records

    monkeypatch.setattr(records, "BATCH_RECORDS", 3)
    texts = [f"record {i} " * (i + 1) for i in range(8)]
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": t} for t in texts])
    documents, _ = read_jsonl([path], TOK)
    assert [TOK.decode(d.tokens[1:-1].tolist()) for d in documents] == texts
    lines = path.read_text().splitlines()
    lines[4] = '{"text": 3}'  # line 5: a bad value ...
    lines[5] = "{oops"  # ... before a line that is not JSON, in the same batch
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(DataError, match=rf"{path}:5: \"text\" must be a string"):
        read_jsonl([path], TOK)
    lines[4] = '{"text": "fine"}'
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(DataError, match=rf"{path}:6: invalid JSON"):
        read_jsonl([path], TOK)
