"""Linear layers through oneDNN: the same logits as PyTorch's dense path, and no dense copies."""

from __future__ import annotations

import itertools
import platform
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvserve.model import AttentionMetadata, allocate_kv_caches, load_model
from kvserve.model.onednn_linear import (
    MAX_ROWS,
    PackedLinear,
    bucket_rows,
    onednn_available,
)

pytestmark = pytest.mark.skipif(not onednn_available(torch.device("cpu"), torch.float32),
                                reason="this PyTorch build has no oneDNN")


def test_a_packed_linear_computes_what_f_linear_does() -> None:
    gen = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(96, 40, generator=gen), torch.randn(96, generator=gen)
    x = torch.randn(7, 40, generator=gen)
    expected = torch.nn.functional.linear(x, weight, bias)  # [7, 96]
    for b, in_place in itertools.product((bias, None), (True, False)):
        packed = PackedLinear(weight, b, in_place_activations=in_place)
        want = expected if b is not None else torch.nn.functional.linear(x, weight)
        got = packed(x)
        assert got.shape == (7, 96) and not got.is_mkldnn
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # A non-contiguous input (a column slice) is handled, not misread.
    wide = torch.randn(7, 80, generator=gen)
    for in_place in (True, False):
        torch.testing.assert_close(
            PackedLinear(weight, bias, in_place_activations=in_place)(wide[:, ::2]),
            torch.nn.functional.linear(wide[:, ::2], weight, bias), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("arch", ["llama_gqa", "qwen2_bias_tied", "qwen3_qk_norm"])
def test_a_packed_model_gives_the_dense_models_logits(arch: str,
                                                      arch_checkpoints: dict[str, Path]) -> None:
    path = arch_checkpoints[arch]
    dense, packed = load_model(path), load_model(path)
    packed.model.pack_for_onednn()
    config = dense.config
    num_tokens = 37
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(4, config.vocab_size, (num_tokens,), generator=gen)
    meta = AttentionMetadata.from_lists([num_tokens], [num_tokens], [[0, 1, 2]], 16)
    logits = []
    for loaded in (dense, packed):
        kv = allocate_kv_caches(config, 3, 16, dtype=torch.float32, device="cpu")
        hidden = loaded.model(ids, torch.arange(num_tokens), kv, meta)  # [T, hidden]
        logits.append(loaded.model.compute_logits(hidden))  # [T, vocab]
    torch.testing.assert_close(logits[1], logits[0], rtol=1e-4, atol=1e-4)
    assert torch.equal(logits[1].argmax(-1), logits[0].argmax(-1))
    # The dense projection weights are gone (served from the packed copies) ...
    layer = packed.model.model.layers[0]
    assert layer.self_attn.q_proj.weight.numel() == layer.mlp.down_proj.weight.numel() == 0
    # ... except the embeddings, which a tied lm_head shares.
    embed = packed.model.model.embed_tokens.weight
    assert embed.shape == (config.vocab_size, config.hidden_size)
    assert (packed.model.lm_head.weight.numel() == embed.numel()) == config.tie_word_embeddings


def test_bf16_goes_through_onednn_only_where_the_cpu_has_its_instructions() -> None:
    supported = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    assert onednn_available(torch.device("cpu"), torch.bfloat16) is supported
    assert not onednn_available(torch.device("cpu"), torch.float16)


ROW_COUNTS = (1, 15, 16, 17, 40, 63, 64, 65, 300, 511, 512, 513, 1100)


@pytest.mark.parametrize("in_place", [True, False])
def test_every_row_count_computes_what_f_linear_does(in_place: bool) -> None:
    # Padded rows and pieces of MAX_ROWS must not show in the result.
    gen = torch.Generator().manual_seed(1)
    weight, bias = torch.randn(24, 32, generator=gen), torch.randn(24, generator=gen)
    packed = PackedLinear(weight, bias, in_place_activations=in_place)
    for rows in ROW_COUNTS:
        x = torch.randn(rows, 32, generator=gen)
        got = packed(x)
        assert got.shape == (rows, 24) and got.is_contiguous()
        torch.testing.assert_close(got, torch.nn.functional.linear(x, weight, bias),
                                   rtol=1e-5, atol=1e-5)


def test_onednn_sees_few_row_counts(monkeypatch: pytest.MonkeyPatch) -> None:
    # oneDNN keeps memory for every row count it meets (module doc): a server meets all of
    # 1..its batch budget, so the calls must reach it with a bounded set.
    seen: set[int] = set()
    call = PackedLinear._call

    def counting(self: PackedLinear, x: torch.Tensor) -> torch.Tensor:
        seen.add(x.shape[0])
        return call(self, x)

    monkeypatch.setattr(PackedLinear, "_call", counting)
    packed = PackedLinear(torch.randn(8, 16), None)
    for rows in range(1, 2 * MAX_ROWS + 40):
        packed(torch.randn(rows, 16))
    assert seen == {bucket_rows(r) for r in range(1, MAX_ROWS + 1)}
    assert len(seen) <= 26 and max(seen) == MAX_ROWS


GROWTH_SCRIPT = """
import ctypes, torch
from kvserve.model.onednn_linear import PackedLinear
libc = ctypes.CDLL("libc.so.6")
def rss_mib():
    libc.malloc_trim(0)
    with open("/proc/self/status") as f:
        return int(next(ln for ln in f if ln.startswith("VmRSS")).split()[1]) / 1024
torch.set_num_threads(1)
packed = PackedLinear(torch.randn(2048, 64), None)
packed(torch.randn(1, 64))
before = rss_mib()
for rows in range(17, 401):
    packed(torch.randn(rows, 64))
print(rss_mib() - before)
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="reads glibc's malloc_trim")
def test_memory_stays_bounded_over_many_row_counts() -> None:
    # Without the buckets, rows 17..400 through a 2048-row weight keep ~200 MB more (state per
    # row count); with them, under 10 MB. A fresh process, so no earlier test's shapes count.
    done = subprocess.run([sys.executable, "-c", GROWTH_SCRIPT], capture_output=True, text=True,
                          check=True, timeout=120)
    assert float(done.stdout.strip().splitlines()[-1]) < 60
