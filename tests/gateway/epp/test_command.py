"""`kvserve epp` on the command line: the bootstrap it prints is one Envoy accepts (checked by
the real binary, `envoy --mode validate`), in both body modes; bad flags are refused saying
what to write instead."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.gateway.epp.envoy_process import envoy_binary, printed_config

WORKERS = ("http://127.0.0.1:8001", "http://127.0.0.1:8002")


def kvserve_epp(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvserve.cli", "epp", *args],
                          capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("mode", ["FULL_DUPLEX_STREAMED", "BUFFERED"])
def test_printed_bootstrap_is_valid_envoy_config(mode: str, tmp_path: Path) -> None:
    text = printed_config(9002, 10000, 9901, WORKERS, ["--envoy-body-mode", mode])
    config = yaml.safe_load(text)
    listener = config["static_resources"]["listeners"][0]
    manager = listener["filter_chains"][0]["filters"][0]["typed_config"]
    ext_proc = manager["http_filters"][0]["typed_config"]
    assert ext_proc["failure_mode_allow"] is False
    assert ext_proc["processing_mode"]["request_body_mode"] == mode
    clusters = {c["name"]: c for c in config["static_resources"]["clusters"]}
    addresses = [e["endpoint"]["address"]["socket_address"]
                 for e in clusters["kvserve_workers"]["load_assignment"]["endpoints"][0][
                     "lb_endpoints"]]
    assert [(a["address"], a["port_value"]) for a in addresses] == [("127.0.0.1", 8001),
                                                                    ("127.0.0.1", 8002)]
    route = manager["route_config"]["virtual_hosts"][0]["routes"][0]["route"]
    assert route["retry_policy"]["num_retries"] == 1  # the fallback list: the other worker
    path = tmp_path / "envoy.yaml"
    path.write_text(text, encoding="utf-8")
    checked = subprocess.run([str(envoy_binary()), "--mode", "validate", "-c", str(path)],
                             capture_output=True, text=True, timeout=60)
    assert checked.returncode == 0, checked.stdout + checked.stderr


def test_printed_bootstrap_resolves_a_headless_service_as_the_picker_does(
        tmp_path: Path) -> None:
    text = printed_config(9002, 10000, 9901, (), ["--worker-dns", "localhost:8000"])
    cluster = {c["name"]: c for c in yaml.safe_load(text)["static_resources"]["clusters"]}[
        "kvserve_workers"]
    assert cluster["type"] == "STRICT_DNS"
    path = tmp_path / "envoy.yaml"
    path.write_text(text, encoding="utf-8")
    checked = subprocess.run([str(envoy_binary()), "--mode", "validate", "-c", str(path)],
                             capture_output=True, text=True, timeout=60)
    assert checked.returncode == 0, checked.stdout + checked.stderr


@pytest.mark.parametrize(("args", "says"), [
    (["--worker", "https://10.0.0.1:8000"], "is not http://HOST:PORT"),
    (["--worker", "http://10.0.0.1"], "gives no port"),
    ([], "give --worker"),
    (["--print-envoy-config"], "give the workers"),
    (["--print-envoy-config", "--workers-file", "w.txt"], "read by the picker alone"),
    (["--print-envoy-config", "--worker", "http://10.0.0.1:8000", "--listen-port", "0"],
     "--listen-port must be a TCP port"),
])
def test_bad_flags_are_refused(args: list[str], says: str) -> None:
    answer = kvserve_epp(*args)
    assert answer.returncode == 2
    assert says in " ".join((answer.stdout + answer.stderr).split())
