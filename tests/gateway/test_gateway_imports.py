"""A gateway process never loads torch, the model or the runtime: it is a light proxy (~270 MB with
torch loaded, for nothing). Checked in a fresh interpreter, as `kvserve gateway` starts. The
engine's pure scheduler (no torch, no numpy) may load: `kvserve simulate`, which the same CLI
offers, runs it; the gateway's own modules never import it (an import-linter contract)."""

from __future__ import annotations

import subprocess
import sys


def test_the_cli_and_the_gateway_app_import_neither_torch_nor_the_model_layers() -> None:
    code = ("import sys, kvserve.cli, kvserve.gateway.proxy.app, kvserve.gateway.cli.gateway; "
            "heavy = sorted(m for m in sys.modules if m == 'torch' or "
            "m.startswith(('kvserve.model', 'kvserve.runtime'))); "
            "print(heavy); sys.exit(1 if heavy else 0)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, f"imported: {result.stdout}{result.stderr}"
