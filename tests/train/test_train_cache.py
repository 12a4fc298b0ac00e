"""Tokenise once: the memory-mapped corpus cache (one process and 4 gloo ranks), and a
chat fine-tune of an HF checkpoint on 4 ranks against one process, with the label
tokens counted against the template's assistant spans and the chat template exported."""

from __future__ import annotations

import io
import json
import os
from pathlib import Path

import pytest
import torch
from chat_cases import CONVERSATIONS, assistant_texts, write_chat_tokenizer
from usp_cases import topology

from usp.models import PRESETS
from usp.train.data import ByteTokenizer, DataError, load_cache, read_jsonl
from usp.train.data.build import DataInputs, build_corpus
from usp.train.data.corpus import Corpus

TIMEOUT = 240


def inputs(files, *, seq_len=64, long_documents="truncate") -> DataInputs:
    return DataInputs(
        ByteTokenizer(),
        tuple(files),
        seq_len=seq_len,
        long_documents=long_documents,
        document_multiple=1,
        seed=0,
        shuffle=True,
    )


def data_file(path, count=40, bad_line=None):
    lines = []
    for i in range(count):
        record = {"prompt": f"question {i} " + "x" * (i * 3), "completion": f" answer {i}"}
        lines.append(json.dumps(record))
    if bad_line is not None:
        lines[bad_line - 1] = '{"text": 1}'
    path.write_text("\n".join(lines) + "\n")
    return path


def same_corpus(a: Corpus, b: Corpus) -> bool:
    return (
        torch.equal(a.offsets, b.offsets)
        and torch.equal(a.tokens, b.tokens)
        and torch.equal(a.target, b.target)
    )


# ----------------------------------------------------------------------------- one process
def test_cache_is_built_once_reused_and_keyed_by_content_and_options(tmp_path):
    path = data_file(tmp_path / "d.jsonl")
    root = tmp_path / "cache"
    first = build_corpus(inputs([path]), cache_root=root)
    assert first.notes[-1].startswith(f"tokenised into {root}")
    documents, report = read_jsonl([path], ByteTokenizer(), seq_len=64)
    assert same_corpus(first.corpus, Corpus.from_documents(documents)), "the cache is the data"
    assert first.report == report and report.cut_start > 0
    (directory,) = root.iterdir()
    stamp = (directory / "tokens.i32").stat().st_mtime_ns
    again = build_corpus(inputs([path]), cache_root=root)
    assert again.notes[-1] == f"tokenised data reused from {directory} (checksums verified)"
    assert again.key == first.key and (directory / "tokens.i32").stat().st_mtime_ns == stamp
    assert same_corpus(again.corpus, first.corpus) and again.report == first.report
    other_options = build_corpus(inputs([path], long_documents="split"), cache_root=root)
    other_length = build_corpus(inputs([path], seq_len=128), cache_root=root)
    data_file(path, count=41)  # the content changes, the name does not
    other_content = build_corpus(inputs([path]), cache_root=root)
    keys = {first.key, other_options.key, other_length.key, other_content.key}
    assert len(keys) == 4 and len(list(root.iterdir())) == 4
    assert len(other_content.corpus) == 41


def test_a_damaged_cache_is_reported_when_mapped_and_rebuilt_by_the_next_build(tmp_path):
    path = data_file(tmp_path / "d.jsonl")
    built = build_corpus(inputs([path]), cache_root=tmp_path / "cache")
    reference = built.corpus.tokens.clone()  # (the damage below changes what it maps)
    (directory,) = (tmp_path / "cache").iterdir()
    with open(directory / "tokens.i32", "r+b") as f:
        f.truncate(8)
    with pytest.raises(DataError, match="tokenised data cache .* is damaged .*delete that"):
        load_cache(directory)  # damaged after the build checked it: mapping refuses it
    again = build_corpus(inputs([path]), cache_root=tmp_path / "cache")
    assert again.notes[0].startswith(f"the tokenised data cache {directory} was damaged")
    assert torch.equal(again.corpus.tokens, reference)


def test_the_cache_is_written_without_numpy_too(tmp_path, monkeypatch):
    path = data_file(tmp_path / "d.jsonl")
    with_numpy = build_corpus(inputs([path]), cache_root=tmp_path / "a")

    def unavailable(self, *args, **kwargs):
        raise RuntimeError("Numpy is not available")

    monkeypatch.setattr(torch.Tensor, "numpy", unavailable)
    without = build_corpus(inputs([path]), cache_root=tmp_path / "b")
    assert without.notes[-1].startswith("tokenised into")
    assert same_corpus(with_numpy.corpus, without.corpus)
    (a,), (b,) = (tmp_path / "a").iterdir(), (tmp_path / "b").iterdir()
    for name in ("tokens.i32", "target.u8", "offsets.i64"):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name


# ----------------------------------------------------------------------------- 4 ranks
def run_cached_corpus(files, root, per_node=False, ranks_per_node=None):
    torch.set_num_threads(1)
    topo = topology(2, 2, ranks_per_node=ranks_per_node)
    where = os.path.join(root, f"node{topo.node}") if per_node else root
    built = build_corpus(inputs(files), topology=topo, cache_root=Path(where))
    meta = json.loads((next(p for p in Path(where).iterdir()) / "meta.json").read_text())
    c = built.corpus
    again = build_corpus(inputs(files), topology=topo, cache_root=Path(where))  # a resume
    return {
        "notes": (built.notes[-1], again.notes[-1]),
        "same_again": same_corpus(again.corpus, c),
        "rank": topo.rank,
        "node": topo.node,
        "pid": os.getpid(),
        "built_by": meta["built_by"],
        "key": built.key,
        "tokens": c.tokens.tolist(),
        "target": c.target.tolist(),
        "offsets": c.offsets.tolist(),
        "entries": sorted(os.listdir(where)),
    }


def test_four_ranks_map_the_corpus_rank_0_tokenised(distributed, tmp_path):
    path = data_file(tmp_path / "d.jsonl", count=60)
    results = distributed.run(
        run_cached_corpus, [path], str(tmp_path / "cache"), world_size=4, timeout=TIMEOUT
    )
    documents, _ = read_jsonl([path], ByteTokenizer(), seq_len=64)
    reference = Corpus.from_documents(documents)
    rank0 = next(r for r in results if r["rank"] == 0)
    for r in results:
        assert r["tokens"] == reference.tokens.tolist() and r["target"] == reference.target.tolist()
        assert r["offsets"] == reference.offsets.tolist() and r["key"] == rank0["key"]
        assert r["built_by"]["pid"] == rank0["pid"], "rank 0 tokenised, the others mapped"
        assert len(r["entries"]) == 1, f"one cache directory, no temporaries: {r['entries']}"
        first, again = r["notes"]
        assert first.startswith("tokenised into ") and again.startswith("tokenised data reused")
        assert r["same_again"]


def test_nodes_without_shared_storage_each_tokenise_once(distributed, tmp_path):
    path = data_file(tmp_path / "d.jsonl")
    results = distributed.run(
        run_cached_corpus,
        [path],
        str(tmp_path / "local"),
        True,
        2,
        world_size=4,
        timeout=TIMEOUT,
    )
    by_node = {}
    for r in results:
        by_node.setdefault(r["node"], []).append(r)
    assert sorted(by_node) == [0, 1]
    for ranks in by_node.values():
        first = min(ranks, key=lambda r: r["rank"])
        assert {r["built_by"]["pid"] for r in ranks} == {first["pid"]}, (
            "the node's first rank tokenised, once"
        )
    assert len({r["key"] for r in results}) == 1
    assert len({tuple(r["tokens"]) for r in results}) == 1


def run_bad_data(files, root):
    torch.set_num_threads(1)
    topo = topology(2, 2)
    try:
        build_corpus(inputs(files), topology=topo, cache_root=Path(root))
    except DataError as err:
        return str(err)
    return None


def test_a_bad_record_fails_every_rank_alike(distributed, tmp_path):
    path = data_file(tmp_path / "d.jsonl", bad_line=7)
    messages = distributed.run(
        run_bad_data, [path], str(tmp_path / "cache"), world_size=4, timeout=TIMEOUT
    )
    assert all(m == messages[0] for m in messages), messages
    assert f"{path}:7: " in messages[0] and '"text" must be a string' in messages[0], messages[0]
    assert not (tmp_path / "cache").exists() or not any(
        (p / "meta.json").exists() for p in (tmp_path / "cache").iterdir()
    ), "no cache is left for a failed tokenisation"


# ----------------------------------------------------------------------------- chat fine-tune
def chat_job(tmp_path) -> tuple[dict, list[int]]:
    """A tiny HF checkpoint whose directory holds the chat tokenizer, chat records, and the
    label tokens each step must have (counted from the assistant turns alone)."""
    from train_cases import base_config

    from usp.models import Llama

    model_dir = tmp_path / "model"
    ids = write_chat_tokenizer(model_dir)
    config = PRESETS["tiny"].replace(
        vocab_size=ids["vocab_size"],
        bos_token_id=ids["<|begin_of_text|>"],
        eos_token_id=[ids["<|end_of_text|>"], ids["<|eot_id|>"]],
    )
    torch.manual_seed(7)
    Llama(config, None).save_pretrained(model_dir)
    records = [CONVERSATIONS[i % 3] for i in range(12)]
    (tmp_path / "data").mkdir()
    for part in range(2):
        lines = "".join(json.dumps({"messages": c}) + "\n" for c in records[part * 6 :][:6])
        (tmp_path / "data" / f"chat-{part}.jsonl").write_text(lines)
    job = base_config(steps=2, checkpoint_interval=0, export=True)
    job["model"] = {"path": str(model_dir)}
    job["data"] = {
        "source": "jsonl",
        "files": [str(tmp_path / "data" / "chat-*.jsonl")],
        "shuffle": False,
        "long_documents": "drop",
        "document_multiple": 8,
    }
    # 60, 25 and 44 tokens at seq_len 64: one conversation per sequence, in file order
    from usp.train.data import build_tokenizer

    tok = build_tokenizer("auto", model_dir=model_dir, model_config=config, config_dir=tmp_path)
    trained = [
        sum(len(tok.encode(t.removesuffix("<|eot_id|>"))) + 1 for t in assistant_texts(c))
        for c in records
    ]
    batch = job["train"]["global_batch"]
    return job, [sum(trained[s * batch : (s + 1) * batch]) for s in range(2)]


def test_chat_fine_tune_on_four_ranks_trains_assistant_tokens_only(distributed, tmp_path):
    from safetensors.torch import load_file
    from train_cases import _train_on_ranks, assert_matches_single

    from usp.train.config import train_config_from_dict
    from usp.train.trainer import train

    config, expected = chat_job(tmp_path)
    rows = distributed.run(
        _train_on_ranks, config, 2, 2, str(tmp_path / "sp"), world_size=4, timeout=TIMEOUT
    )[0]
    stream = io.StringIO()
    single = train(
        train_config_from_dict(config), None, output_dir=tmp_path / "single", stream=stream
    )
    assert [r["label_tokens"] for r in single.metrics] == expected
    assert_matches_single(rows, single.metrics)
    header = stream.getvalue()
    assert "12 documents" in header and "no document longer than seq_len(64)" in header, header
    assert "cover 0.67 epochs" in header, header
    for out in ("sp", "single"):
        exported = tmp_path / out / "hf"
        assert (exported / "chat_template.jinja").read_text() == (
            tmp_path / "model" / "chat_template.jinja"
        ).read_text(), "the export keeps the chat template"
        assert (exported / "tokenizer_config.json").is_file()
    assert load_file(tmp_path / "sp" / "hf" / "model.safetensors").keys()


def run_node_local_files(root, data):
    """Node-local storage where node 1's copy of the data file differs from node 0's."""
    torch.set_num_threads(1)
    topo = topology(2, 2, ranks_per_node=2)
    path = Path(data) / f"node{topo.node}.jsonl"
    try:
        build_corpus(inputs([path]), topology=topo, cache_root=Path(root) / f"node{topo.node}")
    except DataError as err:
        return str(err)
    return None


def test_nodes_whose_files_differ_are_refused_on_every_rank(distributed, tmp_path):
    data_file(tmp_path / "node0.jsonl", count=10)
    data_file(tmp_path / "node1.jsonl", count=11)
    messages = distributed.run(
        run_node_local_files, str(tmp_path / "local"), str(tmp_path), world_size=4, timeout=TIMEOUT
    )
    assert all(m == messages[0] for m in messages), messages
    assert "the data files or tokenizer on node 1 differ from rank 0's" in messages[0], messages[0]
