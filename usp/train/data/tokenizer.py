"""Tokenizers for training data: raw bytes, or a model's own ``tokenizer.json`` with its
special tokens and chat template.

Which special tokens a document gets (one BOS at its start, one EOS at its end, never
two) is decided here, once: the tokenizer's own ``tokenizer_config.json`` names them
(``bos_token``/``eos_token``: what the model's chat template uses too, e.g. ``<|eot_id|>``
for Llama-3-Instruct), else the model config's ``bos_token_id``/``eos_token_id`` (the
first entry of a list). The tokenizer's post-processor never adds any: text is encoded
with ``add_special_tokens=False``.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from pathlib import Path

from usp.errors import DataError, MissingDataFile


class ByteTokenizer:
    """Bytes of UTF-8 text as token ids (vocabulary 256). Control bytes that do not occur
    in text serve as special tokens: STX (2) begins a document, ETX (3) ends it, NUL (0)
    pads. It has no chat template."""

    vocab_size = 256
    bos_id = 2
    eos_id = 3
    pad_id = 0
    chat_template = None
    fingerprint = "byte"

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [list(t.encode("utf-8")) for t in texts]

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")

    def describe(self) -> str:
        return "bytes (BOS 2, EOS 3, pad 0)"


def _token_text(value) -> str | None:
    """A special token in tokenizer_config.json: a string, or ``{"content": ...}``."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _first_id(value) -> int | None:
    """``bos_token_id``/``eos_token_id`` may be a list in HF configs (the first is used)."""
    if isinstance(value, list):
        return value[0] if value else None
    return value


class HFTokenizer:
    """A ``tokenizer.json`` read with the ``tokenizers`` library (lazily imported), plus
    the ``tokenizer_config.json`` / ``chat_template.jinja`` next to it (optional)."""

    def __init__(self, path: Path, *, model_config):
        if path.is_dir():
            path = path / "tokenizer.json"
        if not path.is_file():
            raise MissingDataFile(f"tokenizer file {path}: no such file")
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise DataError(
                f"reading {path} needs the tokenizers library: pip install tokenizers "
                '(or use tokenizer = "byte" in [data])'
            ) from None
        self.path = path
        try:
            self._tokenizer = Tokenizer.from_file(str(path))
        except Exception as err:  # noqa: BLE001 - the library raises plain Exceptions
            raise DataError(f"tokenizer file {path} is not readable: {err}") from None
        self.vocab_size = self._tokenizer.get_vocab_size(with_added_tokens=True)
        settings = _read_json(path.parent / "tokenizer_config.json")
        self.bos_id = self._special(settings, "bos_token", model_config.bos_token_id)
        self.eos_id = self._special(settings, "eos_token", model_config.eos_token_id)
        pad = self._special(settings, "pad_token", model_config.pad_token_id)
        self.pad_id = pad if pad is not None else (self.eos_id if self.eos_id is not None else 0)
        self.chat_template = _chat_template(path.parent, settings)
        digest = hashlib.sha256(path.read_bytes())
        digest.update(repr((self.bos_id, self.eos_id, self.pad_id)).encode())
        digest.update((self.chat_template or "").encode())
        self.fingerprint = digest.hexdigest()

    def _special(self, settings: dict, key: str, from_config) -> int | None:
        text = _token_text(settings.get(key))
        if text is not None:
            token = self._tokenizer.token_to_id(text)
            if token is None:
                raise DataError(
                    f"{self.path.parent / 'tokenizer_config.json'}: {key} {text!r} is not a "
                    f"token of {self.path}"
                )
            return token
        return _first_id(from_config)

    def token(self, token_id: int | None) -> str | None:
        return None if token_id is None else self._tokenizer.id_to_token(token_id)

    def encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Several texts at once (the library spreads them over threads)."""
        return [e.ids for e in self._tokenizer.encode_batch(texts, add_special_tokens=False)]

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """Token ids and each token's ``(start, end)`` character span in ``text``."""
        encoding = self._tokenizer.encode(text, add_special_tokens=False)
        return encoding.ids, encoding.offsets

    def decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode([int(i) for i in ids], skip_special_tokens=False)

    def describe(self) -> str:
        def show(name, token_id):
            return f"{name} {token_id} {self.token(token_id)!r}" if token_id is not None else ""

        specials = ", ".join(s for s in (show("BOS", self.bos_id), show("EOS", self.eos_id)) if s)
        chat = ", with a chat template" if self.chat_template else ""
        return f"{self.path} ({self.vocab_size} tokens; {specials or 'no BOS/EOS'}{chat})"


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise DataError(f"{path}: not valid JSON: {err}") from None
    if not isinstance(data, dict):
        raise DataError(f"{path}: expected a JSON object")
    return data


def _chat_template(directory: Path, settings: dict) -> str | None:
    """``chat_template.jinja`` (what transformers 5 writes) or tokenizer_config.json's
    ``chat_template`` (a string, or a list of named templates: ``"default"`` is used)."""
    file = directory / "chat_template.jinja"
    if file.is_file():
        return file.read_text(encoding="utf-8")
    template = settings.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


def build_tokenizer(spec: str, *, model_dir: Path | None, model_config, config_dir: Path):
    """``"byte"``, ``"auto"`` (the model directory's ``tokenizer.json``; byte-level for a
    preset) or the path of a ``tokenizer.json`` or of the directory holding one (relative
    to the config file)."""
    if spec == "byte" or (spec == "auto" and model_dir is None):
        return ByteTokenizer()
    path = model_dir / "tokenizer.json" if spec == "auto" else config_dir / Path(spec).expanduser()
    if spec == "auto" and not path.is_file():
        raise MissingDataFile(
            f'[data] tokenizer = "auto" reads {path}, which does not exist; give the path '
            'of a tokenizer.json, or tokenizer = "byte"'
        )
    return HFTokenizer(path, model_config=model_config)
