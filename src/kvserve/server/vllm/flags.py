"""vLLM's `serve` flags that kvserve takes with vLLM's meaning, accepts as already true, or
refuses with the reason, so an existing vLLM launch line starts kvserve or says exactly why not.

A flag kvserve cannot honour is an error naming it, never silently ignored.
docs/operations.md has the table of vLLM's common flags and what kvserve does with each.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

# Flags that state what kvserve always does: accepted, nothing to change.
ALREADY_SO = {
    "--trust-remote-code": "kvserve runs only its own model code (Llama, Qwen2/3, Mistral and "
                           "kin) and never executes code from a checkpoint, so there is "
                           "nothing to trust; other architectures fail to load, naming it",
    "--enforce-eager": "kvserve always runs eagerly (no CUDA graphs)",
    "--disable-log-stats": "kvserve logs no periodic stats (they are on /metrics)",
    "--disable-log-requests": "kvserve does not log requests unless --enable-log-requests",
}

# Flags kvserve cannot honour: (names, takes a value, why / what to do instead).
REFUSED: tuple[tuple[tuple[str, ...], bool, str], ...] = (
    (("--speculative-config",), True, "kvserve has no speculative decoding; leave it out"),
    (("--enable-sleep-mode",), False, "kvserve has no sleep mode; stop the worker instead"),
    (("--ssl-keyfile", "--ssl-certfile"), True,
     "kvserve serves plain HTTP; terminate TLS in front of it (ingress, Envoy)"),
    (("--allowed-origins",), True,
     "kvserve sends no CORS headers; put browsers behind a proxy that adds them"),
    (("--root-path",), True, "kvserve serves at the root; strip the prefix in the proxy"),
)

QUANTIZATIONS = ("gguf", "q4_0", "q4_1", "q8_0", "w8a8")  # model/quantized_model, int8_linear

# Flags honoured only at their single-device values: (names, allowed values, why not others).
SINGLE_DEVICE = (
    (("--pipeline-parallel-size", "-pp"), ("1",),
     "kvserve runs the whole model in one process; scale out with workers behind "
     "`kvserve gateway`"),
    (("--data-parallel-size", "-dp"), ("1",),
     "run N kvserve workers behind `kvserve gateway` instead"),
    (("--cpu-offload-gb",), ("0", "0.0"), "kvserve keeps all weights on the device"),
    (("--load-format",), ("auto", "safetensors", "gguf"),
     "kvserve loads safetensors and GGUF checkpoints"),
)

UVICORN_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


class _Refuse(argparse.Action):
    """Fails parsing with `reason` as soon as the flag appears, unless its value is one of
    `allowed` (then kept under `dest` when `keep`, else ignored)."""

    def __init__(self, option_strings: Sequence[str], dest: str, reason: str = "",
                 allowed: tuple[str, ...] = (), keep: bool = False, **kwargs: Any) -> None:
        self.reason = reason
        self.allowed = allowed
        self.keep = keep
        super().__init__(option_strings, dest,
                         default=None if keep else argparse.SUPPRESS, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        if self.allowed and values in self.allowed:
            if self.keep:
                setattr(namespace, self.dest, values)
            return
        shown = f"{option_string} {values}" if isinstance(values, str) else option_string
        parser.error(f"{shown}: {self.reason}")


class _AlreadySo(argparse.Action):
    """Accepts a flag that states kvserve's fixed behaviour (see `ALREADY_SO`)."""

    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        pass


def add_engine_vllm_arguments(p: argparse.ArgumentParser) -> None:
    """The vLLM engine flags kvserve accepts as already true or refuses."""
    for flag in ("--trust-remote-code", "--enforce-eager", "--disable-log-stats"):
        p.add_argument(flag, action=_AlreadySo, help=f"accepted: {ALREADY_SO[flag]}")
    p.add_argument("--no-trust-remote-code", action=_AlreadySo, help="accepted (the default)")
    p.add_argument("--enable-chunked-prefill", action=_AlreadySo,
                   help="accepted: prefill is always chunked (--max-num-batched-tokens)")
    p.add_argument("--no-enable-chunked-prefill", action=_Refuse, nargs=0,
                   reason="kvserve always chunks prefill; size the chunks with "
                          "--max-num-batched-tokens",
                   help="refused: prefill is always chunked")
    for names, takes_value, reason in REFUSED:
        p.add_argument(*names, action=_Refuse, nargs=None if takes_value else 0, reason=reason,
                       help=f"refused: {reason}")
    for names, allowed, reason in SINGLE_DEVICE:
        p.add_argument(*names, action=_Refuse, allowed=allowed, reason=reason,
                       help=f"only {' or '.join(allowed)}: {reason}")
    p.add_argument("--quantization", "-q", action=_Refuse, allowed=QUANTIZATIONS, keep=True,
                   reason=f"kvserve runs {', '.join(QUANTIZATIONS)} (CPU, one rank); leave it "
                          "out for the checkpoint's own dtype",
                   help="gguf: keep a .gguf file's Q4_0/Q4_1/Q8_0 blocks packed; q4_0, q4_1, "
                        "q8_0: quantize a dense checkpoint's projections at load; w8a8: int8 "
                        "weights per channel x int8 activations per block of 32 (CPU only)")


def add_server_vllm_arguments(p: argparse.ArgumentParser) -> None:
    """`vllm serve MODEL`'s positional model and its logging flags."""
    p.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                   help="the model, as `vllm serve MODEL` takes it (same as --model)")
    p.add_argument("--disable-log-requests", action=_AlreadySo,
                   help=f"accepted: {ALREADY_SO['--disable-log-requests']}")
    p.add_argument("--enable-log-requests", action=argparse.BooleanOptionalAction,
                   default=False, help="log one access line per request (method, path, status; "
                                       "never the prompt)")
    p.add_argument("--uvicorn-log-level", choices=UVICORN_LOG_LEVELS, default="warning",
                   help="uvicorn's log level (default warning)")


def resolve_model(args: argparse.Namespace) -> None:
    """Fold the positional model into `--model`; ValueError when the two disagree."""
    tag = getattr(args, "model_tag", None)
    if tag is None:
        return
    if args.model is not None and args.model != tag:
        raise ValueError(f"the model is given twice, as {tag!r} and --model {args.model!r}; "
                         "give one of them")
    args.model = tag
