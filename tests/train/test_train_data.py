"""Training data (documents, packing, labels, per-replica batches), the learning-rate
schedule, and the metrics/progress/plot outputs. Single process."""

from __future__ import annotations

import io
import json
import math
import sys
from types import SimpleNamespace

import pytest
import torch

import usp
from usp.models import IGNORE_INDEX, PRESETS, shift_labels
from usp.train.data import (
    ByteTokenizer,
    DataError,
    DataLoader,
    Document,
    LengthReport,
    PackedDataset,
    build_tokenizer,
    fit_document,
    micro_batch_of,
    read_jsonl,
    synthetic_documents,
)
from usp.train.metrics import (
    MetricsWriter,
    Progress,
    plot_loss,
    read_metrics,
)
from usp.train.schedule import WarmupCosine


def doc(tokens, target=None) -> Document:
    t = torch.tensor(tokens, dtype=torch.int64)
    m = torch.ones_like(t, dtype=torch.bool) if target is None else torch.tensor(target)
    return Document(t, m)


# ----------------------------------------------------------------------------- documents
def test_jsonl_formats(tmp_path):
    path = tmp_path / "d.jsonl"
    records = [
        {"text": "hi"},
        {"input_ids": [7, 8, 9]},
        {"prompt": "ab", "completion": "c"},
    ]
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n\n")
    tok = ByteTokenizer()
    (text, ids, pair), _ = read_jsonl([path], tok)
    assert text.tokens.tolist() == [tok.bos_id, ord("h"), ord("i"), tok.eos_id]
    assert text.target.all()
    assert ids.tokens.tolist() == [7, 8, 9] and ids.target.all()
    assert pair.tokens.tolist() == [tok.bos_id, ord("a"), ord("b"), ord("c"), tok.eos_id]
    assert pair.target.tolist() == [False, False, False, True, True], "the prompt carries no loss"


def test_blank_lines_are_counted_in_the_report(tmp_path):
    """A blank line holds no record: skipped, and said so at start-up, not silently."""
    path = tmp_path / "d.jsonl"
    path.write_text('{"text": "one"}\n\n{"text": "two"}\n   \n{"text": "three"}\n')
    documents, report = read_jsonl([path], ByteTokenizer())
    assert len(documents) == 3
    assert report.blank_lines == 2
    assert report.describe().endswith("; 2 blank JSONL line(s) skipped")
    path.write_text('{"text": "one"}\n')
    assert "blank" not in read_jsonl([path], ByteTokenizer())[1].describe()


@pytest.mark.parametrize(
    "line, message",
    [
        ("{not json", "invalid JSON"),
        ('{"title": "x"}', 'a record needs "text", "input_ids", "prompt" and "completion", or'),
        ('{"text": 3}', '"text" must be a string'),
        (
            '{"input_ids": [1, 999]}',
            '"input_ids" must be a list of integers in [0, 256), found 999',
        ),
        ("[1, 2]", "expected a JSON object"),
    ],
)
def test_jsonl_errors_name_file_and_line(tmp_path, line, message):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "fine"}\n' + line + "\n")
    with pytest.raises(DataError) as info:
        read_jsonl([path], ByteTokenizer())
    assert f"{path}:2" in str(info.value) and message in str(info.value), info.value


def test_missing_or_empty_data(tmp_path):
    with pytest.raises(DataError, match="absent.jsonl does not exist"):
        read_jsonl([tmp_path / "absent.jsonl"], ByteTokenizer())
    (tmp_path / "tiny.jsonl").write_text('{"input_ids": [1]}\n')
    with pytest.raises(DataError, match="no documents with at least 2 tokens"):
        read_jsonl([tmp_path / "tiny.jsonl"], ByteTokenizer())


def test_tokenizer_json_from_the_model_directory(tmp_path):
    tokenizers = pytest.importorskip("tokenizers", reason="reading tokenizer.json needs tokenizers")
    vocab = {"[UNK]": 0, "<s>": 1, "</s>": 2, "hello": 3, "world": 4}
    tk = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tk.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tk.save(str(tmp_path / "tokenizer.json"))
    config = PRESETS["tiny"].replace(bos_token_id=1, eos_token_id=[2, 5])
    auto = build_tokenizer("auto", model_dir=tmp_path, model_config=config, config_dir=tmp_path)
    assert (auto.vocab_size, auto.bos_id, auto.eos_id, auto.pad_id) == (5, 1, 2, 2)
    (tmp_path / "d.jsonl").write_text('{"text": "hello world hello"}\n')
    (document,), _ = read_jsonl([tmp_path / "d.jsonl"], auto)
    assert document.tokens.tolist() == [1, 3, 4, 3, 2]
    by_path = build_tokenizer(
        "tokenizer.json", model_dir=None, model_config=config, config_dir=tmp_path
    )
    assert by_path.encode("world") == [4]
    with pytest.raises(
        DataError, match=r'tokenizer = "auto" reads .*tokenizer.json, which does not exist'
    ):
        build_tokenizer("auto", model_dir=tmp_path / "x", model_config=config, config_dir=tmp_path)
    assert isinstance(
        build_tokenizer("auto", model_dir=None, model_config=config, config_dir=tmp_path),
        ByteTokenizer,
    )


def test_synthetic_task_hides_one_letter_and_asks_for_it():
    tok = ByteTokenizer()
    documents = synthetic_documents(50, length=30, seed=1)
    assert (
        documents[0].tokens.tolist() == synthetic_documents(1, length=30, seed=1)[0].tokens.tolist()
    )
    for d in documents:
        text = tok.decode(d.tokens[1:-1].tolist())
        prompt, answer = text[:-1], text[-1]
        assert prompt.endswith("?") and answer.isupper()
        letters = prompt[:-1]
        assert 15 <= len(letters) - 1 <= 30
        uppers = [i for i, c in enumerate(letters) if c.isupper()]
        assert [letters[i] for i in uppers] == [answer], "exactly one needle, the answer"
        assert uppers[0] <= (len(letters) - 1) // 2, "in the first half"
        assert d.target.tolist() == [False] * (len(d) - 2) + [True, True], (
            "only the answer is trained"
        )


# ----------------------------------------------------------------------------- packing
def _documents(lengths, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [doc(torch.randint(4, 256, (n,), generator=gen).tolist()) for n in lengths]


def test_packing_fills_sequences_with_padded_documents():
    docs = _documents([5, 17, 3, 40, 9, 31, 2, 12])
    report = LengthReport("split", 32)
    pieces = [p for i, d in enumerate(docs) for p in fit_document(d, report, where=f"doc {i}")]
    assert [len(p) for p in pieces] == [5, 17, 3, 32, 8, 9, 31, 2, 12]
    assert report.describe().startswith("1 document longer than seq_len(32) (longest 40 tokens)")
    ds = PackedDataset(pieces, seq_len=32, document_multiple=4, pad_id=0, seed=0, shuffle=False)
    seen = []
    for g in range(6):
        s = ds.sequence(g)
        assert s.tokens.numel() == 32 and sum(s.lengths) == 32
        assert all(n % 4 == 0 for n in s.lengths), "every document padded to the multiple"
        cu = torch.tensor([0, *torch.tensor(s.lengths).cumsum(0).tolist()], dtype=torch.int32)
        # what usp needs: usp.pad_documents would not add a token for ring 2 (zigzag), u 2
        topo = SimpleNamespace(ring_degree=2, ulysses_degree=2)
        assert usp.pad_documents(cu, topo).padded_len == 32
        seen.append(s)
    # epoch 0 without shuffling: the documents in order, the 40-token one cut at 32
    flat = torch.cat([s.tokens[s.target] for s in seen]).tolist()
    expected = [t for d in docs for t in d.tokens.tolist()]
    assert flat[: len(expected)] == expected
    assert ds.epoch_of(0) == 0 and ds.epoch_of(20) > 0
    with pytest.raises(
        DataError, match=r"seq_len\(30\) is not a multiple of document_multiple\(4\)"
    ):
        PackedDataset(pieces, seq_len=30, document_multiple=4, pad_id=0, seed=0)
    with pytest.raises(DataError, match=r"a document of 40 tokens is longer than seq_len\(32\)"):
        PackedDataset(docs, seq_len=32, document_multiple=4, pad_id=0, seed=0)


def test_packing_is_deterministic_and_seeded():
    docs = _documents(range(3, 40))
    kwargs = {"seq_len": 64, "document_multiple": 8, "pad_id": 0}
    a = PackedDataset(docs, seed=5, **kwargs)
    b = PackedDataset(docs, seed=5, **kwargs)
    c = PackedDataset(docs, seed=6, **kwargs)
    assert all(torch.equal(a.sequence(g).tokens, b.sequence(g).tokens) for g in range(12))
    assert any(not torch.equal(a.sequence(g).tokens, c.sequence(g).tokens) for g in range(12))
    late = PackedDataset(docs, seed=5, **kwargs)
    assert torch.equal(late.sequence(11).tokens, a.sequence(11).tokens), "random access = in order"


def test_labels_shift_globally_and_mask_prompts_pads_and_document_ends():
    prompt_doc = doc([1, 2, 3, 4], [False, False, True, True])
    plain = doc([5, 6, 7])
    ds = PackedDataset(
        [prompt_doc, plain], seq_len=16, document_multiple=4, pad_id=0, seed=0, shuffle=False
    )
    mb = micro_batch_of([ds.sequence(0)])
    assert mb.cu_seqlens.tolist() == [0, 4, 8, 16]
    labels = mb.labels[0].tolist()
    # doc 1: targets only where the next token is a completion token; doc 2: 6, 7, end
    assert labels[:4] == [IGNORE_INDEX, 3, 4, IGNORE_INDEX]
    assert labels[4:8] == [6, 7, IGNORE_INDEX, IGNORE_INDEX]
    assert labels[8:] == [IGNORE_INDEX] * 8
    assert mb.num_labels == 4
    unmasked = shift_labels(mb.input_ids, cu_seqlens=mb.cu_seqlens)
    keep = mb.labels != IGNORE_INDEX
    assert torch.equal(mb.labels[keep], unmasked[keep]), "the same shift as usp.models.shift_labels"


def test_replicas_take_disjoint_shares_of_each_global_batch():
    docs = _documents([10, 20, 30, 12, 7, 25] * 4)
    ds = PackedDataset(docs, seq_len=32, document_multiple=4, pad_id=0, seed=2)
    loaders = [
        DataLoader(ds, global_batch=8, micro_batch=2, dp_degree=2, dp_rank=r) for r in (0, 1)
    ]
    for step in range(3):
        batches = [loader.next_step() for loader in loaders]
        assert batches[0].num_labels == batches[1].num_labels
        rows = [mb.input_ids for b in batches for mb in b.micro_batches]
        assert all(r.shape == (1, 64) for r in rows), "micro_batch 2 -> one row of 2 sequences"
        expected = torch.cat([ds.sequence(g).tokens for g in range(8 * step, 8 * step + 8)])
        assert torch.equal(torch.cat([r[0] for r in rows]), expected), "replica 0 first, then 1"
        total = sum(
            micro_batch_of([ds.sequence(g)]).num_labels for g in range(8 * step, 8 * step + 8)
        )
        assert batches[0].num_labels == total
    assert loaders[0].state_dict() == {"position": 24}
    resumed = DataLoader(ds, global_batch=8, micro_batch=2, dp_degree=2, dp_rank=1)
    resumed.load_state_dict({"position": 16})
    again = DataLoader(ds, global_batch=8, micro_batch=2, dp_degree=2, dp_rank=1, position=16)
    assert torch.equal(
        resumed.next_step().micro_batches[0].input_ids, again.next_step().micro_batches[0].input_ids
    )
    with pytest.raises(
        DataError, match=r"global_batch\(6\) is not a multiple of micro_batch\(2\) \* dp\(2\)"
    ):
        DataLoader(ds, global_batch=6, micro_batch=2, dp_degree=2, dp_rank=0)


# ----------------------------------------------------------------------------- schedule
def test_warmup_then_cosine_to_the_floor():
    s = WarmupCosine(lr=1.0, total_steps=12, warmup_steps=2, min_lr_ratio=0.1)
    assert [s.lr_at(0), s.lr_at(1)] == [0.5, 1.0]
    assert s.lr_at(2) == pytest.approx(1.0)
    assert s.lr_at(11) == pytest.approx(0.1)
    middle = s.lr_at(2 + 9 / 2)
    assert middle == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert all(s.lr_at(i) >= s.lr_at(i + 1) for i in range(1, 11))
    flat = WarmupCosine(lr=2.0, total_steps=3, warmup_steps=3)
    assert flat.lr_at(2) == 2.0
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=9.0)
    assert s.apply(opt, 0) == 0.5 and opt.param_groups[0]["lr"] == 0.5
    short = WarmupCosine(lr=1.0, total_steps=2, warmup_steps=4)  # a trial run: warmup unfinished
    assert [short.lr_at(0), short.lr_at(1)] == [0.25, 0.5]
    for bad in (
        {"total_steps": 0},
        {"total_steps": 2, "warmup_steps": -1},
        {"total_steps": 2, "min_lr_ratio": 2},
    ):
        with pytest.raises(ValueError):
            WarmupCosine(lr=1.0, **bad)


# ----------------------------------------------------------------------------- metrics
@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mistral"])
def test_flops_count_every_matmul_and_causal_attention(family):
    """usp.models.model_counts, the one home of the arithmetic: the parameters in a
    matmul are every Linear's weight (an untied output projection included: the tiny
    configs are untied; qwen3's per-head norms and qwen2's biases are not matmuls), the
    total is the model's parameter count, and the FLOPs are 6 per matmul parameter per
    token plus causal attention's."""
    from model_cases import family_config

    from usp.models import family_named, model_counts, training_flops

    config = family_config(family)
    model = family_named(family).build(config)
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    counts = model_counts(config)
    assert counts.matmul == linear
    assert counts.total == sum(p.numel() for p in model.parameters())
    h, d, layers = config.num_attention_heads, config.attention_head_dim, config.num_hidden_layers
    expected = 6 * linear * 30 + 6 * layers * h * d * (10**2 + 20**2)
    assert training_flops(config, [10, 20]) == expected == counts.training_flops([10, 20])


def test_metrics_file_keeps_steps_before_a_resume(tmp_path):
    path = tmp_path / "metrics.jsonl"
    writer = MetricsWriter(path)
    for step in (1, 2, 3):
        writer.write({"step": step, "loss": 1.0 / step})
    writer.close()
    writer = MetricsWriter(path, resume_after_step=2)
    writer.write({"step": 3, "loss": 0.25})
    writer.close()
    assert [(r["step"], r["loss"]) for r in read_metrics(path)] == [(1, 1.0), (2, 0.5), (3, 0.25)]


def _row(step):
    return {"step": step, "loss": 2.0, "grad_norm": 0.5, "lr": 1e-3, "tokens_per_s_per_gpu": 10.0}


def test_plain_progress_lines_at_the_interval():
    stream = io.StringIO()  # not a terminal: plain lines
    progress = Progress(5, 0, log_interval=2, stream=stream)
    for step in range(1, 6):
        progress.update({**_row(step), "mfu": 0.5, "peak_memory_gib": 3.0})
    progress.close()
    lines = stream.getvalue().splitlines()
    assert [line.split()[1] for line in lines] == ["2/5", "4/5", "5/5"]
    assert "loss 2.0000" in lines[0] and "mfu 50.0%" in lines[0] and "mem 3.0GiB" in lines[0]
    assert "eta" in lines[0]


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_bar_on_a_terminal():
    pytest.importorskip("tqdm", reason="the progress bar uses tqdm when it is installed")
    stream = Terminal()
    progress = Progress(3, 1, log_interval=1, stream=stream)
    for step in (2, 3):
        progress.update(_row(step))
    progress.close()
    assert "3/3" in stream.getvalue() and "loss 2.0000" in stream.getvalue()


def test_rich_without_tqdm_and_plain_lines_without_either(monkeypatch):
    pytest.importorskip("rich", reason="rich is the progress bar when tqdm is absent")
    monkeypatch.setitem(sys.modules, "tqdm", None)
    monkeypatch.setitem(sys.modules, "tqdm.auto", None)
    stream = Terminal()
    progress = Progress(2, 0, log_interval=5, stream=stream)
    progress.update(_row(1))
    progress.update(_row(2))
    progress.close()
    assert "step 2/2" in stream.getvalue() and "grad_norm 0.5" in stream.getvalue()
    monkeypatch.setitem(sys.modules, "rich.progress", None)
    stream = Terminal()
    progress = Progress(2, 0, log_interval=5, stream=stream)
    progress.update(_row(2))
    progress.close()
    assert stream.getvalue().startswith("step 2/2  loss 2.0000"), stream.getvalue()


def test_plot_with_or_without_matplotlib(tmp_path, monkeypatch):
    path = tmp_path / "metrics.jsonl"
    assert plot_loss(path.with_name("none.jsonl"), tmp_path / "b.png") == "no steps were logged"
    path.write_text("".join(json.dumps(_row(s)) + "\n" for s in (1, 2, 3)))
    with monkeypatch.context() as patch:
        patch.setitem(sys.modules, "matplotlib", None)  # as if not installed
        assert plot_loss(path, tmp_path / "a.png") is None  # the built-in chart
    assert (tmp_path / "a.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    pytest.importorskip("matplotlib", reason="the matplotlib plot needs matplotlib")
    assert plot_loss(path, tmp_path / "loss.png") is None
    assert (tmp_path / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
