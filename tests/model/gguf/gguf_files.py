"""Write tiny GGUF files with gguf.GGUFWriter, laid out as llama.cpp's converter lays them out.

Float and classic block types are quantized from random HF weights (kvserve.model.checkpoint's
``random_weights``); K-quant blocks, which the gguf package can read but not write, are random
bytes with their fp16 scales set to finite values of a chosen size. Names, the llama q/k row
interleave and the metadata keys are spelled out here from llama.cpp's conventions,
independently of kvserve.model.gguf, so a load of these files against transformers is a real
check of both.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as T
from tokenizers import ByteLevelBPETokenizer, SentencePieceBPETokenizer

from kvserve.model.checkpoint import random_weights
from kvserve.model.config import ModelConfig

CORPUS = [
    "The quick brown fox jumps over the lazy dog. What is the capital of France? Paris.",
    "Tokenizers split text into pieces; numbers like 12345 and 3.14 are split too.",
    "Hello world! Hello, kvserve. How are you today? I am fine, thank you.",
    "def main():\n    return 42\n\nclass Cache:\n    pass\n",
    "Caf\u00e9 na\u00efve r\u00e9sum\u00e9 \u00fcber stra\u00dfe, "
    "\u4f60\u597d\u4e16\u754c, \u3053\u3093\u306b\u3061\u306f",
    "user assistant system <think> tool call the of and to in is for on with as",
] * 3
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + "
    "message['content'] + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
SPM_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'user' %}"
    "{{ '[INST] ' + message['content'] + ' [/INST]' }}{% else %}"
    "{{ message['content'] + eos_token }}{% endif %}{% endfor %}"
)
GPT2_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
_K_SCALE_OFFSETS = {  # byte offsets of the fp16 scale fields inside one block
    T.Q2_K: (80, 82), T.Q3_K: (108,), T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,),
}


@dataclass(frozen=True)
class Vocabulary:
    """What a GGUF's tokenizer.ggml.* keys hold."""

    model: str  # "gpt2" or "llama"
    tokens: list[str]
    token_types: list[int]
    merges: list[str] | None = None
    scores: list[float] | None = None
    pre: str | None = None


def gpt2_vocabulary(pre: str = "smollm", vocab_size: int = 420) -> Vocabulary:
    """A byte-level BPE trained on CORPUS, specials first (SmolLM's layout), plus a
    user-defined ``<think>`` token."""
    trainer = ByteLevelBPETokenizer()
    trainer.train_from_iterator(CORPUS, vocab_size=vocab_size, min_frequency=1,
                                special_tokens=GPT2_SPECIALS, show_progress=False)
    vocab = trainer.get_vocab()
    tokens = sorted(vocab, key=vocab.__getitem__)
    trained = json.loads(trainer._tokenizer.to_str())["model"]["merges"]
    merges = [m if isinstance(m, str) else " ".join(m) for m in trained]  # "left right"
    tokens.append("<think>")
    types = [3 if t in GPT2_SPECIALS else 4 if t == "<think>" else 1 for t in tokens]
    return Vocabulary("gpt2", tokens, types, merges=merges, pre=pre)


def llama_vocabulary(vocab_size: int = 360) -> Vocabulary:
    """A SentencePiece-style vocabulary: <unk>, <s>, </s>, the 256 byte tokens <0xNN>, then
    pieces (with the ▁ space) trained on CORPUS, scored best-first."""
    trainer = SentencePieceBPETokenizer()
    trainer.train_from_iterator(CORPUS, vocab_size=vocab_size, min_frequency=1,
                                show_progress=False)
    vocab = trainer.get_vocab()
    pieces = [p for p in sorted(vocab, key=vocab.__getitem__) if p != "<unk>"]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces
    types = [2, 3, 3] + [6] * 256 + [1] * len(pieces)
    scores = [0.0] * 259 + [-float(i) for i in range(len(pieces))]
    return Vocabulary("llama", tokens, types, scores=scores)


def tiny_config(arch: str = "llama", vocab_size: int = 420, **overrides: Any) -> dict[str, Any]:
    """An HF config small enough for every block type (in-features multiples of 256)."""
    config: dict[str, Any] = {
        "architectures": [{"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                           "qwen3": "Qwen3ForCausalLM",
                           "mistral": "MistralForCausalLM"}[arch]],
        "model_type": arch, "vocab_size": vocab_size, "hidden_size": 256,
        "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 64, "max_position_embeddings": 512,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False,
        "hidden_act": "silu",
    }
    config.update(overrides)
    return config


def gguf_tensor_name(hf_name: str) -> str:
    """llama.cpp's name for an HF parameter (spelled independently of kvserve's table)."""
    fixed = {"model.embed_tokens.weight": "token_embd.weight",
             "model.norm.weight": "output_norm.weight", "lm_head.weight": "output.weight"}
    if hf_name in fixed:
        return fixed[hf_name]
    parts = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
             "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
             "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
             "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    layer, rest = hf_name.removeprefix("model.layers.").split(".", 1)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{parts[module]}.{kind}"


def interleave_rope_rows(w: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's converter's reorder of q/k rows: per head, [halves] -> adjacent pairs."""
    head_dim = w.shape[0] // num_heads
    return (w.reshape(num_heads, 2, head_dim // 2, *w.shape[1:]).swapaxes(1, 2)
            .reshape(w.shape))


def random_k_blocks(qtype: T, shape: tuple[int, int], rng: np.random.Generator,
                    target_std: float) -> np.ndarray:
    """Random K-quant rows [out, row_bytes] whose dequantized values have ~``target_std``."""
    elems, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, (shape[0], shape[1] // elems, nbytes), dtype=np.uint8)

    def with_scale(value: float) -> np.ndarray:
        out = blocks.copy()
        for offset in _K_SCALE_OFFSETS[qtype]:
            scale = (value * rng.uniform(0.5, 1.5, blocks.shape[:2])).astype(np.float16)
            out[..., offset:offset + 2] = scale.view(np.uint8).reshape(*blocks.shape[:2], 2)
        return out.reshape(shape[0], -1)

    probe = gguf.quants.dequantize(with_scale(1e-3), qtype)
    return with_scale(1e-3 * target_std / float(probe.std()))


def write_gguf(path: Path, config_dict: dict[str, Any], vocab: Vocabulary, qtype: T = T.F32,
               *, seed: int = 0, chat_template: str | None = CHAT_TEMPLATE,
               add_bos: bool | None = None, extra: dict[str, Any] | None = None) -> Path:
    """Write one GGUF: the config's metadata, ``vocab``, and every 2-D weight in ``qtype``
    (1-D tensors stay F32, as llama.cpp keeps them)."""
    config = ModelConfig.from_dict(config_dict)
    arch = config_dict["model_type"]
    writer = gguf.GGUFWriter(path, arch)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    if arch == "qwen3":
        writer.add_key_length(config.head_dim)
        writer.add_value_length(config.head_dim)
    else:
        writer.add_rope_dimension_count(config.head_dim)
    writer.add_rope_freq_base(config.rope_theta)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    if config.rope_scaling is not None:
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(config.rope_scaling.factor)
    writer.add_tokenizer_model(vocab.model)
    if vocab.pre is not None:
        writer.add_tokenizer_pre(vocab.pre)
    writer.add_token_list(vocab.tokens)
    writer.add_token_types(vocab.token_types)
    if vocab.merges is not None:
        writer.add_token_merges(vocab.merges)
    if vocab.scores is not None:
        writer.add_token_scores(vocab.scores)
    specials = {"<|endoftext|>": "bos", "<|im_end|>": "eos", "<s>": "bos", "</s>": "eos",
                "<unk>": "unk"}
    for token, role in specials.items():
        if token in vocab.tokens:
            getattr(writer, f"add_{role}_token_id")(vocab.tokens.index(token))
    if vocab.model == "gpt2":
        writer.add_pad_token_id(vocab.tokens.index("<|im_end|>"))
    if add_bos is not None:
        writer.add_add_bos_token(add_bos)
    if chat_template is not None:
        writer.add_chat_template(chat_template)
    for key, value in (extra or {}).items():
        writer.add_key_value(key, value[0], value[1])
    rng = np.random.default_rng(seed)
    for name, tensor in random_weights(config, seed).items():
        w = tensor.to(torch.float32).numpy()
        if arch in ("llama", "mistral") and ".q_proj." in name:  # weight and bias
            w = interleave_rope_rows(w, config.num_attention_heads)
        elif arch in ("llama", "mistral") and ".k_proj." in name:
            w = interleave_rope_rows(w, config.num_key_value_heads)
        _add(writer, gguf_tensor_name(name), w, qtype, rng)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _add(writer: gguf.GGUFWriter, name: str, w: np.ndarray, qtype: T,
         rng: np.random.Generator) -> None:
    if w.ndim == 1 or qtype == T.F32:
        writer.add_tensor(name, np.ascontiguousarray(w, dtype=np.float32))
    elif qtype == T.F16:
        writer.add_tensor(name, w.astype(np.float16))
    elif qtype in _K_SCALE_OFFSETS:
        packed = random_k_blocks(qtype, (w.shape[0], w.shape[1]), rng, float(w.std()))
        writer.add_tensor(name, packed, raw_dtype=qtype)
    else:
        writer.add_tensor(name, gguf.quants.quantize(w, qtype), raw_dtype=qtype)


__all__ = ["CHAT_TEMPLATE", "SPM_CHAT_TEMPLATE", "Vocabulary", "gpt2_vocabulary",
           "llama_vocabulary", "tiny_config", "write_gguf"]
