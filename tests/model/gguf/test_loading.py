"""A GGUF as the model argument everywhere a model is given: resolution, LLM(), `kvserve serve`
(positional and --model), the --tokenizer and --hf-config-path overrides, tensor-parallel
shards."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import httpx
import pytest
import torch
from gguf import GGMLQuantizationType as T

from kvserve.engine import SamplingParams
from kvserve.model import (
    LlamaForCausalLM,
    ModelConfig,
    ModelLoadError,
    Tokenizer,
    resolve_model_path,
    write_random_checkpoint,
)
from kvserve.model.gguf import GGUFFile, config_from_gguf, open_gguf
from kvserve.model.gguf.weights import load_gguf_weights
from kvserve.model.tensor_parallel import ShardSpec, shard_config, tensor_slice
from kvserve.runtime import LLM
from tests.server.harness import ServerProcess

from .conftest import GGUFFactory
from .gguf_files import tiny_config

transformers = pytest.importorskip("transformers")
PROMPTS = [[5, 17, 99, 3, 250], [41, 8, 77, 120, 64, 33, 200, 11, 150], [9, 310, 45, 2, 180]]
SMALL = {"num_kv_blocks": 64, "block_size": 4, "num_threads": 1}


def test_resolution_takes_a_gguf_file_or_a_directorys_only_one(make_gguf: GGUFFactory,
                                                               tmp_path: Path) -> None:
    path = make_gguf(T.Q8_0)
    assert resolve_model_path(path) == path
    assert resolve_model_path(str(path.parent)) == path
    two = tmp_path / "two"
    two.mkdir()
    shutil.copy(path, two / "a.gguf")
    shutil.copy(path, two / "b.gguf")
    with pytest.raises(ModelLoadError, match=r"2 GGUF files \(a.gguf, b.gguf\)"):
        resolve_model_path(two)
    split = tmp_path / "model-00001-of-00002.gguf"
    shutil.copy(path, split)
    with pytest.raises(ModelLoadError, match=r"split GGUF.*llama-gguf-split --merge"):
        resolve_model_path(split)
    hf_dir = write_random_checkpoint(tmp_path / "hf", tiny_config(vocab_size=64),
                                     write_tokenizer=False)
    shutil.copy(path, hf_dir / "extra.gguf")
    assert resolve_model_path(hf_dir) == hf_dir  # config.json: a Hugging Face directory


def test_llm_on_a_gguf_generates_transformers_greedy_tokens(make_gguf: GGUFFactory) -> None:
    path = make_gguf(T.Q4_K)
    llm = LLM(model=str(path), **SMALL)
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    ours = [out.outputs[0].token_ids for out in llm.generate(PROMPTS, greedy, use_tqdm=False)]
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    for prompt, tokens in zip(PROMPTS, ours, strict=True):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=12,
                              pad_token_id=0)[0, len(prompt):].tolist()
        assert list(tokens) == ref
    im_end = llm.get_tokenizer().token_to_id("<|im_end|>")
    assert llm.engine.eos_token_ids == frozenset({im_end})  # tokenizer.ggml.eos_token_id
    chat = llm.chat([{"role": "user", "content": "Hello there"}],
                    SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)[0]
    rendered = llm.get_tokenizer().decode(chat.prompt_token_ids, skip_special_tokens=False)
    assert rendered == "<|im_start|>user\nHello there<|im_end|>\n<|im_start|>assistant\n"


def test_tokenizer_and_hf_config_path_override_the_file(make_gguf: GGUFFactory,
                                                        tmp_path: Path) -> None:
    path = make_gguf(T.Q8_0)
    tok_dir = tmp_path / "tok"
    tok_dir.mkdir()
    (tok_dir / "tokenizer.json").write_text(Tokenizer.from_pretrained(path).to_json())
    (tok_dir / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": "OVERRIDE {{ messages[0]['content'] }}", "eos_token": "<|im_end|>"}))
    config = config_from_gguf(open_gguf(path))
    cfg_dir = write_random_checkpoint(tmp_path / "cfg", tiny_config(
        vocab_size=config.vocab_size, max_position_embeddings=128), write_tokenizer=False)
    llm = LLM(model=str(path), tokenizer=str(tok_dir), hf_config_path=str(cfg_dir), **SMALL)
    assert llm.get_tokenizer().apply_chat_template([{"role": "user", "content": "x"}]) \
        == "OVERRIDE x"
    assert llm.engine.max_model_len == 128  # the override's max_position_embeddings
    assert LLM(model=str(path), tokenizer=str(path), **SMALL).engine.max_model_len == 512


def test_tensor_parallel_shards_are_slices_of_the_whole(make_gguf: GGUFFactory) -> None:
    path = make_gguf(T.Q4_1)
    gguf_file = open_gguf(path)
    config = config_from_gguf(gguf_file)
    whole = unfused(gguf_file, config, ShardSpec(0, 1))
    for rank in range(2):
        shard = ShardSpec(rank, 2)
        for name, value in unfused(gguf_file, config, shard).items():
            piece = tensor_slice(name, list(whole[name].shape), config, shard)
            want = whole[name] if piece is None else whole[name].narrow(
                piece.dim, piece.start, piece.stop - piece.start)
            torch.testing.assert_close(value, want, atol=0, rtol=0, msg=name)


def unfused(gguf_file: GGUFFile, config: ModelConfig, shard: ShardSpec) -> dict[str, torch.Tensor]:
    network = LlamaForCausalLM(shard_config(config, shard), dtype=torch.float32, device="meta")
    network.to_empty(device="cpu")
    network.tie_weights()
    load_gguf_weights(network, gguf_file, config, shard)
    return dict(network.named_parameters())


def test_tensor_parallel_engine_on_a_gguf_equals_one_rank(make_gguf: GGUFFactory) -> None:
    path = make_gguf(T.Q8_0)
    greedy = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in LLM(model=str(path), **SMALL).generate(
        PROMPTS, greedy, use_tqdm=False)]
    llm = LLM(model=str(path), tensor_parallel_size=2, **SMALL)
    try:
        got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy, use_tqdm=False)]
    finally:
        llm.close()
    assert got == want


def test_kvserve_serve_takes_a_gguf_positional_or_as_model(make_gguf: GGUFFactory,
                                                           tmp_path: Path) -> None:
    path = make_gguf(T.Q8_0)
    flags = ["--num-kv-blocks", "64", "--block-size", "16", "--num-threads", "1"]
    want = LLM(model=str(path), **SMALL).chat(
        [{"role": "user", "content": "Hello"}],
        SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    for command in ([str(path), *flags], ["--model", str(path.parent), *flags]):
        server = ServerProcess(path.parent, tmp_path, command=command)
        try:
            server.wait_healthy()
            reply = httpx.post(f"{server.url}/v1/chat/completions", timeout=60, json={
                "model": command[command.index("--model") + 1] if "--model" in command
                else str(path), "messages": [{"role": "user", "content": "Hello"}],
                "max_tokens": 6, "temperature": 0, "ignore_eos": True}).json()
            assert reply["choices"][0]["message"]["content"] == want[0].outputs[0].text, reply
        finally:
            server.stop()
