"""Exact route keys from the model's own tokenizer, for the `precise` policy.

A kvserve worker hashes a completion prompt's token ids (its tokenizer, special tokens added)
in blocks of its block size, with the served model name and the tenant's cache salt folded into
the first block. With the same tokenizer file the gateway computes the very same hashes
(`RouteKey.from_token_ids`), so the worker's KV events name the blocks a request will hit. A chat
request is rendered with the model's own chat template first (`kvserve.chat_template`, the code
the worker runs), when the model directory has one.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from kvserve.chat_template import ChatTemplate, ChatTemplateLoadError, template_message
from kvserve.gateway.core.prefix import DEFAULT_BLOCK_TOKENS
from kvserve.gateway.core.token_memo import MemoLimits, TokenMemo


class TokenKeyer:
    """Tokenizes prompts, and renders and tokenizes conversations, exactly as the workers do.
    Both go through a prefix memo (`TokenMemo`: the tokens of a shared head are reused); like
    the memos, a keyer is used from one thread, the gateway's event loop."""

    def __init__(self, tokenizer_path: str | Path, block_size: int = DEFAULT_BLOCK_TOKENS,
                 memo_limits: MemoLimits | None = None):
        path = Path(tokenizer_path)
        file = path / "tokenizer.json" if path.is_dir() else path
        if not file.is_file():
            raise ValueError(f"--tokenizer {tokenizer_path}: no tokenizer.json there; give the "
                             "model directory the workers serve (or its tokenizer.json)")
        if block_size < 1:
            raise ValueError(f"--block-size must be >= 1, got {block_size}")
        self.tokenizer = Tokenizer.from_file(str(file))
        self.block_size = block_size
        self.prompt_memo = TokenMemo(self.tokenizer, add_special_tokens=True, limits=memo_limits)
        self.chat_memo = TokenMemo(self.tokenizer, add_special_tokens=False, limits=memo_limits)
        try:
            self.chat_template: ChatTemplate | None = ChatTemplate.from_model_dir(file.parent)
        except ChatTemplateLoadError as exc:
            raise ValueError(f"--tokenizer {tokenizer_path}: {exc}") from exc
        if not self.chat_template.available:
            self.chat_template = None  # chat requests keep canonical-text keys

    def encode(self, prompt: str) -> list[int]:
        """The prompt's token ids, special tokens added, as a worker tokenizes it."""
        return self.prompt_memo.encode(prompt)

    def encode_chat(self, messages: Sequence[Mapping[str, Any]],
                    tools: Sequence[Mapping[str, Any]] | None,
                    add_generation_prompt: bool) -> list[int] | None:
        """The conversation's token ids as a worker builds them, or None without a template
        or when the template rejects the messages (the worker will refuse them too)."""
        if self.chat_template is None:
            return None
        try:
            text = self.chat_template.render([template_message(m) for m in messages],
                                             add_generation_prompt=add_generation_prompt,
                                             tools=tools)
        except ValueError:  # ChatTemplateError, or a message the template cannot use
            return None
        return self.chat_memo.encode(text)
