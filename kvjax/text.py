"""A model's text side: its tokenizer, its chat template, and text decoded as tokens arrive.

`text_tokenizer` finds them for a ``--model`` value without reading a weight or importing jax:

* a checkpoint directory: ``tokenizer.json``; the chat template from ``chat_template.jinja`` or
  ``tokenizer_config.json``'s ``chat_template`` (with its ``bos_token`` / ``eos_token``);
* a GGUF file (``kvjax.gguf.locate``): the tokenizer rebuilt from its metadata
  (``kvjax.gguf.tokenizer``) and ``tokenizer.chat_template``;
* anything else (a preset): None.

`TextTokenizer.chat_prompt` renders one user turn with the model's template
(``kvjax.hf.chat_template``, the assistant's turn opened); `IncrementalText` turns a growing list
of ids into the text added since the last call, holding back an incomplete UTF-8 character.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvjax.errors import ConfigError
from kvjax.hf.chat_template import render_chat

_REPLACEMENT = "\ufffd"  # what a decoder writes for bytes that are not (yet) a whole character


@dataclasses.dataclass(frozen=True)
class TextTokenizer:
    """A ``tokenizers.Tokenizer`` with the model's chat template (None when it has none)."""

    tokenizer: Any
    chat_template: str | None = None
    bos_token: str | None = None
    eos_token: str | None = None

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """``text``'s ids (``add_special_tokens``: the tokenizer's BOS, when it adds one)."""
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: Sequence[int]) -> str:
        """The text of ``ids``, special tokens (``<|im_end|>``) left out."""
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=True))

    def chat_prompt(self, user: str, *, system: str | None = None) -> str:
        """``user`` as one user turn (after ``system``'s, if given) under the chat template, the
        assistant's turn opened; a `ConfigError` when the model has no template."""
        if self.chat_template is None:
            raise ConfigError("chat", user[:40], "the model has no chat template; drop --chat or add one")
        messages = ([{"role": "system", "content": system}] if system is not None else []) + [
            {"role": "user", "content": user}
        ]
        return render_chat(self.chat_template, messages, bos_token=self.bos_token, eos_token=self.eos_token)

    def encode_chat(self, user: str, *, system: str | None = None) -> list[int]:
        """The ids of `chat_prompt` (the template writes its own special tokens: none are added)."""
        return self.encode(self.chat_prompt(user, system=system), add_special_tokens=False)


class IncrementalText:
    """The text of a token stream, piece by piece: ``push(ids)`` takes every id so far and returns
    the text they add to what was returned before. Text ending in an incomplete UTF-8 character
    (a decoder's U+FFFD) is held back until the character completes (or `flush`)."""

    def __init__(self, tokenizer: TextTokenizer) -> None:
        self.tokenizer = tokenizer
        self.emitted = ""
        self._ids: list[int] = []

    def push(self, ids: Sequence[int]) -> str:
        self._ids = list(ids)
        text = self.tokenizer.decode(self._ids)
        if text.endswith(_REPLACEMENT) or not text.startswith(self.emitted):
            return ""
        new, self.emitted = text[len(self.emitted) :], text
        return new

    def flush(self) -> str:
        """Whatever is left, incomplete characters included."""
        text = self.tokenizer.decode(self._ids)
        new = text[len(self.emitted) :] if text.startswith(self.emitted) else ""
        self.emitted = text
        return new


def _token_text(value: Any) -> str | None:
    """A ``tokenizer_config.json`` special token: a string, or an ``AddedToken`` dict's content."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _directory_tokenizer(path: Path) -> TextTokenizer | None:
    file = path / "tokenizer.json"
    if not file.is_file():
        return None
    from tokenizers import Tokenizer

    config: dict[str, Any] = {}
    with contextlib.suppress(OSError, json.JSONDecodeError):
        loaded = json.loads((path / "tokenizer_config.json").read_text())
        config = loaded if isinstance(loaded, dict) else {}
    template_file = path / "chat_template.jinja"
    template = template_file.read_text() if template_file.is_file() else config.get("chat_template")
    return TextTokenizer(
        Tokenizer.from_file(str(file)),
        template if isinstance(template, str) else None,
        _token_text(config.get("bos_token")),
        _token_text(config.get("eos_token")),
    )


def text_tokenizer(model: str | Path) -> TextTokenizer | None:
    """The `TextTokenizer` of ``--model`` (see the module docstring), or None when it has none."""
    from kvjax.gguf.locate import gguf_path

    gguf = gguf_path(model)
    if gguf is not None:
        from kvjax.gguf.reader import read_gguf
        from kvjax.gguf.tokenizer import build_tokenizer, special_token

        file = read_gguf(gguf)
        template = file.metadata.get("tokenizer.chat_template")
        return TextTokenizer(
            build_tokenizer(file),
            template if isinstance(template, str) else None,
            special_token(file, "bos"),
            special_token(file, "eos"),
        )
    path = Path(model)
    return _directory_tokenizer(path) if path.is_dir() else None
