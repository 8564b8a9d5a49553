"""A real `kvserve serve`, after some requests, exports vLLM 0.32's metric families as vLLM does:
compared with vLLM's own /metrics recorded here (tests/data/vllm_metrics/after.prom, same
max_model_len), every shared family has the same type, label names and histogram buckets; the
vLLM families kvserve does not export are listed below with the reason each; and the numbers
follow the requests that were sent."""

from __future__ import annotations

from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.server.harness import Metrics, ServerProcess

VLLM_METRICS = Path(__file__).resolve().parents[1] / "data" / "vllm_metrics" / "after.prom"

# vLLM 0.32 families a kvserve worker does not export, and why: kvserve has no such quantity.
NOT_EXPORTED = {
    "vllm:estimated_flops_per_gpu": "an estimate from vLLM's per-model FLOP formulas "
                                    "(--enable-mfu-metrics); kvserve measures no FLOPs",
    "vllm:estimated_read_bytes_per_gpu": "the same MFU estimate's memory reads",
    "vllm:estimated_write_bytes_per_gpu": "the same MFU estimate's memory writes",
    "vllm:engine_sleep_state": "kvserve has no sleep mode (weights are never offloaded)",
    "vllm:external_prefix_cache_queries": "kvserve has no KV connector; KV pulled from a "
                                          "prefill worker is counted by kvserve:kv_transfer_*",
    "vllm:external_prefix_cache_hits": "as external_prefix_cache_queries",
    "vllm:mm_cache_queries": "kvserve serves text models only: no multimodal cache",
    "vllm:mm_cache_hits": "as mm_cache_queries",
}
# What the Gateway API Inference Extension's model-server protocol reads from a vLLM worker
# (vllm:lora_requests_info too, which vLLM exports only with LoRA adapters, as kvserve does:
# tests/lora/test_lora_http.py).
MODEL_SERVER_PROTOCOL = ("vllm:num_requests_waiting", "vllm:num_requests_running",
                         "vllm:kv_cache_usage_perc", "vllm:cache_config_info")


def families(text: str) -> dict[str, tuple[str, frozenset[str], tuple[str, ...]]]:
    """vllm: family -> (type, label names, histogram bucket bounds); `_created` companions
    (prometheus_client's creation timestamps) are not families of their own."""
    parsed = list(text_string_to_metric_families(text))
    names = {f.name for f in parsed}
    out = {}
    for family in parsed:
        if not family.name.startswith("vllm:"):
            continue
        if family.name.endswith("_created") and family.name.removesuffix("_created") in names:
            continue
        labels = frozenset(k for s in family.samples for k in s.labels if k != "le")
        buckets = tuple(sorted({s.labels["le"] for s in family.samples if "le" in s.labels},
                               key=float))
        out[family.name] = (family.type, labels, buckets)
    return out


@pytest.fixture(scope="module")
def scrapes(server: ServerProcess) -> tuple[Metrics, Metrics, str]:
    """(/metrics before, /metrics after, the text after) four requests (five samples)."""
    before = server.metrics()
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="dummy", max_retries=0)
    model = client.models.list().data[0].id
    prompt = list(range(10, 90))
    client.completions.create(model=model, prompt=prompt, max_tokens=6, temperature=0)
    client.completions.create(model=model, prompt=prompt, max_tokens=6, temperature=0)
    # the last two sample (temperature 0.7, and the API's default 1.0), so EOS is ignored:
    # every sample ends by length whatever the draws
    client.completions.create(model=model, prompt=prompt[:40], max_tokens=5, n=2,
                              temperature=0.7, extra_body={"ignore_eos": True})
    for _ in client.completions.create(model=model, prompt=prompt[::-1], max_tokens=4,
                                       stream=True, extra_body={"ignore_eos": True}):
        pass
    text = httpx.get(f"{server.url}/metrics", timeout=10.0).text
    return before, Metrics(text), text


def test_shared_families_have_vllm_types_labels_and_buckets(
        scrapes: tuple[Metrics, Metrics, str]) -> None:
    vllm = families(VLLM_METRICS.read_text())
    ours = families(scrapes[2])
    assert len(vllm) >= 39, sorted(vllm)
    missing = set(vllm) - set(ours)
    assert missing == set(NOT_EXPORTED), (
        f"not exported and not listed: {sorted(missing - set(NOT_EXPORTED))}; "
        f"listed yet exported: {sorted(set(NOT_EXPORTED) - missing)}")
    assert not set(ours) - set(vllm), "vllm: names vLLM does not have"
    for name in sorted(set(vllm) & set(ours)):
        assert ours[name] == vllm[name], (name, ours[name], vllm[name])
    for name in MODEL_SERVER_PROTOCOL:
        assert name in ours


def test_cache_config_info_has_vllms_full_label_set(
        scrapes: tuple[Metrics, Metrics, str]) -> None:
    _, after, _ = scrapes
    (labels,) = [lab for n, lab, _ in after.samples if n == "vllm:cache_config_info"]
    assert len(labels) == 37
    assert labels["block_size"] == "16" and labels["enable_prefix_caching"] == "True"
    assert labels["engine"] == "0" and labels["prefix_caching_hash_algo"] == "sha256"
    assert labels["cache_dtype"] == "auto"  # the flag as given, as vLLM reports it
    blocks = int(labels["num_gpu_blocks"])
    assert int(labels["kv_cache_size_tokens"]) == blocks * 16


def test_the_numbers_follow_the_requests(scrapes: tuple[Metrics, Metrics, str]) -> None:
    before, after, _ = scrapes

    def delta(name: str, **labels: str) -> float:
        return after.value(name, **labels) - before.value(name, **labels)

    m = {"engine": "0"}
    assert delta("vllm:request_success_total", **m) == 5  # the n=2 request has two samples
    assert delta("vllm:request_success_total", finished_reason="length", **m) == 5
    for histogram in ("queue", "prefill", "decode", "inference"):
        assert delta(f"vllm:request_{histogram}_time_seconds_count", **m) == 4, histogram
        assert delta(f"vllm:request_{histogram}_time_seconds_sum", **m) >= 0, histogram
    assert delta("vllm:request_prompt_tokens_sum", **m) == 80 + 80 + 40 + 80
    assert delta("vllm:request_generation_tokens_sum", **m) == 6 + 6 + 10 + 4
    assert delta("vllm:request_max_num_generation_tokens_sum", **m) == 6 + 6 + 5 + 4
    assert delta("vllm:request_params_n_sum", **m) == 5
    assert delta("vllm:request_params_max_tokens_sum", **m) == 6 + 6 + 5 + 4
    assert delta("vllm:request_num_preemptions_count", **m) == 4
    computed = delta("vllm:prompt_tokens_by_source_total", source="local_compute", **m)
    cached = delta("vllm:prompt_tokens_by_source_total", source="local_cache_hit", **m)
    assert computed + cached == delta("vllm:prompt_tokens_total", **m) == 280
    assert cached == delta("vllm:prompt_tokens_cached_total", **m) >= 64  # the repeat hits
    assert delta("vllm:request_prefill_kv_computed_tokens_sum", **m) == computed
    # every step that computed tokens is counted once; they computed what was not cached
    assert delta("vllm:iteration_tokens_total_count", **m) > 0
    assert delta("vllm:iteration_tokens_total_sum", **m) >= computed
    assert delta("vllm:time_to_first_token_seconds_count", **m) == 4
    assert delta("vllm:request_time_per_output_token_seconds_count", **m) == 4
    assert after.value("vllm:num_requests_waiting_by_reason", reason="capacity", **m) == 0
    assert after.value("vllm:admission_rejections_total", reason="max_num_queued_reqs") == 0
