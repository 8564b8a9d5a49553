"""vLLM's offline API on kvserve: prompt dicts, use_tqdm, SamplingParams fields, LLM(...) and
chat arguments, prompt logprobs and stop reasons, and a vLLM script run unchanged."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.engine import FinishReason
from kvserve.model import kv_cache_bytes_per_block, load_model
from kvserve.runtime import EngineArgs, LLMEngine
from kvserve.runtime.memory_budget import device_memory_bytes, model_bytes
from tests.runtime.conftest import (
    PARITY_ARCHS,
    assert_no_blocks_held,
    make_engine,
    random_prompt,
    run_to_completion,
)

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(checkpoints: dict[str, Path]) -> LLM:
    return LLM(str(checkpoints["llama_gqa"]), block_size=4, num_kv_blocks=128, num_threads=1,
               trust_remote_code=True, enforce_eager=True, dtype="float32",
               tensor_parallel_size=1)


def _reference_logprobs(path: Path, prompt: list[int]) -> torch.Tensor:
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    with torch.no_grad():
        logits = model.eval()(torch.tensor([prompt])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)  # [len(prompt), vocab]


@pytest.mark.parametrize("arch", PARITY_ARCHS)
def test_prompt_logprobs_match_a_full_forward(checkpoints: dict[str, Path], arch: str) -> None:
    """Chunked prefill (7-token steps), n = 2 and a warm prefix cache give every prompt token
    transformers' logprob, and the top alternatives in order."""
    engine = make_engine(checkpoints[arch], max_num_batched_tokens=7)
    prompt = random_prompt(30, seed=5)
    ref = _reference_logprobs(checkpoints[arch], prompt)
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True, prompt_logprobs=3,
                            n=2)
    engine.add_request("warm", prompt, SamplingParams(max_tokens=1))
    run_to_completion(engine)  # the prompt's blocks are in the prefix cache now
    engine.add_request("a", prompt, params)
    out = run_to_completion(engine)["a"]
    assert out.num_cached_tokens == 0  # no hit: cached tokens have no logits
    scored = out.prompt_logprobs
    assert scored is not None and len(scored) == len(prompt) and scored[0] is None
    for position in range(1, len(prompt)):
        entry = scored[position]
        assert entry is not None and entry.token_id == prompt[position]
        assert entry.logprob == pytest.approx(ref[position - 1, prompt[position]].item(),
                                              abs=1e-4)
        top_ids = ref[position - 1].topk(3).indices
        assert [t for t, _ in entry.top] == top_ids.tolist()
    assert_no_blocks_held(engine)


def test_stop_reason_names_the_stop_string_or_token(checkpoints: dict[str, Path]) -> None:
    engine = make_engine(checkpoints["llama_gqa"])
    prompt = random_prompt(12, seed=2)
    engine.add_request("free", prompt, GREEDY)
    free = run_to_completion(engine)["free"].outputs[0]
    assert free.finish_reason == "length" and free.stop_reason is None
    text, second = free.text, free.token_ids[1]
    engine.add_request("tok", prompt, SamplingParams(temperature=0.0, max_tokens=4,
                                                    ignore_eos=True, stop_token_ids=[second]))
    engine.add_request("str", prompt, SamplingParams(temperature=0.0, max_tokens=4,
                                                    ignore_eos=True, stop=[text[-1]]))
    done = run_to_completion(engine)
    assert done["tok"].outputs[0].finish_reason == "stop"
    assert done["tok"].outputs[0].stop_reason == second
    assert done["str"].outputs[0].stop_reason == text[-1]


def test_generate_takes_vllm_prompts(llm: LLM) -> None:
    ids = llm.tokenizer.encode("Hello world")
    plain = llm.generate(["Hello world", ids], GREEDY, use_tqdm=False)
    dicts = llm.generate([{"prompt": "Hello world"}, {"prompt_token_ids": ids},
                          {"prompt": "Hello world", "cache_salt": "tenant-b"}], GREEDY,
                         use_tqdm=False)
    texts = [o.outputs[0].text for o in (*plain, *dicts)]
    assert len(set(texts)) == 1
    assert dicts[0].prompt == "Hello world" and dicts[1].prompt_token_ids == ids
    assert dicts[2].num_cached_tokens == 0  # another tenant's salt: no hit
    single = llm.generate({"prompt_token_ids": ids}, GREEDY, use_tqdm=False)
    assert single[0].outputs[0].text == texts[0]


@pytest.mark.parametrize(("prompt", "message"), [
    ({"prompt": "a", "prompt_token_ids": [1]}, "exactly one"),
    ({"text": "a"}, "not supported"),
    ({"prompt_token_ids": "abc"}, "list of integers"),
    ({"prompt": 5}, "must be a string"),
    (3.5, "a prompt must be"),
])
def test_bad_prompts_are_named(llm: LLM, prompt: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        llm.generate([prompt], GREEDY, use_tqdm=False)  # type: ignore[list-item]


def test_use_tqdm_takes_a_callable(llm: LLM) -> None:
    class Bar:
        def __init__(self, total: int, desc: str) -> None:
            self.total, self.desc, self.count, self.closed = total, desc, 0, False

        def update(self, n: int = 1) -> None:
            self.count += n

        def close(self) -> None:
            self.closed = True

    bars: list[Bar] = []

    def factory(**kwargs: object) -> Bar:
        bars.append(Bar(**kwargs))  # type: ignore[arg-type]
        return bars[-1]

    llm.generate(["a", "b", "c"], GREEDY, use_tqdm=factory)
    assert [(b.total, b.count, b.closed) for b in bars] == [(3, 3, True)]
    llm.generate(["a"], GREEDY, use_tqdm=True)
    llm.generate(["a"], GREEDY, False)


def test_sampling_params_fields_of_vllm(llm: LLM) -> None:
    ids = llm.tokenizer.encode("one two three four five")
    cut = llm.generate([ids], SamplingParams(temperature=0.0, max_tokens=2,
                                             truncate_prompt_tokens=3), use_tqdm=False)[0]
    assert cut.prompt_token_ids == ids[-3:]
    raw = llm.generate([ids], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True,
                                             detokenize=False), use_tqdm=False)[0]
    assert raw.outputs[0].text == "" and len(raw.outputs[0].token_ids) == 3
    assert SamplingParams(n=2, best_of=2).best_of == 2
    for kwargs, message in [({"n": 1, "best_of": 3}, "best_of"),
                            ({"spaces_between_special_tokens": False},
                             "spaces_between_special_tokens"),
                            ({"detokenize": False, "stop": ["x"]}, "detokenize"),
                            ({"prompt_logprobs": 21}, "prompt_logprobs"),
                            ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens")]:
        with pytest.raises(ValueError, match=message):
            SamplingParams(**kwargs)  # type: ignore[arg-type]


def test_llm_refuses_vllm_arguments_it_cannot_honour(checkpoints: dict[str, Path]) -> None:
    path = str(checkpoints["llama_gqa"])
    for kwargs, message in [({"quantization": "awq"}, "quantization"),
                            ({"pipeline_parallel_size": 2}, "pipeline_parallel_size"),
                            ({"kv_cache_dtype": "fp8"}, "kvserve has no fp8 KV cache")]:
        with pytest.raises(ValueError, match=message):
            LLM(path, num_kv_blocks=16, num_threads=1, **kwargs)
    with pytest.raises(TypeError, match="no_such_argument"):
        LLM(path, no_such_argument=1)


def test_gpu_memory_utilization_sizes_the_cache(checkpoints: dict[str, Path]) -> None:
    """(utilization x the device's memory - the weights) / bytes per block, on CPU the RAM."""
    engine = make_engine(checkpoints["llama_gqa"], num_kv_blocks=None,
                         gpu_memory_utilization=0.002)
    per_block = kv_cache_bytes_per_block(engine.runner.model.config, 4, torch.float32)
    total = device_memory_bytes(torch.device("cpu"))
    weights = model_bytes(load_model(checkpoints["llama_gqa"]).model)  # dense, as loaded
    want = (int(0.002 * total) - weights) // per_block
    assert engine.kv_cache.stats().num_blocks == want > 0
    with pytest.raises(ValueError, match="gpu-memory-utilization"):
        make_engine(checkpoints["llama_gqa"], num_kv_blocks=None,
                    gpu_memory_utilization=1e-12)


def test_kv_cache_dtype_is_the_caches_dtype(checkpoints: dict[str, Path]) -> None:
    engine = LLMEngine.from_args(EngineArgs(model=str(checkpoints["llama_gqa"]),
                                            dtype="bfloat16", kv_cache_dtype="bf16",
                                            num_kv_blocks=8, block_size=4, num_threads=1,
                                            onednn_linear=False))
    # Where the CPU has no bf16 instructions --dtype bfloat16 runs float32, over the bf16
    # cache asked for all the same.
    assert engine.runner.kv_caches[0].key_cache.dtype == torch.bfloat16


def test_chat_takes_vllm_arguments(llm: LLM, tmp_path: Path) -> None:
    conversation = [{"role": "user", "content": "hi"}, {"role": "assistant",
                                                        "content": "Sure, here"}]
    tok = llm.tokenizer
    cont = llm.chat(conversation, GREEDY, use_tqdm=False, add_generation_prompt=False,
                    continue_final_message=True)[0]
    assert tok.decode(cont.prompt_token_ids, skip_special_tokens=False).endswith("Sure, here")
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}")
    for given in (str(template), template.read_text()):
        out = llm.chat(conversation[:1], GREEDY, use_tqdm=False, chat_template=given)[0]
        assert tok.decode(out.prompt_token_ids) == "[user] hi\n"
    with pytest.raises(ValueError, match="no such file"):
        llm.chat(conversation[:1], GREEDY, use_tqdm=False, chat_template="missing.jinja")
    with pytest.raises(ValueError, match="lora_request"):
        llm.chat(conversation[:1], GREEDY, lora_request=object())


VLLM_SCRIPT = '''
import json

from vllm import LLM, SamplingParams
from vllm.sampling_params import StructuredOutputsParams

if __name__ == "__main__":
    prompts = ["Hello, my name is", "The capital of France is"]
    sampling_params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=8, seed=0)
    llm = LLM(model=MODEL_DIR, dtype="float32", max_model_len=256, seed=0,
              gpu_memory_utilization=0.002, tensor_parallel_size=1, trust_remote_code=True,
              enforce_eager=True, enable_prefix_caching=True)
    outputs = llm.generate(prompts, sampling_params, use_tqdm=False)
    for output in outputs:
        print(f"Prompt: {output.prompt!r}, Generated text: {output.outputs[0].text!r}")
    scored = llm.generate([{"prompt_token_ids": [5, 6, 7, 8]}, {"prompt": "Hi"}],
                          SamplingParams(temperature=0.0, max_tokens=2, logprobs=1,
                                         prompt_logprobs=1))
    print("prompt logprobs:", len(scored[0].prompt_logprobs), scored[0].outputs[0].finish_reason)
    chat = llm.chat([{"role": "user", "content": "Hello"}], SamplingParams(max_tokens=4),
                    use_tqdm=False)
    print("chat:", len(chat[0].outputs[0].token_ids) <= 4)
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    constrained = SamplingParams(max_tokens=20, structured_outputs=StructuredOutputsParams(
        json=schema))
    answer = llm.generate(["Answer in JSON:"], constrained, use_tqdm=False)[0].outputs[0].text
    print("json:", sorted(json.loads(answer)))
'''


def test_a_vllm_script_runs_unchanged(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    """vLLM's quickstart shape with `vllm` renamed `kvserve` (MODEL_DIR set in front)."""
    script = tmp_path / "offline.py"
    source = VLLM_SCRIPT.replace("from vllm", "from kvserve")
    script.write_text(f"MODEL_DIR = {json.dumps(str(checkpoints['llama_gqa']))}\n"
                      + textwrap.dedent(source))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("Prompt: 'Hello, my name is', Generated text: ")
    assert lines[1].startswith("Prompt: 'The capital of France is', Generated text: ")
    assert lines[2] in ("prompt logprobs: 4 length", "prompt logprobs: 4 stop")
    assert lines[3] == "chat: True"
    assert lines[4] == "json: ['ok']"


ANSWER = {"type": "object", "properties": {
    "word": {"enum": ["yes", "no", "maybe"]},
    "count": {"type": "integer", "minimum": 0, "maximum": 99},
    "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}},
    "required": ["word", "count", "tags"], "additionalProperties": False}


def test_structured_outputs_in_generate(llm: LLM) -> None:
    """vLLM 0.32's `structured_outputs=StructuredOutputsParams(json=...)`, and vLLM <= 0.10's
    `guided_decoding=GuidedDecodingParams(...)`, constrain `LLM.generate` on random weights:
    every sample parses and validates (each schema's longest document fits max_tokens)."""
    jsonschema = pytest.importorskip("jsonschema")
    from kvserve.sampling_params import GuidedDecodingParams, StructuredOutputsParams

    params = [SamplingParams(temperature=1.0, seed=seed, max_tokens=80,
                             structured_outputs=StructuredOutputsParams(json=ANSWER))
              for seed in range(8)]
    outputs = llm.generate(["Reply:"] * 8, params, use_tqdm=False)
    for output in outputs:
        assert output.outputs[0].finish_reason is FinishReason.STOP
        jsonschema.validate(json.loads(output.outputs[0].text), ANSWER)
    choice = SamplingParams(temperature=1.0, seed=3, max_tokens=8,
                            guided_decoding=GuidedDecodingParams(choice=["red", "green"]))
    texts = [o.outputs[0].text for o in llm.generate(["Color:"] * 4, choice, use_tqdm=False)]
    assert set(texts) <= {"red", "green"}, texts
    as_text = SamplingParams(max_tokens=80, structured_outputs=StructuredOutputsParams(
        json=json.dumps(ANSWER)))
    jsonschema.validate(json.loads(llm.generate("Reply:", as_text)[0].outputs[0].text), ANSWER)


@pytest.mark.parametrize(("kwargs", "needle"), [
    ({"structured_outputs": "json"}, "StructuredOutputsParams"),
    ({}, "exactly one of json, regex, choice or json_object, got none"),
    ({"regex": "a+", "choice": ["a"]}, "exactly one"),
    ({"grammar": "start: 'a'"}, "grammar is not supported"),
    ({"json": {"type": "object"}, "disable_additional_properties": True},
     "additionalProperties: false"),
])
def test_unsupported_structured_outputs_are_errors(kwargs: dict[str, object],
                                                   needle: str) -> None:
    from kvserve.sampling_params import GuidedDecodingParams, StructuredOutputsParams

    with pytest.raises(ValueError, match=needle):
        if kwargs.get("structured_outputs") == "json":  # not a params object
            SamplingParams(structured_outputs={"json": {}})  # type: ignore[arg-type]
        else:
            SamplingParams(structured_outputs=StructuredOutputsParams(**kwargs))  # type: ignore
    with pytest.raises(ValueError, match="llguidance"):
        SamplingParams(guided_decoding=GuidedDecodingParams(regex="a", backend="xgrammar"))
    with pytest.raises(ValueError, match="one output constraint"):
        SamplingParams(guided_decoding=GuidedDecodingParams(regex="a"),
                       structured_outputs=StructuredOutputsParams(regex="b"))
