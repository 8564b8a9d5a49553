"""The model side of LoRA: PEFT files checked at load, the batched products, the slots' LRU."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvserve.model import ModelConfig, load_model, write_random_checkpoint
from kvserve.model.lora import AdapterSlots, LoRAFormatError, load_peft_adapter
from kvserve.model.lora.punica import bgmv_add, sgmv_add, slot_segments
from tests.lora.adapters import write_peft_adapter
from tests.model.arch_configs import base_config

pytest.importorskip("peft")


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_random_checkpoint(tmp_path_factory.mktemp("lora-model") / "base",
                                   base_config(), seed=2)


@pytest.fixture(scope="module")
def adapter(base: Path) -> Path:
    return write_peft_adapter(base, base.parent / "ad", rank=8, seed=4)


def config(base: Path) -> ModelConfig:
    return ModelConfig.from_file(base / "config.json")


def copy(adapter: Path, dst: Path, **config_changes: object) -> Path:
    shutil.copytree(adapter, dst)
    raw = json.loads((dst / "adapter_config.json").read_text())
    raw.update(config_changes)
    (dst / "adapter_config.json").write_text(json.dumps(raw))
    return dst


@pytest.mark.parametrize(("changes", "message"), [
    ({"r": 8}, None),
    ({"use_dora": True}, "DoRA"),
    ({"target_modules": ["q_proj", "embed_tokens"]}, "unknown target modules"),
    ({"bias": "all"}, "bias='all'"),
    ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
])
def test_the_config_is_checked(adapter, base, tmp_path, changes, message) -> None:
    path = copy(adapter, tmp_path / "a", **changes)
    if message is None:
        assert load_peft_adapter(path, config(base), 8, torch.float32).rank == 8
        return
    with pytest.raises(LoRAFormatError, match=message):
        load_peft_adapter(path, config(base), 8, torch.float32)


def test_rank_above_the_limit_missing_files_and_wrong_shapes_are_named(adapter, base,
                                                                       tmp_path) -> None:
    with pytest.raises(LoRAFormatError, match="--max-lora-rank 4; raise"):
        load_peft_adapter(adapter, config(base), 4, torch.float32)
    with pytest.raises(LoRAFormatError, match=r"needs adapter_config\.json"):
        load_peft_adapter(tmp_path, config(base), 8, torch.float32)
    other = write_random_checkpoint(tmp_path / "wide", base_config(hidden_size=120), seed=1)
    with pytest.raises(LoRAFormatError, match="trained for another base model"):
        load_peft_adapter(adapter, config(other), 8, torch.float32)
    path = copy(adapter, tmp_path / "extra")
    tensors = load_file(str(path / "adapter_model.safetensors"))
    tensors["base_model.model.lm_head.lora_A.weight"] = torch.zeros(8, 96)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    with pytest.raises(LoRAFormatError, match="cannot adapt"):
        load_peft_adapter(path, config(base), 8, torch.float32)


def test_the_digest_is_the_content_not_the_place(adapter, base, tmp_path) -> None:
    same = load_peft_adapter(copy(adapter, tmp_path / "same"), config(base), 8, torch.float32)
    assert same.digest == load_peft_adapter(adapter, config(base), 8, torch.float32).digest
    scaled = copy(adapter, tmp_path / "alpha", lora_alpha=3)
    assert load_peft_adapter(scaled, config(base), 8, torch.float32).digest != same.digest


def test_segment_and_per_token_products_agree() -> None:
    gen = torch.Generator().manual_seed(0)
    rank, slots = 4, 3
    x = torch.randn(11, 16, generator=gen)  # [T, in]
    a = torch.randn(slots, 2 * rank, 16, generator=gen)  # [S, 2R, in]
    bs = [torch.randn(slots, 5, rank, generator=gen), torch.randn(slots, 7, rank, generator=gen)]
    seq_slots, query_start = [2, -1, 0, 2], [0, 3, 4, 9, 11]  # slot 2 twice, not contiguous
    token_slots = torch.tensor([s for i, s in enumerate(seq_slots)
                                for _ in range(query_start[i + 1] - query_start[i])])
    base = [torch.randn(11, 5, generator=gen), torch.randn(11, 7, generator=gen)]
    seg = [t.clone() for t in base]
    tok = [t.clone() for t in base]
    sgmv_add(x, a, bs, seg, slot_segments(seq_slots, query_start, torch.device("cpu")), rank)
    bgmv_add(x, a, bs, tok, token_slots, rank)
    for s, t, b in zip(seg, tok, base, strict=True):
        torch.testing.assert_close(s, t)
        assert torch.equal(s[3], b[3])  # the base model's row is untouched
        assert not torch.equal(s[0], b[0])


def test_slots_load_once_and_evict_the_least_recently_used(adapter, base, tmp_path) -> None:
    model = load_model(base).model
    others = [write_peft_adapter(base, tmp_path / f"o{i}", rank=4, seed=9 + i) for i in range(2)]
    weights = [load_peft_adapter(p, config(base), 8, torch.float32)
               for p in (adapter, *others)]
    loads: list[bytes] = []
    evictions: list[bytes] = []
    slots = AdapterSlots(model, 2, 8, on_load=loads.append, on_evict=evictions.append)
    by_digest = {w.digest: w for w in weights}
    w0, w1, w2 = (w.digest for w in weights)
    first = slots.begin_step([w0, None, w1], [0, 1, 2, 3], by_digest.__getitem__)
    assert first.seq_slots == (0, -1, 1)
    assert [(load.slot, load.weights.digest) for load in first.loads] == [(0, w0), (1, w1)]
    assert not slots.begin_step([w1], [0, 1], by_digest.__getitem__).loads  # w0: LRU now
    third = slots.begin_step([w2, w1], [0, 1, 2], by_digest.__getitem__)
    assert third.seq_slots == (0, 1) and [load.slot for load in third.loads] == [0]
    assert loads == [w0, w1, w2] and evictions == [w0]
    with pytest.raises(ValueError, match="--max-loras is 2"):
        slots.begin_step([w0, w1, w2], [0, 1, 2, 3], by_digest.__getitem__)
