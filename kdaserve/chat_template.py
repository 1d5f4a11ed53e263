"""Chat templates: where a checkpoint keeps its template, and rendering it with jinja2 in a
sandbox, with the helpers HF templates expect (``raise_exception``, ``strftime_now``, a
``tojson`` that does not HTML-escape)."""

from __future__ import annotations

import datetime
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.sandbox

__all__ = ["CHAT_TEMPLATE_FILE", "DEFAULT_CHAT_TEMPLATE", "ChatTemplateRenderer",
           "load_chat_template", "normalize_messages"]

CHAT_TEMPLATE_FILE = "chat_template.jinja"

DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\n' + message['content'] + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)
"""Used when the checkpoint has no chat template: ``<|role|>\\ncontent\\n`` per message, then
``<|assistant|>\\n`` if a generation prompt is requested. The markers are plain text."""


def load_chat_template(directory: Path, config: Mapping[str, Any]) -> str | None:
    """The template in tokenizer_config.json, else chat_template.jinja beside it, else None."""
    template = config.get("chat_template")
    if isinstance(template, list):  # HF's named-template form: [{"name": ..., "template": ...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, Mapping)}
        template = named.get("default")
    if isinstance(template, str):
        return template
    path = directory / CHAT_TEMPLATE_FILE
    return path.read_text(encoding="utf-8") if path.is_file() else None


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


def _tojson(value: Any, indent: int | None = None, ensure_ascii: bool = False, **kw: Any) -> str:
    # Jinja's builtin tojson HTML-escapes <, >, & and ', which chat templates must not do.
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii, **kw)


def _make_jinja_env() -> jinja2.sandbox.ImmutableSandboxedEnvironment:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def _content_text(index: int, content: Any) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ValueError(
            f"messages[{index}]['content'] must be a string or a list of text parts, "
            f"got {type(content).__name__}"
        )
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, Mapping) or part.get("type") != "text":
            raise ValueError(f"messages[{index}]['content'][{j}] must be a {{'type': 'text'}} part")
        if not isinstance(part.get("text"), str):
            raise ValueError(f"messages[{index}]['content'][{j}]['text'] must be a string")
        texts.append(part["text"])
    return "\n".join(texts)


def normalize_messages(messages: Any) -> list[dict[str, Any]]:
    """Copy messages with content flattened to a string (text parts joined by newlines).

    A message carrying ``tool_calls`` may omit its content, and an assistant message's
    content may be null (OpenAI's shape; frameworks send ``content: null, tool_calls: []``):
    None becomes "".
    """
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list of dicts")
    normalized = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise ValueError(f"messages[{i}] must be a dict, got {type(message).__name__}")
        if not isinstance(message.get("role"), str):
            raise ValueError(f"messages[{i}] needs a string 'role'")
        content = message.get("content")
        if content is None and ("tool_calls" in message or message["role"] == "assistant"):
            content = ""
        elif "content" not in message:
            raise ValueError(f"messages[{i}] needs a 'content'")
        normalized.append({**message, "content": _content_text(i, content)})
    return normalized


class ChatTemplateRenderer:
    """Renders template sources, each compiled once (a server renders the same few)."""

    def __init__(self) -> None:
        self._env = _make_jinja_env()
        self._compiled: dict[str, jinja2.Template] = {}

    def render(self, source: str | None, messages: Any, *, add_generation_prompt: bool,
               bos_token: str | None, eos_token: str | None, **kwargs: Any) -> str:
        """Render ``source`` (None: DEFAULT_CHAT_TEMPLATE); message or template errors raise
        ValueError."""
        normalized = normalize_messages(messages)
        context = {
            "bos_token": bos_token or "",
            "eos_token": eos_token or "",
            **kwargs,
            "messages": normalized,
            "add_generation_prompt": add_generation_prompt,
        }
        try:
            return self._template(source).render(**context)
        except jinja2.TemplateError as exc:
            raise ValueError(f"chat template error: {exc}") from exc

    def _template(self, source: str | None) -> jinja2.Template:
        source = source if source is not None else DEFAULT_CHAT_TEMPLATE
        if source not in self._compiled:
            self._compiled[source] = self._env.from_string(source)
        return self._compiled[source]
