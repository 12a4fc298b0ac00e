"""Chat records: rendered with the model's own template, loss on assistant turns only,
exactly one BOS, the turn-ending EOT trained, the tokenizer's EOS (not a config list's
first entry). Single process, with a Llama-3-style tokenizer built in the test."""

from __future__ import annotations

import json

import pytest
from chat_cases import CONVERSATIONS, LLAMA3_TEMPLATE, assistant_texts, write_chat_tokenizer

from usp.models import PRESETS
from usp.train.data import (
    ByteTokenizer,
    DataError,
    PackedDataset,
    build_tokenizer,
    micro_batch_of,
    read_jsonl,
)

pytest.importorskip("tokenizers", reason="the chat tests build a tokenizer.json with tokenizers")
pytest.importorskip("jinja2", reason="chat templates are rendered with jinja2")

BOS, EOT, END = "<|begin_of_text|>", "<|eot_id|>", "<|end_of_text|>"


def chat_tokenizer(tmp_path, template_in="jinja"):
    ids = write_chat_tokenizer(tmp_path / "model", template_in=template_in)
    config = PRESETS["tiny"].replace(
        vocab_size=ids["vocab_size"], bos_token_id=ids[BOS], eos_token_id=[ids[END], ids[EOT]]
    )
    tok = build_tokenizer("model", model_dir=None, model_config=config, config_dir=tmp_path)
    return tok, ids


def rendered_by_hand(conversation) -> str:
    """The Llama-3 format written out (independent of the template and of jinja2)."""
    turns = "".join(
        f"<|start_header_id|>{m['role']}<|end_header_id|>\n\n{m['content'].strip()}{EOT}"
        for m in conversation
    )
    return BOS + turns


def runs_of(ids, flags):
    """Contiguous runs of flagged tokens."""
    runs, current = [], []
    for token, flag in zip(ids, flags, strict=True):
        if flag:
            current.append(token)
        elif current:
            runs.append(current)
            current = []
    return runs + ([current] if current else [])


@pytest.mark.parametrize("template_in", ["jinja", "tokenizer_config", "generation_tags"])
def test_assistant_turns_only_are_trained(tmp_path, template_in):
    tok, ids = chat_tokenizer(
        tmp_path, "jinja" if template_in == "generation_tags" else template_in
    )
    if template_in == "generation_tags":  # transformers' assistant-mask markup renders as is
        template = LLAMA3_TEMPLATE.replace(
            "{{ content }}", "{% generation %}{{ content }}{% endgeneration %}"
        )
        (tmp_path / "model" / "chat_template.jinja").write_text(template)
        config = PRESETS["tiny"].replace(vocab_size=tok.vocab_size, eos_token_id=tok.eos_id)
        tok = build_tokenizer("model", model_dir=None, model_config=config, config_dir=tmp_path)
        assert "{% generation %}" in tok.chat_template
    assert tok.eos_id == ids[EOT], "tokenizer_config's eos_token, not the config list's first"
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps({"messages": c}) + "\n" for c in CONVERSATIONS))
    documents, _ = read_jsonl([path], tok)
    total = 0
    for doc, conversation in zip(documents, CONVERSATIONS, strict=True):
        tokens, flags = doc.tokens.tolist(), doc.target.tolist()
        assert tok.decode(tokens) == rendered_by_hand(conversation)
        assert tokens.count(ids[BOS]) == 1 and tokens[0] == ids[BOS], "one BOS: the template's"
        assert tokens[-1] == ids[EOT] and flags[-1], "the EOT closing the last turn is trained"
        runs = runs_of(tokens, flags)
        assert [tok.decode(r) for r in runs] == assistant_texts(conversation)
        # count against the spans encoded on their own (content, then the EOT)
        expected = sum(
            len(tok.encode(m["content"].strip())) + 1
            for m in conversation
            if m["role"] == "assistant"
        )
        assert sum(flags) == expected
        total += expected
    ds = PackedDataset(documents, seq_len=256, document_multiple=1, pad_id=0, seed=0, shuffle=False)
    assert micro_batch_of([ds.sequence(0)]).num_labels == total, "every trained token is a label"


def test_text_and_pairs_get_one_bos_and_the_tokenizers_eos(tmp_path):
    tok, ids = chat_tokenizer(tmp_path)
    path = tmp_path / "d.jsonl"
    records = [{"text": "Hello, world!"}, {"prompt": "Say hello", "completion": " world"}]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    (text, pair), _ = read_jsonl([path], tok)
    assert tok.decode(text.tokens.tolist()) == f"{BOS}Hello, world!{EOT}"
    assert text.tokens.tolist().count(ids[BOS]) == 1, "the post-processor adds no second BOS"
    assert tok.decode(pair.tokens[pair.target].tolist()) == f" world{EOT}"
    assert "EOS" in tok.describe() and "'<|eot_id|>'" in tok.describe()


def test_chat_errors_name_the_line(tmp_path):
    tok, _ = chat_tokenizer(tmp_path)
    cases = [
        ([{"role": "user", "content": "hi"}], 'has no "assistant" turn'),
        ([{"role": "user"}], 'messages[0] must be an object with string "role" and "content"'),
        ("hello", '"messages" must be a non-empty list'),
    ]
    for messages, message in cases:
        path = tmp_path / "bad.jsonl"
        path.write_text(json.dumps({"messages": CONVERSATIONS[1]}) + "\n")
        path.write_text(path.read_text() + json.dumps({"messages": messages}) + "\n")
        with pytest.raises(DataError) as info:
            read_jsonl([path], tok)
        assert str(info.value).startswith(f"{path}:2: ") and message in str(info.value), info.value
    path.write_text(json.dumps({"messages": CONVERSATIONS[1]}) + "\n")
    with pytest.raises(DataError, match=rf"{path}:1: \"messages\" records need a chat template"):
        read_jsonl([path], ByteTokenizer())


def test_templates_that_rewrite_earlier_turns_are_refused(tmp_path):
    tok, _ = chat_tokenizer(tmp_path)
    (tmp_path / "model" / "chat_template.jinja").write_text(
        "{{ messages | length }}" + LLAMA3_TEMPLATE  # the prefix changes with every turn
    )
    config = PRESETS["tiny"].replace(vocab_size=tok.vocab_size)
    tok = build_tokenizer("model", model_dir=None, model_config=config, config_dir=tmp_path)
    path = tmp_path / "chat.jsonl"
    path.write_text(json.dumps({"messages": CONVERSATIONS[0]}) + "\n")
    with pytest.raises(DataError, match="renders earlier turns differently"):
        read_jsonl([path], tok)
    (tmp_path / "model" / "chat_template.jinja").write_text("{% for m in messages %}")
    with pytest.raises(DataError, match="does not compile"):
        read_jsonl(
            [path],
            build_tokenizer("model", model_dir=None, model_config=config, config_dir=tmp_path),
        )
