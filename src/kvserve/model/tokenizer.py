"""Tokenizer: a small wrapper over ``tokenizer.json`` plus ``tokenizer_config.json``.

Encoding and decoding are the ``tokenizers`` library's, unchanged (special tokens such as BOS are
added by tokenizer.json's post-processor). Chat templates render with jinja2 in an immutable
sandbox configured as Hugging Face does (trim_blocks, lstrip_blocks, loop controls,
``raise_exception``, ``strftime_now``, a non-escaping ``tojson``), so a model's own template
produces the same prompt text as ``transformers``' ``apply_chat_template``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as _HFTokenizer

from kvserve.model.errors import ModelLoadError


class ChatTemplateError(ValueError):
    """The chat template refused the messages (its ``raise_exception``) or failed to render."""


class Tokenizer:
    """Text <-> token ids for one model, and its chat template. Immutable after construction."""

    def __init__(self, tokenizer: _HFTokenizer, *, bos_token: str | None = None,
                 eos_token: str | None = None, chat_template: str | None = None,
                 tool_chat_template: str | None = None) -> None:
        self._tokenizer = tokenizer
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.chat_template = chat_template
        self.bos_token_id = None if bos_token is None else tokenizer.token_to_id(bos_token)
        self.eos_token_id = None if eos_token is None else tokenizer.token_to_id(eos_token)
        self._template = _compile(chat_template)
        self._tool_template = _compile(tool_chat_template)

    @classmethod
    def from_pretrained(cls, path: str | Path) -> Tokenizer:
        """Load ``tokenizer.json`` and (optional) ``tokenizer_config.json`` from a model directory.

        The chat template comes from tokenizer_config.json, else from ``chat_template.jinja``;
        from a list of named templates ``default`` is used, and ``tool_use`` when tools are given.
        """
        path = Path(path)
        tok_file = path / "tokenizer.json"
        if not tok_file.is_file():
            raise ModelLoadError(f"{tok_file}: file not found; kvserve needs a fast-tokenizer "
                                 "tokenizer.json (sentencepiece-only models are not supported)")
        try:
            tokenizer = _HFTokenizer.from_file(str(tok_file))
        except Exception as exc:  # the Rust library raises plain Exception
            raise ModelLoadError(f"{tok_file}: cannot load it with tokenizers ({exc})") from exc
        config: dict[str, Any] = {}
        config_file = path / "tokenizer_config.json"
        if config_file.is_file():
            try:
                config = json.loads(config_file.read_text(encoding="utf-8"))
            except (OSError, ValueError) as exc:
                raise ModelLoadError(f"{config_file}: cannot read it as JSON ({exc})") from exc
        template = config.get("chat_template")
        tool_template = None
        if isinstance(template, list):
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template, tool_template = named.get("default"), named.get("tool_use")
        jinja_file = path / "chat_template.jinja"
        if template is None and jinja_file.is_file():
            template = jinja_file.read_text(encoding="utf-8")
        return cls(tokenizer, bos_token=_token_text(config.get("bos_token")),
                   eos_token=_token_text(config.get("eos_token")), chat_template=template,
                   tool_chat_template=tool_template)

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included."""
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; special tokens per tokenizer.json's post-processor."""
        return self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        """Text of ``token_ids``; unknown ids are dropped."""
        return self._tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        """The vocabulary entry of one id (in the tokenizer's own byte-level form), or None."""
        return self._tokenizer.id_to_token(token_id)

    def token_to_id(self, token: str) -> int | None:
        """The id of one vocabulary entry, or None."""
        return self._tokenizer.token_to_id(token)

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], *,
                            add_generation_prompt: bool = True,
                            tools: Sequence[Mapping[str, Any]] | None = None,
                            **template_kwargs: Any) -> str:
        """Render the conversation to prompt text with the model's chat template.

        Raises ChatTemplateError when the model has no template or the template rejects the
        messages (e.g. roles out of order); the message is the template's own.
        """
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
            return template.render(**context)
        except ChatTemplateError:
            raise
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"chat template failed: {exc}") from exc

    def encode_chat(self, messages: Sequence[Mapping[str, Any]], *,
                    add_generation_prompt: bool = True,
                    tools: Sequence[Mapping[str, Any]] | None = None,
                    **template_kwargs: Any) -> list[int]:
        """Token ids of the rendered conversation. The template writes its own special tokens,
        so none are added on top (as HF's ``apply_chat_template(tokenize=True)``)."""
        text = self.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                        tools=tools, **template_kwargs)
        return self.encode(text, add_special_tokens=False)


def _compile(source: str | None) -> jinja2.Template | None:
    if source is None:
        return None
    try:
        return _environment().from_string(source)
    except jinja2.TemplateError as exc:
        raise ModelLoadError(f"chat template does not compile: {exc}") from exc


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
