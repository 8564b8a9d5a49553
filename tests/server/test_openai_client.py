"""The worker through the official `openai` client: completions and chat, whole and streamed."""

from __future__ import annotations

from pathlib import Path

import httpx
import openai
import pytest

from kvserve.model import Tokenizer
from tests.server.harness import ServerProcess

PROMPT = "Hello there, tell me"
MESSAGES = [{"role": "user", "content": "Say something."}]
RUN = {"ignore_eos": True}  # random weights: never let an early EOS shorten a test


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="dummy", max_retries=0,
                         timeout=60.0)


@pytest.fixture(scope="module")
def model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def _complete(client: openai.OpenAI, model: str, **kwargs: object):  # type: ignore[no-untyped-def]
    args = {"prompt": PROMPT, "max_tokens": 16, "temperature": 0.0, "extra_body": RUN} | kwargs
    return client.completions.create(model=model, **args)  # type: ignore[call-overload]


def _stop_from(text: str) -> str:
    """Two printable ASCII characters of `text` (not at its start), so the stop surely occurs."""
    for i in range(1, len(text) - 1):
        pair = text[i:i + 2]
        if pair.isascii() and pair.isprintable() and not pair.isspace():
            return pair
    raise AssertionError(f"no printable ASCII pair in {text!r}; pick another prompt")


def test_models_lists_the_served_model(client: openai.OpenAI, checkpoint: Path) -> None:
    models = client.models.list().data
    assert [m.id for m in models] == [str(checkpoint)]
    assert models[0].object == "model"
    assert models[0].model_extra["max_model_len"] == 256


def test_completion_greedy_length_and_usage(client: openai.OpenAI, model: str) -> None:
    first = _complete(client, model, max_tokens=12)
    again = _complete(client, model, max_tokens=12)
    (choice,) = first.choices
    assert choice.index == 0 and choice.finish_reason == "length" and choice.text
    assert again.choices[0].text == choice.text
    assert first.object == "text_completion" and first.model == model
    usage = first.usage
    assert usage.completion_tokens == 12
    assert usage.prompt_tokens > 0
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


def test_completion_stream_matches_whole_and_reports_usage(client: openai.OpenAI,
                                                           model: str) -> None:
    whole = _complete(client, model)
    chunks = list(_complete(client, model, stream=True,
                            stream_options={"include_usage": True}))
    *body, last = chunks
    assert last.choices == [] and last.usage is not None
    assert last.usage.completion_tokens == 16
    assert last.usage.prompt_tokens == whole.usage.prompt_tokens
    assert last.usage.total_tokens == whole.usage.total_tokens
    assert all(c.usage is None for c in body)
    assert "".join(c.choices[0].text for c in body) == whole.choices[0].text
    reasons = [c.choices[0].finish_reason for c in body]
    assert reasons[-1] == "length" and set(reasons[:-1]) <= {None}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_completion_stop_string_cuts_the_output(client: openai.OpenAI, model: str,
                                                stream: bool) -> None:
    full = _complete(client, model, max_tokens=24).choices[0].text
    stop = _stop_from(full)
    expected = full[:full.index(stop)]
    if stream:
        chunks = list(_complete(client, model, max_tokens=24, stop=[stop], stream=True))
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        reason = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
    else:
        choice = _complete(client, model, max_tokens=24, stop=[stop]).choices[0]
        text, reason = choice.text, choice.finish_reason
    assert text == expected
    assert stop not in text
    assert reason == "stop"


def test_chat_stop_string(client: openai.OpenAI, model: str) -> None:
    full = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=24,
                                          temperature=0.0, extra_body=RUN)
    text = full.choices[0].message.content
    stop = _stop_from(text)
    cut = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=24,
                                         temperature=0.0, stop=stop, extra_body=RUN)
    assert cut.choices[0].message.content == text[:text.index(stop)]
    assert cut.choices[0].finish_reason == "stop"


def test_n_samples_have_their_indexes(client: openai.OpenAI, model: str) -> None:
    response = _complete(client, model, n=3, max_tokens=5)
    assert [c.index for c in response.choices] == [0, 1, 2]
    assert {c.finish_reason for c in response.choices} == {"length"}
    assert response.usage.completion_tokens == 15
    chat = client.chat.completions.create(model=model, messages=MESSAGES, n=3, max_tokens=5,
                                          temperature=1.0, seed=3, extra_body=RUN)
    assert [c.index for c in chat.choices] == [0, 1, 2]
    assert chat.usage.completion_tokens == 15


def test_completion_logprobs(client: openai.OpenAI, model: str) -> None:
    choice = _complete(client, model, max_tokens=6, logprobs=2).choices[0]
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    assert lp.text_offset == sorted(lp.text_offset)
    for token_logprob, top in zip(lp.token_logprobs, lp.top_logprobs, strict=True):
        assert token_logprob <= 0.0
        assert 1 <= len(top) <= 2  # two ids may decode to the same text
        assert all(v <= 0.0 for v in top.values())
        assert token_logprob >= max(top.values()) - 1e-4  # greedy took the most likely token


def test_chat_logprobs(client: openai.OpenAI, model: str) -> None:
    response = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=5,
                                              temperature=0.0, logprobs=True, top_logprobs=2,
                                              extra_body=RUN)
    content = response.choices[0].logprobs.content
    assert len(content) == response.usage.completion_tokens == 5
    for entry in content:
        assert entry.logprob <= 0.0
        assert len(entry.top_logprobs) == 2
        assert all(t.logprob <= 0.0 for t in entry.top_logprobs)
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob, abs=1e-4)


def test_streamed_logprobs_cover_every_token(client: openai.OpenAI, model: str) -> None:
    chunks = list(_complete(client, model, max_tokens=12, logprobs=1, stream=True))
    assert sum(len(c.choices[0].logprobs.tokens) for c in chunks if c.choices) == 12
    chat_chunks = list(client.chat.completions.create(
        model=model, messages=MESSAGES, max_tokens=12, temperature=0.0, logprobs=True,
        top_logprobs=1, stream=True, extra_body=RUN))
    entries = [e for c in chat_chunks if c.choices and c.choices[0].logprobs
               for e in c.choices[0].logprobs.content]
    assert len(entries) == 12 and all(e.logprob <= 0.0 for e in entries)


def test_stream_of_several_prompts_and_samples(client: openai.OpenAI, model: str) -> None:
    """Every choice of a multi-prompt, n > 1 stream gets all its text and one finish reason."""
    args = {"prompt": ["Hello", "The weather today"], "n": 2, "max_tokens": 10}
    whole = _complete(client, model, **args)
    texts: dict[int, str] = {}
    reasons: dict[int, list[str]] = {}
    for chunk in _complete(client, model, stream=True, **args):
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
            if choice.finish_reason is not None:
                reasons.setdefault(choice.index, []).append(choice.finish_reason)
    assert texts == {c.index: c.text for c in whole.choices}
    assert reasons == {i: ["length"] for i in range(4)}


def test_chat_whole_and_stream_agree(client: openai.OpenAI, model: str) -> None:
    whole = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=10,
                                           temperature=0.0, extra_body=RUN)
    (choice,) = whole.choices
    assert whole.object == "chat.completion"
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason == "length"
    assert whole.usage.completion_tokens == 10
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + 10
    chunks = list(client.chat.completions.create(
        model=model, messages=MESSAGES, max_tokens=10, temperature=0.0, stream=True,
        stream_options={"include_usage": True}, extra_body=RUN))
    *body, last = chunks
    assert body[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in body) == choice.message.content
    assert body[-1].choices[0].finish_reason == "length"
    assert last.choices == [] and last.usage.completion_tokens == 10
    assert last.usage.prompt_tokens == whole.usage.prompt_tokens


def test_seed_makes_sampling_reproducible(client: openai.OpenAI, model: str) -> None:
    texts = [_complete(client, model, temperature=1.0, seed=seed).choices[0].text
             for seed in (1234, 1234, 4321)]
    assert texts[0] == texts[1]
    assert texts[0] != texts[2]
    chats = [client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=12,
                                            temperature=1.0, seed=99, extra_body=RUN)
             .choices[0].message.content for _ in range(2)]
    assert chats[0] == chats[1]


def test_prompt_as_token_ids(client: openai.OpenAI, model: str, checkpoint: Path) -> None:
    token_ids = Tokenizer.from_pretrained(checkpoint).encode(PROMPT)
    by_ids = _complete(client, model, prompt=token_ids)
    by_text = _complete(client, model)
    assert by_ids.usage.prompt_tokens == len(token_ids)
    assert by_ids.choices[0].text == by_text.choices[0].text


def test_prompt_as_list_of_strings(client: openai.OpenAI, model: str) -> None:
    prompts = ["Hello", "The weather today"]
    batch = _complete(client, model, prompt=prompts, n=2, max_tokens=4)
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]  # prompt index * n + sample
    singles = [_complete(client, model, prompt=p, max_tokens=4) for p in prompts]
    # each prompt counts once, however many samples it has (as OpenAI and vLLM count)
    assert batch.usage.prompt_tokens == sum(s.usage.prompt_tokens for s in singles)
    assert batch.usage.completion_tokens == 16


def test_request_id_is_echoed(server: ServerProcess, model: str) -> None:
    with server.client() as http:
        response = http.post("/v1/completions", headers={"X-Request-Id": "req-abc-123"},
                             json={"model": model, "prompt": PROMPT, "max_tokens": 2})
        assert response.status_code == 200
        assert response.headers["x-request-id"] == "req-abc-123"
        assert response.json()["id"] == "cmpl-req-abc-123"
        with http.stream("POST", "/v1/chat/completions", headers={"X-Request-Id": "req-s-9"},
                         json={"messages": MESSAGES, "max_tokens": 2, "stream": True}) as stream:
            assert stream.headers["x-request-id"] == "req-s-9"
            lines = [line for line in stream.iter_lines() if line]
        assert lines[-1] == "data: [DONE]"
        error = http.post("/v1/completions", headers={"X-Request-Id": "req-bad"},
                          json={"prompt": PROMPT, "max_tokens": 0})
        assert error.status_code == 400 and error.headers["x-request-id"] == "req-bad"
        assert "x-request-id" not in http.get("/health").headers


def test_openai_client_raises_typed_errors(client: openai.OpenAI, model: str) -> None:
    with pytest.raises(openai.NotFoundError):
        _complete(client, "no-such-model")
    with pytest.raises(openai.BadRequestError) as excinfo:
        _complete(client, model, max_tokens=0)
    assert "max_tokens" in excinfo.value.message


def test_health(server: ServerProcess) -> None:
    response = httpx.get(f"{server.url}/health", timeout=10.0)
    assert response.status_code == 200 and response.json() == {"status": "ok", "role": "both"}
