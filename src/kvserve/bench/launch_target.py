"""Which server a benchmark launches, and in which precision mode: `NAME[:MODE]`.

kvserve's modes: float32 (its default), bfloat16, q8_0 and q4_1 (the float32 checkpoint's
projections packed into GGUF blocks at load), gguf (it serves the `--gguf` file itself,
keeping the file's own blocks) and w8a8 (bf16 with int8 x int8 projections). vLLM's: float32
(its default) and bfloat16. llama.cpp's server has none: it always runs the GGUF file's own
weights. `precision_args` is the one place that turns a mode into command-line flags.
"""

from __future__ import annotations

from dataclasses import dataclass

KVSERVE = "kvserve"
VLLM = "vllm"
LLAMACPP = "llamacpp"
SERVERS = (KVSERVE, VLLM, LLAMACPP)

FLOAT32, BFLOAT16, Q8_0, Q4_1, GGUF = "float32", "bfloat16", "q8_0", "q4_1", "gguf"
W8A8 = "w8a8"
# Each server's modes, its default first (llama.cpp: none, the GGUF file decides).
MODES: dict[str, tuple[str, ...]] = {KVSERVE: (FLOAT32, BFLOAT16, Q8_0, Q4_1, GGUF, W8A8),
                                     VLLM: (FLOAT32, BFLOAT16), LLAMACPP: ()}


def _modes_text(name: str) -> str:
    return "|".join(MODES[name]) or "none"


CHOICES = "; ".join(f"{n}[:{_modes_text(n)}]" if MODES[n] else f"{n} (no mode)" for n in SERVERS)


@dataclass(frozen=True, slots=True)
class LaunchTarget:
    """One server to launch: `name` (one of SERVERS) and `mode` (one of MODES[name], or None
    for the server's default). Built unchecked; `parse` checks user input, and
    `server_launch.server_command` refuses what is not valid with a LaunchError."""

    name: str
    mode: str | None = None

    @property
    def label(self) -> str:
        """How tables and JSON name it: `NAME:MODE` when a mode was given, else `NAME`."""
        return f"{self.name}:{self.mode}" if self.mode is not None else self.name

    @property
    def effective_mode(self) -> str | None:
        """The mode it runs in: `mode`, else the server's default (None for llama.cpp)."""
        modes = MODES.get(self.name, ())
        return self.mode if self.mode is not None else (modes[0] if modes else None)

    @property
    def reads_gguf(self) -> bool:
        """Whether it serves the `--gguf` file rather than the model directory."""
        return self.name == LLAMACPP or (self.name == KVSERVE and self.mode == GGUF)

    def problem(self) -> str | None:
        """Why this name and mode cannot be launched (naming the valid choices), or None."""
        if self.name not in SERVERS:
            return f"unknown server {self.name!r}: choose from {CHOICES}"
        if self.mode is None or self.mode in MODES[self.name]:
            return None
        if not MODES[self.name]:
            return (f"{self.name} takes no mode (it runs the GGUF file's own weights): write "
                    f"{self.name}, not {self.label}")
        return f"unknown mode {self.mode!r} for {self.name}: choose from {_modes_text(self.name)}"

    @classmethod
    def parse(cls, entry: str) -> LaunchTarget:
        """`NAME` or `NAME:MODE` (case and spaces ignored); ValueError naming the choices."""
        name, sep, mode = (part.strip() for part in entry.strip().lower().partition(":"))
        target = cls(name, mode if sep else None)
        problem = target.problem()
        if problem is not None:
            raise ValueError(f"--launch {entry.strip()}: {problem}")
        return target


def parse_launch(value: str) -> list[LaunchTarget]:
    """The comma-separated `--launch` value, in order; an entry running what an earlier one
    runs (same name, same effective mode: `kvserve` and `kvserve:float32`) is dropped."""
    targets: dict[tuple[str, str | None], LaunchTarget] = {}
    for entry in value.split(","):
        if entry.strip():
            target = LaunchTarget.parse(entry)
            targets.setdefault((target.name, target.effective_mode), target)
    return list(targets.values())


def precision_args(target: LaunchTarget) -> list[str]:
    """The dtype and quantization flags of `target` (kvserve and vLLM spell them alike);
    [] for llama.cpp. Assumes `target.problem()` is None."""
    mode = target.effective_mode
    if mode is None:
        return []
    if mode == BFLOAT16:
        return ["--dtype", BFLOAT16]
    if mode == FLOAT32:
        return ["--dtype", FLOAT32]
    if mode == W8A8:
        return ["--dtype", BFLOAT16, "--quantization", W8A8]
    return ["--dtype", FLOAT32, "--quantization", mode]  # q8_0, q4_1, gguf: packed blocks
