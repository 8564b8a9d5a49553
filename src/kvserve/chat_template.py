"""A model's chat template, rendered as Hugging Face renders it; shared by the worker and the
gateway so both turn a conversation into the very same prompt text (and so the same blocks).

Templates render with jinja2 in an immutable sandbox configured as `transformers` does
(trim_blocks, lstrip_blocks, loop controls, ``raise_exception``, ``strftime_now``, a
non-escaping ``tojson``). No torch, no kvserve imports: the gateway may use it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment


class ChatTemplateError(ValueError):
    """The chat template refused the messages (its ``raise_exception``) or failed to render."""


class ChatTemplateLoadError(ValueError):
    """A model directory's chat template files are unreadable or do not compile."""


def template_message(message: Mapping[str, Any]) -> dict[str, Any]:
    """A chat message as templates expect it: fields set to null dropped, a list of text parts
    flattened to one string, content "" when absent (the worker's and the gateway's rule)."""
    data = {k: v for k, v in message.items() if v is not None}
    content = data.get("content")
    if isinstance(content, list):
        data["content"] = "".join(part.get("text", "") for part in content
                                  if isinstance(part, Mapping))
    data.setdefault("content", "")
    return data


class ChatTemplate:
    """A model's chat template (and its tool-use variant), with the special tokens it uses.
    Compiled once; immutable after construction."""

    def __init__(self, source: str | None, tool_source: str | None = None,
                 bos_token: str | None = None, eos_token: str | None = None) -> None:
        self.source = source
        self.tool_source = tool_source
        self.bos_token = bos_token
        self.eos_token = eos_token
        self._template = _compile(source)
        self._tool_template = _compile(tool_source)

    @classmethod
    def from_model_dir(cls, path: str | Path) -> ChatTemplate:
        """The template of a model directory (`read_template_sources`), compiled."""
        return cls(*read_template_sources(path))

    @property
    def available(self) -> bool:
        return self.source is not None

    def render(self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True,
               tools: Sequence[Mapping[str, Any]] | None = None, **template_kwargs: Any) -> str:
        """The conversation as prompt text. Raises ChatTemplateError when there is no template
        or the template rejects the messages (e.g. roles out of order): its own message."""
        template = self._tool_template if tools and self._tool_template else self._template
        if template is None:
            raise ChatTemplateError("this model has no chat template (tokenizer_config.json "
                                    "has no 'chat_template'); use plain completions instead")
        context = {
            "bos_token": self.bos_token or "",
            "eos_token": self.eos_token or "",
            **template_kwargs,
            "messages": [dict(m) for m in messages],
            "add_generation_prompt": add_generation_prompt,
        }
        if tools is not None:
            context["tools"] = [dict(t) for t in tools]
        try:
            return str(template.render(**context))
        except ChatTemplateError:
            raise
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"chat template failed: {exc}") from exc


def read_template_sources(path: str | Path) -> tuple[str | None, str | None, str | None,
                                                    str | None]:
    """(template, tool-use template, bos token, eos token) of a model directory, uncompiled:
    from ``tokenizer_config.json`` (its ``chat_template``: a string, or a list of named
    templates of which ``default`` and ``tool_use`` are used), else ``chat_template.jinja``.
    A directory with neither has no template (None)."""
    path = Path(path)
    config: dict[str, Any] = {}
    config_file = path / "tokenizer_config.json"
    if config_file.is_file():
        try:
            config = json.loads(config_file.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise ChatTemplateLoadError(f"{config_file}: cannot read it as JSON ({exc})") from exc
    template = config.get("chat_template")
    tool_template = None
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template, tool_template = named.get("default"), named.get("tool_use")
    jinja_file = path / "chat_template.jinja"
    if template is None and jinja_file.is_file():
        template = jinja_file.read_text(encoding="utf-8")
    return (template, tool_template, _token_text(config.get("bos_token")),
            _token_text(config.get("eos_token")))


def open_final_message(text: str, messages: Sequence[Mapping[str, Any]]) -> str:
    """A rendered conversation cut right after the last message's content, dropping the
    end-of-turn the template wrote after it: the model continues that message (vLLM's and
    transformers' `continue_final_message`). ChatTemplateError when the content is not there."""
    content = messages[-1].get("content") if messages else None
    if not isinstance(content, str) or not content or content not in text:
        raise ChatTemplateError("continue_final_message needs the last message's text content "
                                "in the rendered prompt")
    return text[: text.rindex(content) + len(content)]


def template_argument(value: str) -> str:
    """A `--chat-template` value as template source: the file it names, else the value itself
    when it is a Jinja template (vLLM's rule). ChatTemplateLoadError for neither."""
    path = Path(value)
    try:
        if path.is_file():
            return path.read_text(encoding="utf-8")
    except OSError as exc:  # e.g. a template too long to be a file name
        if "{" not in value:
            raise ChatTemplateLoadError(f"--chat-template {value}: cannot read it ({exc})") \
                from exc
    if "{{" in value or "{%" in value:
        return value
    raise ChatTemplateLoadError(f"--chat-template {value!r}: no such file, and not a Jinja "
                                "template either; give a .jinja file's path or the template")


def _compile(source: str | None) -> jinja2.Template | None:
    if source is None:
        return None
    try:
        return _environment().from_string(source)
    except jinja2.TemplateError as exc:
        raise ChatTemplateLoadError(f"chat template does not compile: {exc}") from exc


def _token_text(value: Any) -> str | None:
    # tokenizer_config.json writes special tokens as a string or as an AddedToken dict.
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # jinja2's own tojson HTML-escapes (<, >, &, '), which would corrupt prompts.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env
