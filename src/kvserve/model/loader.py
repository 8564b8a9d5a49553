"""Turn a model argument (local directory, .gguf file or Hugging Face id) into a loaded model.

Resolution never downloads when the argument is an existing path. A .gguf file, or a directory
holding exactly one and no config.json, loads through kvserve.model.gguf (config and tokenizer
from its metadata, weights dequantized to the requested dtype). Weight loading is strict: every
parameter must come from the checkpoint and every checkpoint tensor must land somewhere (except
tied ``lm_head.weight`` and legacy ``rotary_emb.inv_freq`` buffers, which are ignored).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from kvserve.model.config import ModelConfig
from kvserve.model.errors import ModelLoadError
from kvserve.model.gguf.config import config_from_gguf, hf_config_dict
from kvserve.model.gguf.config import eos_token_ids as gguf_eos_token_ids
from kvserve.model.gguf.locate import find_gguf, is_gguf
from kvserve.model.gguf.quant_types import check_supported
from kvserve.model.gguf.reader import open_gguf
from kvserve.model.gguf.weights import load_gguf_weights
from kvserve.model.llama import LlamaForCausalLM
from kvserve.model.tensor_parallel import ShardSpec, TensorSlice, shard_config
from kvserve.model.weight_checks import raise_on_mismatch, rank_shape

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
_HUB_PATTERNS = ["*.json", "*.safetensors", "*.jinja"]
_TOKENIZER_PATTERNS = ["tokenizer*.json", "special_tokens_map.json", "*.jinja"]


@dataclass(frozen=True, slots=True)
class LoadedModel:
    """A model in eval mode with its weights on ``device`` in ``dtype``, and where it came from."""

    path: Path  # the checkpoint directory, or the .gguf file
    config: ModelConfig  # the checkpoint's; the model runs `shard_config(config, shard)`
    model: LlamaForCausalLM
    eos_token_ids: tuple[int, ...]  # config's ids, then generation_config.json's / GGUF's extras
    dtype: torch.dtype
    device: torch.device
    shard: ShardSpec = field(default_factory=lambda: ShardSpec(0, 1))


def load_model(model: str | os.PathLike[str], *, device: torch.device | str = "cpu",
               dtype: torch.dtype | None = None, revision: str | None = None,
               cache_dir: str | os.PathLike[str] | None = None,
               local_files_only: bool = False, shard: ShardSpec | None = None,
               hf_config_path: str | os.PathLike[str] | None = None) -> LoadedModel:
    """Resolve ``model``, build the network without allocating random weights, load it strictly.

    ``dtype=None`` means the checkpoint's dtype on accelerators and float32 on CPU (bf16/fp16
    matmuls there are slow or inexact); a GGUF's is float32. ``shard``: build and load only
    this tensor-parallel rank's part (kvserve.model.tensor_parallel; each rank reads its slices
    of the same files). ``hf_config_path``: a directory (or file) whose config.json replaces the
    checkpoint's config (vLLM's --hf-config-path). Raises ``ModelLoadError`` for anything
    unusable (``ShardingError`` for an unfit split).
    """
    shard = shard or ShardSpec(0, 1)
    path = resolve_model_path(model, revision=revision, cache_dir=cache_dir,
                              local_files_only=local_files_only)
    gguf_file = open_gguf(path) if is_gguf(path) else None
    if gguf_file is not None:
        check_supported(gguf_file)  # before anything else is built or read
    config = read_model_config(path, hf_config_path)
    device = torch.device(device)
    if dtype is None:
        dtype = torch.float32 if device.type == "cpu" else config.dtype
    network = LlamaForCausalLM(shard_config(config, shard), dtype=dtype, device="meta")
    _materialize(network, device)
    network.tie_weights()
    if gguf_file is not None:
        load_gguf_weights(network, gguf_file, config, shard)
        eos = config.eos_token_ids + tuple(i for i in gguf_eos_token_ids(gguf_file.metadata)
                                           if i not in config.eos_token_ids)
    else:
        load_weights(network, path, config, shard)
        eos = read_eos_token_ids(path, config)
    if hf_config_path is not None:
        eos = read_eos_token_ids(_config_dir(hf_config_path), replace(config, eos_token_ids=eos))
    network.eval().requires_grad_(False)
    network.fuse_projections()
    return LoadedModel(path=path, config=config, model=network, eos_token_ids=eos, dtype=dtype,
                       device=device, shard=shard)


def _materialize(network: nn.Module, device: torch.device) -> None:
    """Give every meta parameter and buffer of `network` uninitialized storage on `device`.

    nn.Module.to_empty does the same through empty_like, whose meta path imports torch's
    symbolic-shapes machinery (sympy): ~1 s of every process start; torch.empty does not."""
    for module in network.modules():
        for name, p in list(module.named_parameters(recurse=False)):
            setattr(module, name, nn.Parameter(
                torch.empty(p.shape, dtype=p.dtype, device=device), requires_grad=p.requires_grad))
        for name, b in list(module.named_buffers(recurse=False)):
            setattr(module, name, torch.empty(b.shape, dtype=b.dtype, device=device))


def read_model_config(path: Path, hf_config_path: str | os.PathLike[str] | None = None
                      ) -> ModelConfig:
    """The config of a resolved checkpoint (``resolve_model_path``): ``hf_config_path``'s
    config.json when given, else the directory's config.json or the GGUF's metadata."""
    if hf_config_path is not None:
        return ModelConfig.from_file(_config_dir(hf_config_path) / "config.json")
    if is_gguf(path):
        return config_from_gguf(open_gguf(path))
    return ModelConfig.from_file(path / "config.json")


def checkpoint_config_dict(path: Path, hf_config_path: str | os.PathLike[str] | None = None
                           ) -> dict[str, Any]:
    """The raw config dict ``read_model_config`` validates (for comparing checkpoints)."""
    if hf_config_path is None and is_gguf(path):
        return hf_config_dict(open_gguf(path))
    file = _config_dir(hf_config_path) / "config.json" if hf_config_path else path / "config.json"
    try:
        raw = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{file}: cannot read it as JSON ({exc})") from exc
    if not isinstance(raw, dict):
        raise ModelLoadError(f"{file}: expected a JSON object at the top level")
    return raw


def _config_dir(hf_config_path: str | os.PathLike[str]) -> Path:
    path = Path(hf_config_path).expanduser()
    if path.is_file() and path.name == "config.json":
        return path.parent
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"{path}: no config.json there; --hf-config-path takes a "
                             "directory holding the model's Hugging Face config.json")
    return path


def resolve_model_path(model: str | os.PathLike[str], *, revision: str | None = None,
                       cache_dir: str | os.PathLike[str] | None = None,
                       local_files_only: bool = False) -> Path:
    """A local directory holding config.json, or a .gguf file: ``model`` itself, the one .gguf
    in the directory ``model`` (when it has no config.json), or a Hub snapshot of ``model``.

    The Hub is asked only when ``model`` is not an existing path and looks like ``org/name``.
    """
    text = os.fspath(model)
    path = Path(text).expanduser()
    if path.exists():
        gguf = find_gguf(path)
        if gguf is not None:
            return gguf
        if not path.is_dir():
            raise ModelLoadError(f"{path}: is a file but not a .gguf; pass a GGUF file or the "
                                 "model directory that holds config.json")
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"{path}: no config.json and no .gguf file in this directory; "
                                 "pass a Hugging Face model directory (config.json, "
                                 "*.safetensors, tokenizer.json) or a GGUF file")
        return path
    if text.startswith((".", "/", "~")) or text.count("/") > 1 or "\\" in text:
        raise ModelLoadError(f"{text}: no such directory")
    return _download(text, revision, cache_dir, local_files_only)


def resolve_tokenizer_path(tokenizer: str | os.PathLike[str], *, revision: str | None = None,
                           cache_dir: str | os.PathLike[str] | None = None,
                           local_files_only: bool = False) -> Path:
    """Where ``Tokenizer.from_pretrained`` finds the tokenizer ``tokenizer`` names (vLLM's
    --tokenizer): an existing directory or .gguf file, else a Hub snapshot of its tokenizer
    files."""
    text = os.fspath(tokenizer)
    path = Path(text).expanduser()
    if path.exists():
        return path
    if text.startswith((".", "/", "~")) or text.count("/") > 1 or "\\" in text:
        raise ModelLoadError(f"--tokenizer {text}: no such directory or file")
    return _download(text, revision, cache_dir, local_files_only, required="tokenizer.json",
                     patterns=_TOKENIZER_PATTERNS)


def _download(repo_id: str, revision: str | None,
              cache_dir: str | os.PathLike[str] | None, local_files_only: bool,
              required: str = "config.json", patterns: list[str] | None = None) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HFValidationError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    try:
        snapshot = snapshot_download(repo_id, revision=revision,
                                     cache_dir=None if cache_dir is None else Path(cache_dir),
                                     local_files_only=local_files_only,
                                     allow_patterns=patterns or _HUB_PATTERNS)
    except HFValidationError:
        raise ModelLoadError(f"{repo_id}: not a local directory and not a valid Hugging Face "
                             "id (expected org/name)") from None
    except GatedRepoError:
        raise ModelLoadError(f"{repo_id}: gated on the Hugging Face Hub; accept its license "
                             "there and set HF_TOKEN") from None
    except RepositoryNotFoundError:
        raise ModelLoadError(f"{repo_id}: neither a local directory nor a model on the Hugging "
                             "Face Hub (if it is private, set HF_TOKEN)") from None
    except RevisionNotFoundError:
        raise ModelLoadError(f"{repo_id}: revision {revision!r} not found on the Hub") from None
    except LocalEntryNotFoundError as exc:
        raise ModelLoadError(
            f"{repo_id}: cannot download it while offline (HF_HUB_OFFLINE=1, local_files_only, "
            "or no network) and it is not in the local Hugging Face cache"
            f"{f' at {cache_dir}' if cache_dir else ''}; run once with network access or pass "
            f"a local model directory ({exc})") from None
    except OSError as exc:  # HTTP errors subclass OSError
        raise ModelLoadError(f"{repo_id}: download from the Hugging Face Hub failed: {exc}") \
            from exc
    path = Path(snapshot)
    if not (path / required).is_file():
        raise ModelLoadError(f"{repo_id}: the Hub snapshot at {path} has no {required}")
    return path


def read_eos_token_ids(path: Path, config: ModelConfig) -> tuple[int, ...]:
    """config.json's eos ids followed by any extra ones from generation_config.json."""
    ids = list(config.eos_token_ids)
    gen_path = path / "generation_config.json"
    if gen_path.is_file():
        try:
            raw = json.loads(gen_path.read_text(encoding="utf-8")).get("eos_token_id")
        except (OSError, ValueError, AttributeError) as exc:
            raise ModelLoadError(f"{gen_path}: cannot read it as a JSON object ({exc})") from exc
        extra = raw if isinstance(raw, list) else ([] if raw is None else [raw])
        if not all(isinstance(i, int) and not isinstance(i, bool) for i in extra):
            raise ModelLoadError(f"{gen_path}: key 'eos_token_id' must be an int or a list of "
                                 f"ints, got {raw!r}")
        ids += [i for i in extra if i not in ids]
    return tuple(ids)


def checkpoint_files(path: Path) -> dict[str, Path]:
    """Map every tensor name in the checkpoint to the safetensors file that holds it."""
    index = path / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ModelLoadError(f"{index}: not a safetensors index with a 'weight_map' "
                                 f"({exc})") from exc
        files = {name: path / file for name, file in weight_map.items()}
        for file in sorted(set(files.values())):
            if not file.is_file():
                raise ModelLoadError(f"{index}: names shard {file.name}, which is missing")
        return files
    single = path / SINGLE_FILE
    if single.is_file():
        with _open_safetensors(single) as f:
            return dict.fromkeys(f.keys(), single)
    others = sorted(p.name for p in path.glob("*.bin")) + sorted(p.name for p in path.glob("*.pt"))
    hint = f" (found {', '.join(others)}; only safetensors is supported)" if others else ""
    raise ModelLoadError(f"{path}: no {SINGLE_FILE} or {INDEX_FILE}{hint}")


def load_weights(model: nn.Module, path: Path, config: ModelConfig | None = None,
                 shard: ShardSpec | None = None) -> None:
    """Copy every checkpoint tensor into the parameter of the same HF name (strict).

    Casts to each parameter's dtype and device. Nothing is copied unless names and shapes all
    match; otherwise ``ModelLoadError`` lists the missing, unexpected and mis-shaped tensors.
    With `shard` (and the checkpoint's `config`), each parameter takes its rank's slice.
    """
    shard = shard or ShardSpec(0, 1)
    slices: dict[str, TensorSlice | None] = {}
    files = checkpoint_files(path)
    params = dict(model.named_parameters())  # tied parameters appear once, under the first name
    tied_lm_head = "lm_head.weight" not in params
    ignored = {n for n in files
               if n.endswith("rotary_emb.inv_freq") or (tied_lm_head and n == "lm_head.weight")}
    missing = sorted(set(params) - set(files))
    unexpected = sorted(set(files) - set(params) - ignored)
    by_file: dict[Path, list[str]] = {}
    for name, file in files.items():
        if name in params:
            by_file.setdefault(file, []).append(name)
    mismatched = []
    for file, names in by_file.items():
        with _open_safetensors(file) as f:
            for name in names:
                shape, slices[name] = rank_shape(name, f.get_slice(name).get_shape(), config,
                                                 shard)
                if shape != list(params[name].shape):
                    mismatched.append(f"{name}: checkpoint {shape}, model "
                                      f"{list(params[name].shape)}")
    raise_on_mismatch(f"{path}: checkpoint does not match config.json "
                      f"({type(model).__name__})", missing, unexpected, mismatched)
    with torch.no_grad():
        for file, names in by_file.items():
            with _open_safetensors(file) as f:
                for name in names:
                    params[name].copy_(_read(f, name, slices.get(name)))


def _read(handle: Any, name: str, part: TensorSlice | None) -> torch.Tensor:
    """The tensor `name`, or only this rank's `part` of it (read without the rest)."""
    if part is None:
        return handle.get_tensor(name)  # type: ignore[no-any-return]
    view = handle.get_slice(name)
    if part.zero:
        return torch.zeros(list(view.get_shape()))
    full = tuple(slice(None) for _ in range(part.dim))
    return view[(*full, slice(part.start, part.stop))]  # type: ignore[no-any-return]


@contextmanager
def _open_safetensors(file: Path) -> Iterator[Any]:
    """safe_open on CPU, with unreadable files and absent tensors reported as ModelLoadError."""
    try:
        with safe_open(str(file), framework="pt") as handle:
            yield handle
    except ModelLoadError:
        raise
    except Exception as exc:  # safetensors raises its own SafetensorError and plain errors
        raise ModelLoadError(f"{file}: not a readable safetensors file, or a tensor the index "
                             f"names is absent ({exc})") from exc
