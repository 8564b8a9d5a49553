"""One decoder-only model for the Llama family: Llama, Mistral, Qwen2 and Qwen3.

The module tree mirrors Hugging Face's (``model.embed_tokens``, ``model.layers.{i}.self_attn.
{q,k,v,o}_proj`` [+ ``q_norm``/``k_norm``], ``model.layers.{i}.mlp.{gate,up,down}_proj``,
``input_layernorm``, ``post_attention_layernorm``, ``model.norm``, ``lm_head``) so checkpoint
tensors load by name. Unlike HF, the forward pass takes a flattened batch of many sequences and
reads/writes context through a paged KV cache (see ``paged_attention``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.model.attention_metadata import AttentionMetadata
from kvserve.model.bf16_linear import pack_dense
from kvserve.model.config import ModelConfig
from kvserve.model.decode_step import FusedDecode
from kvserve.model.int8_linear import Int8Linear
from kvserve.model.layers import (
    FactoryKwargs,
    GatedMLP,
    LinearOp,
    ProjectionDeltas,
    RMSNorm,
    drop_dense,
)
from kvserve.model.paged_attention import KVCache, paged_attention
from kvserve.model.rotary import RotaryEmbedding, apply_rotary_

Device = torch.device | str | None
AllReduce = Callable[[torch.Tensor], torch.Tensor]  # sums a tensor over the tensor-parallel ranks


class Attention(nn.Module):
    """Multi-head (or grouped-query) self-attention with rotary positions over a paged cache."""

    def __init__(self, config: ModelConfig, layer_idx: int, *, dtype: torch.dtype | None,
                 device: Device) -> None:
        super().__init__()
        kw: FactoryKwargs = {"dtype": dtype, "device": device}
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.sliding_window = config.sliding_windows[layer_idx]
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.q_proj = nn.Linear(config.hidden_size, q_size, bias=config.attention_bias, **kw)
        self.k_proj = nn.Linear(config.hidden_size, kv_size, bias=config.attention_bias, **kw)
        self.v_proj = nn.Linear(config.hidden_size, kv_size, bias=config.attention_bias, **kw)
        self.o_proj = nn.Linear(q_size, config.hidden_size, bias=config.o_proj_bias, **kw)
        self.q_norm: RMSNorm | None = None
        self.k_norm: RMSNorm | None = None
        if config.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, **kw)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, **kw)
        self.qkv: tuple[torch.Tensor, torch.Tensor | None] | None = None
        self.packed_qkv: LinearOp | None = None
        self.packed_o: LinearOp | None = None
        self.lora: ProjectionDeltas | None = None  # LoRA adapters' deltas, when served

    def pack(self, qkv: LinearOp | None = None, o: LinearOp | None = None) -> None:
        """Serve the fused q/k/v and o_proj from packed weights (after `fuse`): the given ops
        (e.g. quantized ones), else packed copies of the dense weights (`pack_dense`: oneDNN's
        or kvserve's bf16 kernel's), which are dropped either way: inference only from here on."""
        assert self.qkv is not None, "fuse before packing"
        self.packed_qkv = qkv or pack_dense(*self.qkv)
        self.packed_o = o or pack_dense(self.o_proj.weight, self.o_proj.bias)
        self.qkv = None
        drop_dense(self.q_proj, self.k_proj, self.v_proj, self.o_proj)

    def fuse(self) -> None:
        """Compute q, k and v in one matmul; the three weights become views of one tensor
        (values and memory unchanged). Call after the weights are loaded and placed."""
        projs = (self.q_proj, self.k_proj, self.v_proj)
        weight = torch.cat([p.weight for p in projs])  # [q_size + 2 * kv_size, hidden]
        bias = torch.cat([p.bias for p in projs]) if projs[0].bias is not None else None
        offset = 0
        for proj in projs:
            rows = proj.weight.shape[0]
            proj.weight.data = weight[offset : offset + rows]
            if bias is not None and proj.bias is not None:
                proj.bias.data = bias[offset : offset + rows]
            offset += rows
        self.qkv = (weight, bias)

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv_cache: KVCache, attn_metadata: AttentionMetadata) -> torch.Tensor:
        """hidden [num_tokens, hidden]; cos/sin [num_tokens, hd] -> [num_tokens, hidden]."""
        num_tokens = hidden.shape[0]
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        if self.packed_qkv is not None:
            q_flat, k_flat, v_flat = self.packed_qkv(hidden).split(
                [q_size, kv_size, kv_size], dim=-1)  # [T, q_size], [T, kv_size] x 2
        elif self.qkv is not None:
            q_flat, k_flat, v_flat = F.linear(hidden, *self.qkv).split(
                [q_size, kv_size, kv_size], dim=-1)  # [T, q_size], [T, kv_size] x 2
        else:
            q_flat, k_flat, v_flat = self.q_proj(hidden), self.k_proj(hidden), self.v_proj(hidden)
        if self.lora is not None:
            self.lora.add("qkv", hidden, (q_flat, k_flat, v_flat))
        q = q_flat.reshape(num_tokens, self.num_heads, self.head_dim)  # [T, H, hd]
        k = k_flat.reshape(num_tokens, self.num_kv_heads, self.head_dim)  # [T, KVH, hd]
        v = v_flat.reshape(num_tokens, self.num_kv_heads, self.head_dim)  # [T, KVH, hd]
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary_(q, cos, sin), apply_rotary_(k, cos, sin)  # q, k: fresh views
        out = paged_attention(q, k, v, kv_cache, attn_metadata,
                              sliding_window=self.sliding_window)  # [T, H, hd]
        flat = out.reshape(num_tokens, -1)  # [T, q_size]
        projected: torch.Tensor = (self.packed_o(flat) if self.packed_o is not None
                                   else self.o_proj(flat))  # [T, hidden]
        if self.lora is not None:
            self.lora.add("o", flat, (projected,))
        return projected


class DecoderLayer(nn.Module):
    """Pre-norm residual block: x + attn(norm(x)), then + mlp(norm(.))."""

    def __init__(self, config: ModelConfig, layer_idx: int, *, dtype: torch.dtype | None,
                 device: Device) -> None:
        super().__init__()
        kw: FactoryKwargs = {"dtype": dtype, "device": device}
        self.self_attn = Attention(config, layer_idx, **kw)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, bias=config.mlp_bias,
                            **kw)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, **kw)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, **kw)
        self.all_reduce: AllReduce | None = None  # set on tensor-parallel ranks

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv_cache: KVCache, attn_metadata: AttentionMetadata) -> torch.Tensor:
        """hidden [num_tokens, hidden] -> [num_tokens, hidden]."""
        # Under tensor parallelism o_proj and down_proj are row-parallel: each rank's output is
        # a partial sum, completed by one all_reduce before the residual add.
        attn = self.self_attn(self.input_layernorm(hidden), cos, sin, kv_cache, attn_metadata)
        if self.all_reduce is not None:
            attn = self.all_reduce(attn)
        hidden, normed = self.post_attention_layernorm.add_and_norm(hidden, attn)
        mlp = self.mlp(normed)
        if self.all_reduce is not None:
            mlp = self.all_reduce(mlp)
        out: torch.Tensor = hidden + mlp
        return out


class DecoderModel(nn.Module):
    """Embeddings, the decoder layers and the final norm (HF's ``model.`` prefix)."""

    def __init__(self, config: ModelConfig, *, dtype: torch.dtype | None,
                 device: Device) -> None:
        super().__init__()
        kw: FactoryKwargs = {"dtype": dtype, "device": device}
        # An explicit weight skips nn.Embedding's random init, whose normal_ (even on the meta
        # device) imports torch._dynamo: ~2 s of every process start, for values never used.
        self.embed_tokens = nn.Embedding(
            config.vocab_size, config.hidden_size,
            _weight=torch.empty(config.vocab_size, config.hidden_size, **kw), **kw)
        self.layers = nn.ModuleList(
            DecoderLayer(config, i, **kw) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, **kw)
        self.rotary_emb = RotaryEmbedding(config)
        self.fused_decode: FusedDecode | None = None  # set by LlamaForCausalLM.pack_for_onednn

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: Sequence[KVCache], attn_metadata: AttentionMetadata) -> torch.Tensor:
        """input_ids, positions [num_tokens] -> final-normed hidden [num_tokens, hidden]."""
        hidden = self.embed_tokens(input_ids)  # [num_tokens, hidden]
        cos, sin = self.rotary_emb(positions)  # [num_tokens, head_dim] each
        if self.fused_decode is not None:
            fused = self.fused_decode(hidden, cos, sin, kv_caches, attn_metadata)
            if fused is not None:  # a pure-decode step, run in one kernel call
                return fused
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            hidden = layer(hidden, cos, sin, kv_cache, attn_metadata)
        out: torch.Tensor = self.norm(hidden)
        return out


class LlamaForCausalLM(nn.Module):
    """The causal LM for every supported architecture; the config's switches pick the variant.

    ``forward`` writes this step's K/V into ``kv_caches`` (one per layer) and returns hidden
    states; ``compute_logits`` projects the rows the caller wants to the vocabulary.
    """

    def __init__(self, config: ModelConfig, *, dtype: torch.dtype | None = None,
                 device: Device = None) -> None:
        super().__init__()
        kw: FactoryKwargs = {"dtype": dtype, "device": device}
        self.config = config
        self.model = DecoderModel(config, **kw)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False, **kw)
        self.packed_lm_head: LinearOp | None = None
        self.tie_weights()

    def fuse_projections(self) -> None:
        """Serve q/k/v and gate/up from one matmul each (fewer, larger matmuls: what CPUs and
        GPUs run fastest). Values are unchanged; call once, after loading."""
        for layer in self.model.layers:
            layer.self_attn.fuse()
            layer.mlp.fuse()

    def pack_for_onednn(self) -> None:
        """Run every projection and the lm_head through packed weights (`pack_dense`: oneDNN's,
        or kvserve's kernel for bf16 weights on AVX512-BF16 CPUs without AMX; CPU only). Call
        once, after `fuse_projections`; the dense copies are dropped (a tied lm_head keeps the
        embeddings), so the model serves inference only."""
        for layer in self.model.layers:
            layer.self_attn.pack()
            layer.mlp.pack()
        self.packed_lm_head = pack_dense(self.lm_head.weight, None)
        if not self.config.tie_word_embeddings:
            drop_dense(self.lm_head)
        self.model.fused_decode = FusedDecode.build(self.model)

    def pack_int8(self) -> None:
        """`--quantization w8a8`: every projection int8 x int8 (`Int8Linear`), the lm_head
        packed as `pack_for_onednn` packs it (the logits keep the model's dtype). CPU only;
        call once, after `fuse_projections`; inference only from here on."""
        for layer in self.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            assert attn.qkv is not None and mlp.gate_up is not None, "fuse before packing"
            attn.pack(Int8Linear(*attn.qkv), Int8Linear(attn.o_proj.weight, attn.o_proj.bias))
            mlp.pack(Int8Linear(*mlp.gate_up),
                     Int8Linear(mlp.down_proj.weight, mlp.down_proj.bias))
        self.packed_lm_head = pack_dense(self.lm_head.weight, None)
        if not self.config.tie_word_embeddings:
            drop_dense(self.lm_head)
        self.model.fused_decode = FusedDecode.build(self.model)

    def set_all_reduce(self, all_reduce: AllReduce | None) -> None:
        """Make this a tensor-parallel rank's model (built from `shard_config`): each layer
        completes its row-parallel outputs with `all_reduce`; None makes it single-rank."""
        for layer in self.model.layers:
            layer.all_reduce = all_reduce

    def tie_weights(self) -> None:
        """Share lm_head's weight with the embeddings when the config ties them (idempotent)."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: Sequence[KVCache], attn_metadata: AttentionMetadata) -> torch.Tensor:
        """input_ids, positions [num_tokens] -> hidden_states [num_tokens, hidden_size].

        Writes K/V of every token at ``attn_metadata.slot_mapping`` in each layer's cache.
        """
        if len(kv_caches) != self.config.num_hidden_layers:
            raise ValueError(f"need one KVCache per layer ({self.config.num_hidden_layers}), "
                             f"got {len(kv_caches)}")
        hidden: torch.Tensor = self.model(input_ids, positions, kv_caches, attn_metadata)
        return hidden

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """hidden_states [n, hidden_size] -> logits [n, vocab_size], float32."""
        logits: torch.Tensor = (self.packed_lm_head(hidden_states)
                                if self.packed_lm_head is not None
                                else self.lm_head(hidden_states))  # [n, vocab_size]
        return logits.float()
