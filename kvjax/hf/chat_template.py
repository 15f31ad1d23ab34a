"""A model's chat template (Jinja, as Hugging Face stores it) rendered into one prompt.

Templates come with the model (``tokenizer_config.json``'s ``chat_template``, a
``chat_template.jinja`` file, or a GGUF file's ``tokenizer.chat_template``) and are untrusted
code: they run in Jinja's immutable sandbox, as Transformers runs them, with the same
environment (``trim_blocks``, ``lstrip_blocks``, loop controls, ``raise_exception``, ``tojson``,
``strftime_now``) so that the rendered text is the text Transformers' ``apply_chat_template``
gives. A template that fails is a `ConfigError` quoting Jinja's message.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

from kvjax.errors import ConfigError

#: A chat message: ``{"role": "system" | "user" | "assistant", "content": text}``.
Message = Mapping[str, str]


@functools.lru_cache(maxsize=8)
def _compiled(template: str) -> Any:
    try:
        import jinja2
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:
        raise ConfigError("chat", "jinja2", "chat templates need the jinja2 package: pip install jinja2") from None

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, sort_keys: bool = False) -> str:
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(template)
    except jinja2.exceptions.TemplateError as e:
        raise ConfigError("chat_template", template[:60], f"is not a valid Jinja template ({e})") from None


def render_chat(
    template: str,
    messages: Sequence[Message],
    *,
    add_generation_prompt: bool = True,
    bos_token: str | None = None,
    eos_token: str | None = None,
) -> str:
    """The prompt text of ``messages`` under ``template`` (with the assistant's opening when
    ``add_generation_prompt``). Raises `ConfigError` when the template raises or is invalid."""
    import jinja2

    try:
        return str(
            _compiled(template).render(
                messages=list(messages),
                add_generation_prompt=add_generation_prompt,
                bos_token=bos_token or "",
                eos_token=eos_token or "",
            )
        )
    except jinja2.exceptions.TemplateError as e:
        raise ConfigError(
            "chat", messages[-1].get("content", "")[:40] if messages else "", f"the chat template refused it: {e}"
        ) from None
