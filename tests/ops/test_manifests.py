"""deploy/k8s and deploy/Dockerfile: the manifests parse, pass the Kubernetes schema check
(kubernetes-validate, strict, on the newest and an older Kubernetes) where it is installed, and
agree with each other (the gateway follows the workers' headless Service; probes, scrape
annotations and the image user line up)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
MANIFESTS = sorted((DEPLOY / "k8s").glob("*.yaml"))
NO_CORE_SCHEMA = {"ServiceMonitor"}  # a CRD (Prometheus Operator): checked by hand below
OLDEST_KUBERNETES = "1.28.0"


def documents() -> list[dict[str, Any]]:
    yaml = pytest.importorskip("yaml", reason="PyYAML is needed to read the manifests")
    docs = []
    for path in MANIFESTS:
        docs += [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
    return docs


def by_kind(kind: str) -> list[dict[str, Any]]:
    return [d for d in documents() if d["kind"] == kind]


def container(doc: dict[str, Any]) -> dict[str, Any]:
    (only,) = doc["spec"]["template"]["spec"]["containers"]
    return only


def test_manifests_parse() -> None:
    assert {p.name for p in MANIFESTS} >= {"worker.yaml", "gateway.yaml"}
    for doc in documents():
        assert doc["apiVersion"] and doc["kind"] and doc["metadata"]["name"], doc


@pytest.mark.parametrize("version", ["latest", OLDEST_KUBERNETES])
def test_manifests_pass_the_schema_check(version: str) -> None:
    validator = pytest.importorskip(
        "kubernetes_validate", reason="kubernetes-validate is not installed (pip install "
        "kubernetes-validate): only the YAML and consistency checks ran")
    target = validator.latest_version() if version == "latest" else version
    checked = 0
    for doc in documents():
        if doc["kind"] in NO_CORE_SCHEMA:
            continue
        validator.validate(doc, target, strict=True)  # raises ValidationError, naming the path
        checked += 1
    assert checked >= 4


def test_gateway_follows_the_workers_headless_service() -> None:
    (workers,) = by_kind("StatefulSet")
    service = next(s for s in by_kind("Service") if s["metadata"]["name"] ==
                   workers["spec"]["serviceName"])
    assert service["spec"]["clusterIP"] == "None", "workers need a headless Service"
    port = service["spec"]["ports"][0]["port"]
    (gateway,) = by_kind("Deployment")
    args = container(gateway)["args"]
    assert [a for a in args if a.startswith("--worker")] == [
        f"--worker-dns={service['metadata']['name']}:{port}"]
    assert gateway["spec"]["replicas"] >= 2
    assert "--policy=prefix_hash" in args or "--policy=cache_aware" in args


@pytest.mark.parametrize("kind", ["StatefulSet", "Deployment"])
def test_probes_scrape_annotations_and_resources(kind: str) -> None:
    (doc,) = by_kind(kind)
    spec = container(doc)
    ports = {p["name"]: p["containerPort"] for p in spec["ports"]}
    annotations = doc["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert annotations["prometheus.io/path"] == "/metrics"
    assert int(annotations["prometheus.io/port"]) == ports["http"]
    assert spec["readinessProbe"]["httpGet"]["path"] == "/health"
    assert spec["resources"]["requests"]["cpu"] and spec["resources"]["requests"]["memory"]
    assert spec["args"][0] == ("serve" if kind == "StatefulSet" else "gateway")
    pod = doc["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True


def test_service_monitor_selects_the_services() -> None:
    (monitor,) = by_kind("ServiceMonitor")
    wanted = monitor["spec"]["selector"]["matchLabels"]
    services = [s for s in by_kind("Service")
                if wanted.items() <= s["metadata"]["labels"].items()]
    assert {s["metadata"]["name"] for s in services} == {"kvserve-worker", "kvserve-gateway"}
    port_names = {e["port"] for e in monitor["spec"]["endpoints"]}
    for service in services:
        assert port_names <= {p["name"] for p in service["spec"]["ports"]}


def test_dockerfile_runs_as_the_manifests_user() -> None:
    text = (DEPLOY / "Dockerfile").read_text()
    assert re.search(r"^FROM python:3\.11-slim", text, re.M)
    # torch (the CPU build) is installed before the project and its engine extra, so pip never
    # pulls a CUDA build
    assert text.index('pip install "torch==') < text.index("RUN pip install '.[engine]'")
    user = re.findall(r"^USER (\S+)", text, re.M)
    run_as = {str(container_doc["spec"]["template"]["spec"]["securityContext"]["runAsUser"])
              for container_doc in by_kind("StatefulSet") + by_kind("Deployment")}
    assert user and user[-1] not in ("root", "0") and run_as == {user[-1].split(":")[0]}


def secret_env(doc: dict[str, Any]) -> dict[str, tuple[str, bool]]:
    """env name -> (secret key, optional) for a workload's secret-backed variables."""
    return {e["name"]: (e["valueFrom"]["secretKeyRef"]["key"],
                        e["valueFrom"]["secretKeyRef"].get("optional", False))
            for e in container(doc).get("env", []) if "valueFrom" in e}


def test_workers_take_salts_and_traffic_only_from_the_gateway() -> None:
    (workers,) = by_kind("StatefulSet")
    (gateway,) = by_kind("Deployment")
    worker_env, gateway_env = secret_env(workers), secret_env(gateway)
    # the same required secret on both sides: a worker without it would take anyone's salt
    assert worker_env["KVSERVE_TRUSTED_SALT_KEY"] == gateway_env["KVSERVE_TRUSTED_SALT_KEY"]
    assert worker_env["KVSERVE_TRUSTED_SALT_KEY"][1] is False
    # replicas must share the salt secret, and say they are replicas so they refuse without it
    assert gateway_env["KVSERVE_SALT_SECRET"][1] is False
    assert f"--replicas={gateway['spec']['replicas']}" in container(gateway)["args"]
    (policy,) = by_kind("NetworkPolicy")
    worker_labels = workers["spec"]["template"]["metadata"]["labels"]
    gateway_labels = gateway["spec"]["template"]["metadata"]["labels"]
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= worker_labels.items()
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    sources = [peer for rule in policy["spec"]["ingress"] for peer in rule["from"]]
    pods = [p["podSelector"]["matchLabels"] for p in sources if "podSelector" in p]
    assert pods and all(p.items() <= gateway_labels.items() for p in pods)
    assert all("podSelector" in p or "namespaceSelector" in p for p in sources)
