"""Chat records rendered with the model's own chat template, loss on assistant turns only.

A conversation ``{"messages": [{"role": ..., "content": ...}, ...]}`` is rendered once
with the template (jinja2, imported lazily, in a sandbox as transformers does), and
tokenised as a whole, the template's special tokens parsed from the text (usp adds none
on top: no doubled BOS/EOS). The characters of assistant turn ``k`` are found by
rendering prefixes: the turn starts where ``messages[:k]`` rendered with the generation
prompt ends (so the ``assistant`` header is not trained) and ends where ``messages[:k+1]``
ends (so what the template closes the turn with, e.g. ``<|eot_id|>``, is trained). A
token is trained when its first character lies in such a span. Templates whose earlier
turns change when a later one is added cannot be split this way and are refused.
"""

from __future__ import annotations

import bisect
import datetime
import json

from usp.errors import DataError


def _environment():
    try:
        import jinja2
        import jinja2.ext
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:
        raise DataError(
            'rendering "messages" records with the chat template needs jinja2: pip install jinja2'
        ) from None

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(
            value,
            ensure_ascii=ensure_ascii,
            indent=indent,
            separators=separators,
            sort_keys=sort_keys,
        )

    class Generation(jinja2.ext.Extension):
        """``{% generation %}...{% endgeneration %}`` (templates written for
        transformers' assistant masks) renders its body; turns are found by prefixes."""

        tags = {"generation"}

        def parse(self, parser):
            next(parser.stream)
            return parser.parse_statements(("name:endgeneration",), drop_needle=True)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols", Generation]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    return env, jinja2.exceptions.TemplateError


class ChatRenderer:
    """One tokenizer's chat template, compiled once."""

    def __init__(self, tokenizer):
        if getattr(tokenizer, "chat_template", None) is None:
            raise DataError(
                '"messages" records need a chat template, and the tokenizer has none: put a '
                "chat_template.jinja (or a chat_template in tokenizer_config.json) next to "
                "tokenizer.json, or give the records as prompt/completion"
            )
        env, self._error = _environment()
        self._tokenizer = tokenizer
        try:
            self._template = env.from_string(tokenizer.chat_template)
        except self._error as err:
            raise DataError(
                f"the chat template of {tokenizer.path} does not compile: {err}"
            ) from None
        self._specials = {
            "bos_token": tokenizer.token(tokenizer.bos_id) or "",
            "eos_token": tokenizer.token(tokenizer.eos_id) or "",
        }

    def render(self, messages: list[dict], *, add_generation_prompt: bool, where: str) -> str:
        try:
            return self._template.render(
                messages=messages, add_generation_prompt=add_generation_prompt, **self._specials
            )
        except self._error as err:
            raise DataError(f"{where}: the chat template failed: {err}") from None

    def document(self, messages, *, where: str) -> tuple[list[int], list[bool]]:
        """Token ids of the rendered conversation and, per token, whether it is trained."""
        _check_messages(messages, where)
        text = self.render(messages, add_generation_prompt=False, where=where)
        spans = []
        for k, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            start = self.render(messages[:k], add_generation_prompt=True, where=where)
            through = self.render(messages[: k + 1], add_generation_prompt=False, where=where)
            if not (through.startswith(start) and text.startswith(through)):
                raise DataError(
                    f"{where}: the chat template renders earlier turns differently once a "
                    "later turn is added, so assistant turns cannot be located; render the "
                    'conversation yourself and give it as "input_ids" + "labels"'
                )
            spans.append((len(start), len(through)))
        ids, offsets = self._tokenizer.encode_with_offsets(text)
        starts = [a for a, _ in spans]
        target = []
        for first, _ in offsets:
            i = bisect.bisect_right(starts, first) - 1
            target.append(i >= 0 and first < spans[i][1])
        return ids, target


def _check_messages(messages, where: str) -> None:
    if not (isinstance(messages, list) and messages):
        raise DataError(f'{where}: "messages" must be a non-empty list of {{"role", "content"}}')
    for i, m in enumerate(messages):
        if not (
            isinstance(m, dict)
            and isinstance(m.get("role"), str)
            and isinstance(m.get("content"), str)
        ):
            raise DataError(
                f'{where}: messages[{i}] must be an object with string "role" and "content", '
                f"got {json.dumps(m)[:80]}"
            )
    if not any(m["role"] == "assistant" for m in messages):
        raise DataError(
            f'{where}: the conversation has no "assistant" turn, so nothing in it is trained; '
            "remove it or add the answer"
        )
