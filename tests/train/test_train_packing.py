"""Packing by exact value: which documents land in which sequence, at which lengths.

Token order alone does not notice a boundary error (``used + padded >= cap`` instead of
``>``): documents that fit a sequence exactly would then start with an all-padding
sequence (no labels) and be split. So every sequence here is spelled out.
"""

from __future__ import annotations

import torch

from usp.train.data import (
    IGNORE_INDEX,
    Document,
    LengthReport,
    PackedDataset,
    fit_document,
    micro_batch_of,
)


def documents(lengths) -> list[Document]:
    """Document i holds tokens 100 * (i + 1), 100 * (i + 1) + 1, ... (recognisable)."""
    docs = []
    for i, n in enumerate(lengths):
        tokens = torch.arange(n, dtype=torch.int64) + 100 * (i + 1)
        docs.append(Document(tokens, torch.ones(n, dtype=torch.bool)))
    return docs


def pack(lengths, *, seq_len=32, multiple=4, count=None):
    # documents longer than seq_len are cut first, as [data] long_documents = "split" does
    report = LengthReport("split", seq_len)
    split = [p for d in documents(lengths) for p in fit_document(d, report, where="test")]
    ds = PackedDataset(
        split,
        seq_len=seq_len,
        document_multiple=multiple,
        pad_id=0,
        seed=0,
        shuffle=False,
    )
    return [ds.sequence(g) for g in range(count or len(lengths))]


def tokens_of(i: int, n: int) -> list[int]:
    return list(range(100 * (i + 1), 100 * (i + 1) + n))


def test_documents_that_fit_exactly_fill_sequences_exactly():
    seqs = pack([32, 8, 20, 4], count=4)
    assert [s.lengths for s in seqs] == [(32,), (8, 20, 4), (32,), (8, 20, 4)], (
        "an exact fit is kept whole; epoch 2 repeats epoch 1 (no shuffling)"
    )
    assert seqs[0].tokens.tolist() == tokens_of(0, 32)
    assert seqs[1].tokens.tolist() == tokens_of(1, 8) + tokens_of(2, 20) + tokens_of(3, 4)
    assert all(bool(s.target.all()) for s in seqs), "no padding anywhere"
    for s in seqs:
        labels = micro_batch_of([s]).labels[0]
        # each document's last token predicts nothing (the next document is not its text)
        assert int((labels != IGNORE_INDEX).sum()) == 32 - len(s.lengths)


def test_padding_to_the_multiple_and_the_rest_of_a_sequence():
    seqs = pack([32, 8, 20, 4], multiple=8, count=3)
    # 20 -> 24 and 4 -> 8 with multiple 8: 8 + 24 = 32, then 4 alone with 28 padding
    assert [s.lengths for s in seqs] == [(32,), (8, 24), (8, 24)]
    assert seqs[1].tokens.tolist() == tokens_of(1, 8) + tokens_of(2, 20) + [0] * 4
    assert seqs[1].target.tolist() == [True] * 28 + [False] * 4
    assert seqs[2].tokens.tolist() == tokens_of(3, 4) + [0] * 28
    assert seqs[2].target.tolist() == [True] * 4 + [False] * 28
    for s in seqs:
        assert int((micro_batch_of([s]).labels != IGNORE_INDEX).sum()) > 0, "no empty sequence"


def test_a_long_document_is_cut_at_the_sequence_length():
    seqs = pack([70, 4], count=3)
    assert [s.lengths for s in seqs] == [(32,), (32,), (8, 4, 20)]
    assert torch.cat([s.tokens[s.target] for s in seqs]).tolist() == tokens_of(0, 70) + tokens_of(
        1, 4
    )
    assert seqs[2].tokens.tolist() == tokens_of(0, 70)[64:] + [0, 0] + tokens_of(1, 4) + [0] * 20


def test_auto_document_multiple_follows_the_grid_and_the_header_says_so(tmp_path):
    """[data] document_multiple = "auto" pads to what the grid needs (2 x ring for zigzag):
    a u2 x r2 run and a one-process run pack different sequences from the same records, and
    each start-up says which value it chose; the same explicit value gives both the same
    sequences (the docs' recipe for comparing losses across grids)."""
    import json
    from types import SimpleNamespace

    from train_cases import base_config

    from usp.train import components
    from usp.train.config import train_config_from_dict
    from usp.train.metrics.header import packing_line

    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps({"text": "x" * n}) + "\n" for n in (9, 7, 8, 3)))
    grids = {"u2r2": SimpleNamespace(layout="zigzag", ring_degree=2, ulysses_degree=2,
                                     sequence_multiple=8),
             "one": SimpleNamespace(layout="zigzag", ring_degree=1, ulysses_degree=1,
                                    sequence_multiple=2)}  # fmt: skip

    def packed(grid, multiple):
        config = base_config(seq_len=32)
        config["data"] = {"source": "jsonl", "files": [str(data)], "tokenizer": "byte",
                          "document_multiple": multiple, "shuffle": False}  # fmt: skip
        job = train_config_from_dict(config, source=str(tmp_path / "job.toml"))
        m = components.check_lengths(job, grids[grid])
        dataset = components.load_dataset(
            job, components.prepare_data(job, components.model_source(job), m)
        )
        rows = [dataset.sequence(g) for g in range(3)]
        return packing_line(job, grids[grid], dataset), [
            (r.lengths, r.tokens.tolist()) for r in rows
        ]

    line4, four = packed("u2r2", "auto")
    line1, one = packed("one", "auto")
    assert "multiples of 4" in line4 and "ring 2" in line4 and "another grid" in line4, line4
    assert "multiples of 2" in line1 and "ring 1" in line1, line1
    # 11, 9 and 10 tokens (with BOS and EOS): padded to 12 + 10 + 10 they share a sequence
    # of 32 on one process; to 12 + 12 + 12 they do not on u2 x r2
    assert [lengths for lengths, _ in one][:1] == [(12, 10, 10)], one
    assert four != one  # the same records, packed differently: losses would differ
    assert packed("u2r2", 4)[1] == packed("one", 4)[1] == four
    assert "multiples of 4 ([data] document_multiple)" in packed("one", 4)[0]
