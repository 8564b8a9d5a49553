"""Tokenizer: a small wrapper over ``tokenizer.json`` plus ``tokenizer_config.json``.

Encoding and decoding are the ``tokenizers`` library's, unchanged (special tokens such as BOS are
added by tokenizer.json's post-processor). Chat templates render through
``kvserve.chat_template`` (shared with the gateway), so a model's own template produces the same
prompt text as ``transformers``' ``apply_chat_template``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as _HFTokenizer

from kvserve.chat_template import (
    ChatTemplate,
    ChatTemplateError,
    ChatTemplateLoadError,
    read_template_sources,
)
from kvserve.model.errors import ModelLoadError
from kvserve.model.gguf.locate import find_gguf
from kvserve.model.gguf.reader import open_gguf
from kvserve.model.gguf.tokenizer import build_tokenizer, special_token

__all__ = ["ChatTemplateError", "Tokenizer"]


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
        try:
            self._chat = ChatTemplate(chat_template, tool_chat_template, bos_token, eos_token)
        except ChatTemplateLoadError as exc:
            raise ModelLoadError(str(exc)) from exc

    @classmethod
    def from_pretrained(cls, path: str | Path, *, chat_template: str | None = None) -> Tokenizer:
        """Load ``tokenizer.json`` and (optional) ``tokenizer_config.json`` from a model directory,
        or build the tokenizer of a .gguf file (or of a directory's one .gguf, when it has no
        tokenizer.json).

        The chat template comes from tokenizer_config.json, else from ``chat_template.jinja``;
        from a list of named templates ``default`` is used, and ``tool_use`` when tools are given.
        ``chat_template`` (source text) replaces them all.
        """
        path = Path(path)
        gguf_file = find_gguf(path)
        if gguf_file is not None and not (path / "tokenizer.json").is_file():
            return cls.from_gguf(gguf_file, chat_template=chat_template)
        tok_file = path / "tokenizer.json"
        if not tok_file.is_file():
            raise ModelLoadError(f"{tok_file}: file not found; kvserve needs a fast-tokenizer "
                                 "tokenizer.json (sentencepiece-only models are not supported)")
        try:
            tokenizer = _HFTokenizer.from_file(str(tok_file))
        except Exception as exc:  # the Rust library raises plain Exception
            raise ModelLoadError(f"{tok_file}: cannot load it with tokenizers ({exc})") from exc
        try:  # compiled once, by __init__
            template, tool_template, bos, eos = read_template_sources(path)
        except ChatTemplateLoadError as exc:
            raise ModelLoadError(str(exc)) from exc
        if chat_template is not None:
            template, tool_template = chat_template, None
        return cls(tokenizer, bos_token=bos, eos_token=eos, chat_template=template,
                   tool_chat_template=tool_template)

    @classmethod
    def from_gguf(cls, path: str | Path, *, chat_template: str | None = None) -> Tokenizer:
        """Build the tokenizer a GGUF file describes (kvserve.model.gguf.tokenizer): its
        vocabulary, special tokens and ``tokenizer.chat_template``; ``chat_template`` replaces
        the file's."""
        gguf_file = open_gguf(path)
        template = chat_template
        if template is None:
            stored = gguf_file.metadata.get("tokenizer.chat_template")
            template = stored if isinstance(stored, str) else None
        return cls(build_tokenizer(gguf_file), bos_token=special_token(gguf_file, "bos"),
                   eos_token=special_token(gguf_file, "eos"), chat_template=template)

    def with_chat_template(self, chat_template: str) -> Tokenizer:
        """The same tokenizer with `chat_template` (source text) as its only template."""
        return Tokenizer(self._tokenizer, bos_token=self.bos_token, eos_token=self.eos_token,
                         chat_template=chat_template)

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included."""
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    def to_json(self) -> str:
        """The tokenizer as tokenizer.json text (grammar libraries build their token tables
        from it)."""
        return self._tokenizer.to_str()

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
        return self._chat.render(messages, add_generation_prompt=add_generation_prompt,
                                 tools=tools, **template_kwargs)

    def encode_chat(self, messages: Sequence[Mapping[str, Any]], *,
                    add_generation_prompt: bool = True,
                    tools: Sequence[Mapping[str, Any]] | None = None,
                    **template_kwargs: Any) -> list[int]:
        """Token ids of the rendered conversation. The template writes its own special tokens,
        so none are added on top (as HF's ``apply_chat_template(tokenize=True)``)."""
        text = self.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                        tools=tools, **template_kwargs)
        return self.encode(text, add_special_tokens=False)
