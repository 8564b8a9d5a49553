"""Install by role: the gateway, the Endpoint Picker, the doctor, the simulator and the CLI import
no engine package, so `pip install kvserve` (no torch) runs them; `kvserve[engine]` holds what the
workers need; the gateway image installs no torch and the Kubernetes gateway runs it."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ENGINE_ONLY = ("torch", "safetensors", "transformers", "kvserve.model", "kvserve.runtime")

# Imports each torch-free role as a user reaches it, then names the engine packages it pulled in.
PROBE = """
import sys
import kvserve.gateway, kvserve.gateway.cli.gateway, kvserve.gateway.proxy.app
import kvserve.gateway.epp.server
import kvserve.ops, kvserve.ops.doctor_command
import kvserve.sim, kvserve.sim.command, kvserve.sim.fleet
import kvserve.cli
for argv in (["--help"], ["gateway", "--help"], ["epp", "--help"], ["doctor", "--help"],
             ["simulate", "--help"]):
    try:
        kvserve.cli.main(argv)
    except SystemExit as exit:
        assert exit.code == 0, (argv, exit.code)
print("ENGINE:" + ",".join(m for m in {modules} if m in sys.modules))
"""


def pulled_engine_modules(probe: str = PROBE) -> list[str]:
    done = subprocess.run([sys.executable, "-c", probe.format(modules=ENGINE_ONLY)],
                          capture_output=True, text=True, timeout=120, check=True)
    (line,) = [x for x in done.stdout.splitlines() if x.startswith("ENGINE:")]
    return [m for m in line.removeprefix("ENGINE:").split(",") if m]


def test_gateway_doctor_simulator_and_help_never_import_torch() -> None:
    assert pulled_engine_modules() == []


def test_the_probe_sees_an_engine_import() -> None:
    # The check above can fail: a probe that also imports the runtime reports torch.
    assert "torch" in pulled_engine_modules(PROBE.replace("import kvserve.cli\n",
                                                          "import kvserve.cli, kvserve.model\n"))


def pyproject() -> dict:  # type: ignore[type-arg]
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def names(requirements: list[str]) -> set[str]:
    return {re.split(r"[\[<>=!~ ;]", r, maxsplit=1)[0].lower() for r in requirements}


def test_base_install_has_no_engine_packages_and_the_engine_extra_has_them() -> None:
    project = pyproject()["project"]
    base = names(project["dependencies"])
    assert not base & {"torch", "safetensors", "transformers", "matplotlib"}, base
    assert {"torch", "safetensors"} <= names(project["optional-dependencies"]["engine"])


def test_make_installs_every_role_with_torch_first() -> None:
    makefile = (ROOT / "Makefile").read_text()
    torch_line = makefile.index("pip install -q torch==")
    project_line = makefile.index("pip install -q -e '.[")
    assert torch_line < project_line
    extras = re.search(r"pip install -q -e '\.\[([^\]]*)\]'", makefile)
    assert extras and {"engine", "dev"} <= set(extras.group(1).split(","))


def test_gateway_image_installs_no_torch_and_the_gateway_manifest_uses_it() -> None:
    dockerfile = (ROOT / "deploy" / "Dockerfile.gateway").read_text()
    steps = [line for line in dockerfile.splitlines() if not line.lstrip().startswith("#")]
    assert not any("torch" in line or "[engine" in line for line in steps), dockerfile
    assert re.search(r"^RUN pip install \.", dockerfile, re.M)
    assert re.search(r'^ENTRYPOINT \["kvserve"\]', dockerfile, re.M)
    assert (ROOT / "deploy" / "Dockerfile.gateway.dockerignore").is_file()
    yaml = pytest.importorskip("yaml", reason="PyYAML is needed to read the manifests")
    docs = [d for d in yaml.safe_load_all((ROOT / "deploy/k8s/gateway.yaml").read_text()) if d]
    (deployment,) = [d for d in docs if d["kind"] == "Deployment"]
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    assert container["image"].startswith("kvserve-gateway:"), container["image"]
    user = re.findall(r"^USER (\S+)", dockerfile, re.M)
    run_as = deployment["spec"]["template"]["spec"]["securityContext"]["runAsUser"]
    assert user and user[-1].split(":")[0] == str(run_as)


def test_an_engine_command_without_torch_says_how_to_install_it() -> None:
    probe = ("import sys\nsys.modules['torch'] = None  # as in `pip install kvserve`: no torch\n"
             "import kvserve.cli\nsys.exit(kvserve.cli.main(['serve', '--port', '1']))\n")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2, done.stderr
    assert "pip install 'kvserve[engine]'" in done.stderr and "Traceback" not in done.stderr
