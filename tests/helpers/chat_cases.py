"""A small Llama-3-style tokenizer with a chat template, built in the test (nothing
downloaded): a byte-level BPE ``tokenizer.json`` trained on a few sentences, whose
post-processor adds ``<|begin_of_text|>`` (as Llama 3's does, so a doubled BOS would
show), the Llama-3-Instruct chat template, and ``tokenizer_config.json`` naming
``<|eot_id|>`` as the EOS while the model config lists ``[<|end_of_text|>, <|eot_id|>]``."""

from __future__ import annotations

import json
from pathlib import Path

SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>"]
SPECIALS += ["<|eot_id|>", "<|pad|>"]

# The Llama-3-Instruct template (as in its tokenizer_config.json).
LLAMA3_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'"
    "+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{% endif %}"
)

CONVERSATIONS = [
    [
        {"role": "system", "content": "You answer briefly."},
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "Paris is the capital."},
        {"role": "user", "content": "And of Italy?"},
        {"role": "assistant", "content": " Rome, of course. "},
    ],
    [
        {"role": "user", "content": "Say hello to the world."},
        {"role": "assistant", "content": "Hello, world!"},
    ],
    [
        {"role": "user", "content": "Count: one two three"},
        {"role": "assistant", "content": "four five six"},
        {"role": "user", "content": "thanks"},
        {"role": "assistant", "content": "You are welcome, café ☕."},
    ],
]


def write_chat_tokenizer(directory: Path, *, template_in: str = "jinja") -> dict:
    """Write ``tokenizer.json``, ``tokenizer_config.json`` (and ``chat_template.jinja``
    when ``template_in == "jinja"``) into ``directory``; return the special ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    sentences = [m["content"] for c in CONVERSATIONS for m in c] * 4
    sentences += ["system user assistant", "the quick brown fox jumps over the lazy dog"]
    tk.train_from_iterator(sentences, trainer)
    ids = {s: tk.token_to_id(s) for s in SPECIALS}
    bos = "<|begin_of_text|>"
    tk.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", special_tokens=[(bos, ids[bos])]
    )
    directory.mkdir(parents=True, exist_ok=True)
    tk.save(str(directory / "tokenizer.json"))
    config = {"bos_token": bos, "eos_token": "<|eot_id|>", "pad_token": "<|pad|>"}
    if template_in == "jinja":
        (directory / "chat_template.jinja").write_text(LLAMA3_TEMPLATE)
    else:
        config["chat_template"] = LLAMA3_TEMPLATE
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return {"vocab_size": tk.get_vocab_size(with_added_tokens=True), **ids}


def assistant_texts(conversation: list[dict]) -> list[str]:
    """What the template makes of each assistant turn: the trimmed content and the EOT."""
    return [m["content"].strip() + "<|eot_id|>" for m in conversation if m["role"] == "assistant"]
