"""`kvserve bench engine`'s out-of-process peers: vLLM per dtype, llama.cpp on a GGUF file, and
every system's peak RSS. The llama.cpp driver runs here against a stand-in `llama_cpp` module (its
pure parts and output contract), and for real where llama-cpp-python's venv is installed."""

from __future__ import annotations

import importlib
import json
import mmap
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from kvserve.bench.engine_cli import chosen_peers
from kvserve.bench.engine_peers import exit_reason, vllm_system
from kvserve.bench.peak_rss import reset_peak_rss, status_mib
from kvserve.bench.peers_env import llamacpp_python
from kvserve.cli import build_parser, main
from kvserve.model import write_random_checkpoint
from tests.model.gguf.gguf_files import gpt2_vocabulary, tiny_config, write_gguf

ROOT = Path(__file__).resolve().parents[2]
PEERS_DIR = ROOT / "benchmarks" / "peers"
SIZE_FLAGS = ["--num-prompts", "3", "--prompt-len", "9", "--output-len", "6", "--prefix-len",
              "20", "--suffix-len", "5", "--prefix-output-len", "4", "--seed", "7",
              "--kv-cache-gib", "0.01", "--threads", "1", "--max-model-len", "256",
              "--no-machine-limits"]
EOS = 2
# A stand-in for llama-cpp-python: one sequence; each step yields (last token + 1) % vocab,
# and EOS first, so a driver that stopped at EOS would return one token.
FAKE_LLAMA_CPP = f'''
__version__ = "fake-0"
class Llama:
    def __init__(self, model_path, n_ctx, n_threads, n_threads_batch, n_gpu_layers, seed,
                 verbose):
        self.vocab = int(open(model_path).read())
        self.n_batch, self._n_ctx, self.metadata = 512, n_ctx, {{"general.file_type": "0"}}
        self.input_ids, self.n_tokens = [], 0
    def n_vocab(self):
        return self.vocab
    def n_ctx(self):
        return self._n_ctx
    def reset(self):
        self.n_tokens = 0
    def generate(self, tokens, temp, repeat_penalty, reset):
        assert temp == 0.0 and repeat_penalty == 1.0 and reset
        seq = list(tokens)
        token = {EOS}
        while True:
            self.input_ids, self.n_tokens = seq, len(seq)
            yield token
            seq.append(token)
            token = (token + 1) % self.vocab
'''


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    vocab = len(gpt2_vocabulary().tokens)
    return write_random_checkpoint(tmp_path_factory.mktemp("peers") / "m",
                                   tiny_config(vocab_size=vocab), seed=3)


@pytest.fixture()
def driver(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """The llama.cpp driver imported as its script sees itself (its folder on sys.path)."""
    monkeypatch.syspath_prepend(str(PEERS_DIR))
    return importlib.import_module("llamacpp_engine_driver")


def bench(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, list[dict[str, Any]],
                                                                    str]:
    code = main(["bench", "engine", *argv, *SIZE_FLAGS])
    out, err = capsys.readouterr()
    rows = [json.loads(line) for line in out.splitlines()] if "--json" in argv else []
    return code, rows, err


def test_vllm_dtype_and_llamacpp_flags_parse() -> None:
    parser = build_parser()
    args = parser.parse_args(["bench", "engine", "--vllm-dtype", "float32", "bfloat16",
                              "--peer", "vllm", "llamacpp", "--gguf", "m.gguf",
                              "--vllm-timeout", "5"])
    assert args.vllm_dtype == ["float32", "bfloat16"] and args.peer == ["vllm", "llamacpp"]
    assert args.gguf == Path("m.gguf") and args.peer_timeout == 5.0
    defaults = parser.parse_args(["bench", "engine"])
    assert defaults.vllm_dtype == ["float32"] and defaults.gguf is None
    with pytest.raises(SystemExit):
        parser.parse_args(["bench", "engine", "--vllm-dtype", "float16"])


def test_vllm_systems_keep_the_old_name_for_float32() -> None:
    assert vllm_system("float32") == "vllm" and vllm_system("bfloat16") == "vllm:bfloat16"
    with pytest.raises(ValueError, match="choose from float32, bfloat16"):
        vllm_system("float16")


def test_llamacpp_needs_a_gguf_by_name_and_only_joins_auto_when_installed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVSERVE_LLAMACPP_PYTHON", str(tmp_path / "absent"))
    assert "llamacpp" not in chosen_peers(["auto"])
    assert "not installed" in (chosen_peers(["llamacpp"], tmp_path / "m.gguf")["llamacpp"] or "")
    (tmp_path / "python").touch()
    monkeypatch.setenv("KVSERVE_LLAMACPP_PYTHON", str(tmp_path / "python"))
    assert "pass --gguf FILE" in (chosen_peers(["auto"])["llamacpp"] or "")
    assert chosen_peers(["auto"], tmp_path / "m.gguf")["llamacpp"] is None
    with pytest.raises(ValueError, match="pass --gguf FILE"):
        chosen_peers(["llamacpp"])


def test_gguf_errors_say_how_to_fix_the_command(capsys, model_dir, tmp_path) -> None:
    code, _, err = bench(capsys, "--model", str(model_dir), "--peer", "llamacpp")
    assert code == 2 and "--peer llamacpp: pass --gguf FILE" in err
    code, _, err = bench(capsys, "--model", str(model_dir), "--peer", "llamacpp", "--gguf",
                         str(tmp_path / "none.gguf"))
    assert code == 2 and "no such file" in err
    (tmp_path / "m.gguf").touch()
    code, _, err = bench(capsys, "--model", str(model_dir), "tiny", "--peer", "llamacpp",
                         "--gguf", str(tmp_path / "m.gguf"))
    assert code == 2 and "run one --model with it" in err


def test_each_vllm_dtype_is_a_system_and_kvserve_reports_its_peak_rss(capsys, model_dir,
                                                                      monkeypatch) -> None:
    monkeypatch.setenv("KVSERVE_VLLM_PYTHON", str(model_dir / "no-such-python"))
    code, (cell,), _ = bench(capsys, "--model", str(model_dir), "--peer", "vllm", "--workload",
                             "decode-heavy", "--vllm-dtype", "float32", "bfloat16", "--json")
    assert code == 0
    assert list(cell["systems"]) == ["kvserve", "vllm", "vllm:bfloat16"]
    assert all("not installed" in cell["systems"][s]["skipped"] for s in ("vllm",
                                                                          "vllm:bfloat16"))
    ours = cell["systems"]["kvserve"]
    if sys.platform == "linux":
        assert ours["peak_rss_mib"] >= ours["info"]["rss_before_load_mib"] > 0


def test_peak_rss_reset_and_read(tmp_path: Path) -> None:
    (tmp_path / "status").write_text("Name:\tx\nVmHWM:\t  2048 kB\nVmRSS:\t 1024 kB\n")
    assert status_mib("VmHWM", tmp_path) == 2.0 and status_mib("VmRSS", tmp_path) == 1.0
    assert status_mib("VmSwap", tmp_path) is None
    assert status_mib("VmHWM", tmp_path / "gone") is None
    assert not reset_peak_rss(tmp_path / "gone")
    if not reset_peak_rss():
        pytest.skip("this kernel cannot reset the peak RSS (/proc/self/clear_refs)")
    before = status_mib("VmHWM")
    # Fresh pages from the kernel (the heap may hold freed pages still resident), resident
    # once written.
    with mmap.mmap(-1, 64 << 20) as block:
        for offset in range(0, len(block), 4096):
            block[offset] = 1
        after = status_mib("VmHWM")
    assert before is not None and after is not None and after - before > 60


def test_driver_peak_rss_counts_live_children(monkeypatch) -> None:
    monkeypatch.syspath_prepend(str(PEERS_DIR))
    output = importlib.import_module("driver_output")
    if not Path("/proc/self/status").exists():
        pytest.skip("no /proc here")
    child = subprocess.Popen([sys.executable, "-c", "import time; b = b'x' * (48 << 20); "
                              "print(flush=True); time.sleep(30)"], stdout=subprocess.PIPE)
    try:
        assert child.stdout is not None and child.stdout.readline()
        assert child.pid in output.descendants(os.getpid())
        alone = output.vm_hwm_kib(os.getpid()) / 1024
        assert output.peak_rss_mib() - alone > 45
    finally:
        child.kill()
        child.wait()


def test_a_silent_driver_crash_is_named() -> None:
    assert exit_reason(-4) == "no output, killed by SIGILL"
    assert exit_reason(3) == "no output, exit code 3"


def test_driver_spec_and_prompt_checks_name_what_is_wrong(driver) -> None:
    spec = {"gguf": "m.gguf", "vocab_size": 10, "max_model_len": 64, "num_threads": 1,
            "repeats": 1, "workloads": [{"name": "w", "prompts": [[4]], "max_tokens": 2,
                                         "warmup_prompts": [[5]], "warmup_max_tokens": 1}]}
    assert driver.check_spec(spec) is spec
    with pytest.raises(ValueError, match="'num_threads' must be at least 1"):
        driver.check_spec(spec | {"num_threads": 0})
    with pytest.raises(ValueError, match="'gguf' must be a str"):
        driver.check_spec({k: v for k, v in spec.items() if k != "gguf"})
    with pytest.raises(ValueError, match="workload 0 lacks warmup_max_tokens"):
        driver.check_spec(spec | {"workloads": [{"name": "w", "prompts": [], "max_tokens": 1,
                                                 "warmup_prompts": []}]})
    with pytest.raises(ValueError, match="token id 10 outside the vocabulary"):
        driver.check_fits([[4, 10]], 2, 10, 64)
    with pytest.raises(ValueError, match="raise --max-model-len"):
        driver.check_fits([[4] * 60], 5, 10, 64)


def test_driver_counts_the_prefix_generate_reuses(driver) -> None:
    assert driver.reused_prefix([], [1, 2]) == 0
    assert driver.reused_prefix([1, 2, 3, 9], [1, 2, 3, 4]) == 3
    assert driver.reused_prefix([1, 2, 3, 9], [1, 2]) == 1  # whole prompt: last token again
    assert driver.reused_prefix([7], [1, 2]) == 0


def test_driver_generates_exactly_max_tokens_past_eos_one_request_at_a_time(
        driver, tmp_path) -> None:
    llama_cpp = ModuleType("llama_cpp")
    exec(FAKE_LLAMA_CPP, llama_cpp.__dict__)
    (tmp_path / "m.gguf").write_text("10")
    llm = llama_cpp.Llama(str(tmp_path / "m.gguf"), 64, 1, 1, 0, 0, False)
    prefix = [4, 5, 6]
    run = driver.generate(llm, [prefix + [7], prefix + [8]], 4)
    assert run["output_token_ids"] == [[EOS, 3, 4, 5]] * 2  # EOS first, then on past it
    assert run["num_output_tokens"] == 8 and run["system"] == "llamacpp"
    assert run["cached_prompt_tokens"] == 3  # the second request reuses the first's prefix
    assert 0 < run["ttft_s"][0] < run["ttft_s"][1] < run["seconds"]  # queued behind request 0
    assert 0 < run["own_ttft_mean_s"] < run["ttft_s"][1]


def test_llamacpp_peer_end_to_end_through_a_stand_in_llama_cpp(capsys, model_dir, tmp_path,
                                                               monkeypatch) -> None:
    # The real driver script in a subprocess, importing the stand-in instead of llama_cpp.
    (tmp_path / "llama_cpp.py").write_text(FAKE_LLAMA_CPP)
    config = json.loads((model_dir / "config.json").read_text())
    gguf = tmp_path / "m.gguf"
    gguf.write_text(str(config["vocab_size"]))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    monkeypatch.setenv("KVSERVE_LLAMACPP_PYTHON", sys.executable)
    code, cells, _ = bench(capsys, "--model", str(model_dir), "--peer", "llamacpp", "--gguf",
                           str(gguf), "--json")
    assert code == 0 and [c["workload"] for c in cells] == ["decode-heavy", "shared-prefix"]
    for cell in cells:
        ours, theirs = cell["systems"]["kvserve"], cell["systems"]["llamacpp"]
        assert theirs["output_tokens"] == 3 * cell["max_tokens"]
        assert theirs["parity_vs_kvserve"] == 0.0  # the stand-in's tokens are not the model's
        assert theirs["peak_rss_mib"] > 0 and theirs["info"]["llama_cpp_version"] == "fake-0"
        assert theirs["info"]["one_sequence_at_a_time"] is True
        assert cell["ratios_kvserve_over"]["llamacpp"]["output_tok_per_s"] == pytest.approx(
            ours["output_tok_per_s"] / theirs["output_tok_per_s"])
    assert cells[1]["systems"]["llamacpp"]["info"]["cached_prompt_tokens"] == 2 * 20
    gguf.write_text("99")  # another model's vocabulary: the driver refuses to start
    code, cells, _ = bench(capsys, "--model", str(model_dir), "--peer", "llamacpp", "--gguf",
                           str(gguf), "--json", "--workload", "decode-heavy")
    assert code == 0 and "pass --gguf of the same model" in cells[0]["systems"]["llamacpp"][
        "skipped"]


def test_llamacpp_driver_for_real_on_a_tiny_gguf(capsys, model_dir, tmp_path) -> None:
    python = llamacpp_python()
    if python is None or subprocess.run([python, "-c", "import llama_cpp"],
                                        capture_output=True).returncode != 0:
        pytest.skip(f"llama-cpp-python is not installed or does not import ({python}; "
                    "docs/peers.md: $PEERS/llamacpp, or KVSERVE_LLAMACPP_PYTHON); the stand-in "
                    "test above covers the driver")
    vocab = gpt2_vocabulary()
    gguf = write_gguf(tmp_path / "m.gguf", tiny_config(vocab_size=len(vocab.tokens)), vocab,
                      seed=3)  # the weights of `model_dir`, in F32
    code, cells, _ = bench(capsys, "--model", str(model_dir), "--peer", "llamacpp", "--gguf",
                           str(gguf), "--json")
    assert code == 0
    if "SIGILL" in cells[0]["systems"]["llamacpp"].get("skipped", ""):
        pytest.skip(f"{python} was built for instructions this CPU lacks (SIGILL): rebuild it "
                    "with the CMAKE_ARGS docs/peers.md gives, without the ones this CPU lacks")
    for cell in cells:
        theirs = cell["systems"]["llamacpp"]
        assert "skipped" not in theirs, theirs.get("skipped")
        assert theirs["output_tokens"] == 3 * cell["max_tokens"]
        assert 0 <= theirs["parity_vs_kvserve"] <= 1 and theirs["peak_rss_mib"] > 0
        assert theirs["info"]["n_threads"] == 1
