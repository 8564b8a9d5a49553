"""LoRA over HTTP as vLLM serves it: --lora-modules, the request's `model`, /v1/models, the
admin routes that load and unload adapters, and the metrics routers read."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kvserve import LLM, LoRARequest, SamplingParams
from kvserve.model import write_random_checkpoint
from tests.lora.adapters import write_peft_adapter
from tests.model.arch_configs import base_config
from tests.server.harness import ADMIN_KEY, ServerProcess

pytest.importorskip("peft")
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
PROMPT = "hello adapters"


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lora-http")
    base = write_random_checkpoint(root / "tiny-llama", base_config(), seed=7)
    return {"base": base, "root": root,
            **{f"a{i}": write_peft_adapter(base, root / f"a{i}", rank=8 * (i + 1), seed=40 + i)
               for i in range(3)}}


@pytest.fixture(scope="module")
def server(files: dict[str, Path]) -> Iterator[ServerProcess]:
    modules = [f"a0={files['a0']}",
               json.dumps({"name": "a1", "path": str(files["a1"]), "base_model_name": "tiny"})]
    proc = ServerProcess(files["base"], files["root"] / "servers",
                         ["--enable-lora", "--max-loras", "2", "--max-lora-rank", "32",
                          "--served-model-name", "tiny", "--lora-modules", *modules])
    proc.wait_healthy()
    yield proc
    proc.stop()


def complete(server: ServerProcess, model: str) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/completions", timeout=60, json={
        "model": model, "prompt": PROMPT, "max_tokens": 8, "temperature": 0,
        "ignore_eos": True})


def test_the_request_model_picks_the_adapter_as_offline(server, files) -> None:
    texts = {m: complete(server, m).json()["choices"][0]["text"] for m in ("tiny", "a0", "a1")}
    llm = LLM(str(files["base"]), enable_lora=True, max_loras=2, max_lora_rank=32,
              num_threads=1)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    for i, name in enumerate(("a0", "a1")):
        (out,) = llm.generate(PROMPT, params, use_tqdm=False,
                              lora_request=LoRARequest(name, i + 1, str(files[name])))
        assert texts[name] == out.outputs[0].text
    assert texts["a0"] != texts["tiny"] and texts["a1"] != texts["tiny"]


def test_an_unknown_model_is_vllms_404(server) -> None:
    response = complete(server, "nope")
    assert response.status_code == 404
    error = response.json()["error"]
    assert error["message"] == "The model `nope` does not exist."
    assert error["type"] == "NotFoundError"


def test_models_lists_adapters_with_parent_and_root(server, files) -> None:
    cards = {c["id"]: c for c in httpx.get(f"{server.url}/v1/models").json()["data"]}
    assert set(cards) == {"tiny", "a0", "a1"}
    assert cards["tiny"]["parent"] is None
    assert (cards["a0"]["parent"], cards["a0"]["root"]) == ("tiny", str(files["a0"]))
    assert cards["a1"]["parent"] == "tiny"  # the JSON form's base_model_name


def test_load_and_unload_behind_the_admin_key(server, files) -> None:
    body = {"lora_name": "a2", "lora_path": str(files["a2"])}
    url = f"{server.url}/v1/load_lora_adapter"
    assert httpx.post(url, json=body).status_code == 401
    response = httpx.post(url, json=body, headers=ADMIN)
    assert response.status_code == 200, response.text
    assert response.text == "Success: LoRA adapter 'a2' added successfully."
    assert complete(server, "a2").status_code == 200
    again = httpx.post(url, json=body, headers=ADMIN)
    assert again.status_code == 400
    assert again.json()["error"]["message"] == "The lora adapter 'a2' has already been loaded."
    unload = f"{server.url}/v1/unload_lora_adapter"
    response = httpx.post(unload, json={"lora_name": "a2"}, headers=ADMIN)
    assert response.text == "Success: LoRA adapter 'a2' removed successfully."
    assert complete(server, "a2").status_code == 404
    missing = httpx.post(unload, json={"lora_name": "a2"}, headers=ADMIN)
    assert missing.status_code == 404
    assert missing.json()["error"]["message"] == "The lora adapter 'a2' cannot be found."


def test_a_bad_adapter_is_refused_naming_the_fix(server, files) -> None:
    url = f"{server.url}/v1/load_lora_adapter"
    response = httpx.post(url, json={"lora_name": "big", "lora_path": str(files["a2"])},
                          headers={"Authorization": f"Bearer {ADMIN_KEY}"})
    assert response.status_code == 200  # rank 24 fits --max-lora-rank 32
    empty = files["root"] / "empty"
    empty.mkdir(exist_ok=True)
    response = httpx.post(url, json={"lora_name": "x", "lora_path": str(empty)}, headers=ADMIN)
    assert response.status_code == 400
    assert "adapter_config.json" in response.json()["error"]["message"]


def test_metrics_name_the_adapters_as_vllm(server) -> None:
    for model in ("a0", "a1", "a0"):
        assert complete(server, model).status_code == 200
    metrics = server.metrics()
    info = [(labels, value) for name, labels, value in metrics.samples
            if name == "vllm:lora_requests_info"]
    assert info and all(labels["max_lora"] == "2" for labels, _ in info)
    assert {"running_lora_adapters", "waiting_lora_adapters"} <= set(info[0][0])
    assert max(value for _, value in info) > 1.7e9  # a Unix time, as vLLM's
    assert metrics.value("kvserve:lora_adapter_loads_total", adapter="a0") >= 1
    assert metrics.value("kvserve:lora_rows_total", adapter="a1") > 0
    assert [v for n, _, v in metrics.samples if n == "kvserve:lora_requests_waiting_for_slot"] \
        == [0.0]  # idle: nobody waits for a slot
