"""The gateway's exact keys for conversations: the model's template when it has one, the
canonical-text key when it has none or the template refuses the messages."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from kvserve.gateway.core.route_key import route_request_for
from kvserve.gateway.core.token_keys import TokenKeyer

MESSAGES = [{"role": "user", "content": "Summarise the quarterly filing. " * 4}]


def test_without_a_chat_template_a_conversation_keeps_its_text_key(tiny_model: Path,
                                                                    tmp_path: Path) -> None:
    shutil.copy(tiny_model / "tokenizer.json", tmp_path / "tokenizer.json")
    keyer = TokenKeyer(tmp_path)
    assert keyer.chat_template is None and keyer.encode_chat(MESSAGES, None, True) is None
    body = {"model": "m", "messages": MESSAGES}
    assert route_request_for("/v1/chat/completions", body, "s", keyer) == \
        route_request_for("/v1/chat/completions", body, "s")


def test_a_template_that_refuses_the_messages_falls_back_to_the_text_key(tiny_model: Path,
                                                                         tmp_path: Path) -> None:
    shutil.copy(tiny_model / "tokenizer.json", tmp_path / "tokenizer.json")
    refusing = "{% if messages[0]['role'] != 'system' %}{{ raise_exception('system first') }}" \
               "{% endif %}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": refusing}))
    keyer = TokenKeyer(tmp_path)
    assert keyer.encode_chat(MESSAGES, None, True) is None
    system_first = [{"role": "system", "content": "rules"}, *MESSAGES]
    ids = keyer.encode_chat(system_first, None, True)
    assert ids == keyer.tokenizer.encode("rules" + MESSAGES[0]["content"],
                                         add_special_tokens=False).ids


def test_a_template_that_does_not_compile_is_a_clear_error(tiny_model: Path,
                                                           tmp_path: Path) -> None:
    shutil.copy(tiny_model / "tokenizer.json", tmp_path / "tokenizer.json")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{% if %}"}))
    with pytest.raises(ValueError, match=r"--tokenizer .*does not compile"):
        TokenKeyer(tmp_path)
