"""deploy/k8s/epp, the Endpoint Picker mode: its core kinds pass kubernetes-validate (strict, on
the newest and the oldest Kubernetes test_manifests.py checks), its InferencePool and HTTPRoute
pass the published CRDs' schemas (tests/data/crds, unknown fields refused as a strict apply
does), and the pieces name each other: the pool picks the workers' pods on their port and the
EPP's Service on its gRPC port, the route sends to the pool from the Gateway the network policy
admits, and the EPP resolves the same pods the pool admits, with arguments kvserve parses."""

from __future__ import annotations

import argparse
import copy
import functools
from pathlib import Path
from typing import Any

import pytest

from tests.ops.test_manifests import OLDEST_KUBERNETES

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
# EPP mode applies its own files with the workers, their network policy and the ServiceMonitor
APPLIED = [*sorted((K8S / "epp").glob("*.yaml")), K8S / "worker.yaml",
           K8S / "networkpolicy.yaml", K8S / "servicemonitor.yaml"]
CRDS = ROOT / "tests" / "data" / "crds"
CRD_FILES = {"InferencePool": CRDS / "inference.networking.k8s.io_inferencepools.yaml",
             "HTTPRoute": CRDS / "gateway.networking.k8s.io_httproutes.yaml"}
NOT_CORE = {"ServiceMonitor", *CRD_FILES}
EPP_ONLY_FLAGS = ("--grpc-port", "--worker-dns")  # what `kvserve gateway` does not have
yaml = pytest.importorskip("yaml", reason="PyYAML is needed to read the manifests")


@functools.cache
def documents() -> tuple[dict[str, Any], ...]:
    docs: list[dict[str, Any]] = []
    for path in APPLIED:
        docs += [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
    return tuple(docs)


def one(kind: str, name: str | None = None) -> dict[str, Any]:
    found = [d for d in documents()
             if d["kind"] == kind and name in (None, d["metadata"]["name"])]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return copy.deepcopy(found[0])


def pod_of(workload: dict[str, Any]) -> dict[str, Any]:
    return workload["spec"]["template"]  # type: ignore[no-any-return]


def only_container(workload: dict[str, Any]) -> dict[str, Any]:
    (container,) = pod_of(workload)["spec"]["containers"]
    return container  # type: ignore[no-any-return]


def container_port(workload: dict[str, Any], name: str) -> int:
    ports = {p["name"]: p["containerPort"] for p in only_container(workload)["ports"]}
    return ports[name]


def flag(workload: dict[str, Any], name: str) -> str:
    (value,) = [a.split("=", 1)[1] for a in only_container(workload)["args"]
                if a.startswith(f"{name}=")]
    return value


def matches(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return selector.items() <= labels.items()


def service_port(service: dict[str, Any], number: int) -> dict[str, Any]:
    (port,) = [p for p in service["spec"]["ports"] if p["port"] == number]
    return port  # type: ignore[no-any-return]


def epp() -> dict[str, Any]:
    return one("Deployment", "kvserve-epp")


def workers() -> dict[str, Any]:
    return one("StatefulSet", "kvserve-worker")


# --- schemas ---------------------------------------------------------------------------------

def strict(schema: dict[str, Any]) -> dict[str, Any]:
    """The schema with unknown fields refused wherever it lists properties and does not keep
    unknown ones, as the API server does for `kubectl apply` (field validation Strict)."""
    out = dict(schema)
    if "properties" in out:
        out["properties"] = {k: strict(v) for k, v in out["properties"].items()}
        if "additionalProperties" not in out and \
                not out.get("x-kubernetes-preserve-unknown-fields"):
            out["additionalProperties"] = False
    for key in ("items", "additionalProperties"):
        if isinstance(out.get(key), dict):
            out[key] = strict(out[key])
    for key in ("allOf", "anyOf", "oneOf"):
        if key in out:
            out[key] = [strict(s) for s in out[key]]
    return out


@functools.cache
def crd_schema(kind: str, api_version: str) -> dict[str, Any]:
    (crd,) = yaml.load_all(CRD_FILES[kind].read_text(), Loader=yaml.CSafeLoader)
    group, version = api_version.split("/")
    assert crd["spec"]["group"] == group and crd["spec"]["names"]["kind"] == kind
    served = {v["name"]: v for v in crd["spec"]["versions"] if v["served"]}
    assert version in served, f"{kind} {api_version}: the CRD serves {sorted(served)}"
    return strict(served[version]["schema"]["openAPIV3Schema"])


def validate_custom(doc: dict[str, Any], version: str) -> None:
    """Raises if the resource breaks its CRD's schema or its metadata breaks ObjectMeta."""
    jsonschema = pytest.importorskip("jsonschema", reason="jsonschema checks the CRD schemas")
    validator = pytest.importorskip("kubernetes_validate")
    jsonschema.Draft4Validator(crd_schema(doc["kind"], doc["apiVersion"])).validate(doc)
    carrier = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": doc["metadata"]}
    validator.validate(carrier, version, strict=True)


@pytest.mark.parametrize("version", ["latest", OLDEST_KUBERNETES])
def test_the_core_kinds_pass_the_schema_check(version: str) -> None:
    validator = pytest.importorskip(
        "kubernetes_validate", reason="kubernetes-validate is not installed: only the "
        "consistency checks ran")
    target = validator.latest_version() if version == "latest" else version
    kinds = set()
    for doc in documents():
        if doc["kind"] not in NOT_CORE:
            validator.validate(doc, target, strict=True)  # raises, naming the path
            kinds.add(doc["kind"])
    assert kinds >= {"ServiceAccount", "Service", "Deployment", "PodDisruptionBudget",
                     "NetworkPolicy", "StatefulSet"}


@pytest.mark.parametrize("kind", sorted(CRD_FILES))
def test_the_pool_and_the_route_pass_their_published_crds(kind: str) -> None:
    pytest.importorskip("kubernetes_validate")
    validate_custom(one(kind), pytest.importorskip("kubernetes_validate").latest_version())


def test_the_crd_check_refuses_unknown_fields_bad_values_and_missing_fields() -> None:
    jsonschema = pytest.importorskip("jsonschema")
    latest = pytest.importorskip("kubernetes_validate").latest_version()
    pool, route = one("InferencePool"), one("HTTPRoute")
    typo = copy.deepcopy(pool)  # an optional field misspelt: a strict apply refuses it
    typo["spec"]["endpointPickerRef"]["failMode"] = typo["spec"]["endpointPickerRef"].pop(
        "failureMode")
    experimental = copy.deepcopy(route)  # HTTPRoute retries are not in the standard channel
    experimental["spec"]["rules"][0]["retry"] = {"attempts": 2}
    bad_mode = copy.deepcopy(pool)
    bad_mode["spec"]["endpointPickerRef"]["failureMode"] = "Open"
    no_selector = copy.deepcopy(pool)
    del no_selector["spec"]["selector"]
    bad_timeout = copy.deepcopy(route)
    bad_timeout["spec"]["rules"][0]["timeouts"]["request"] = "five minutes"
    for broken in (typo, experimental, bad_mode, no_selector, bad_timeout):
        with pytest.raises(jsonschema.ValidationError):
            validate_custom(broken, latest)


# --- cross-references ------------------------------------------------------------------------

def test_the_pool_picks_the_worker_pods_on_their_http_port() -> None:
    pool = one("InferencePool")
    selector = pool["spec"]["selector"]["matchLabels"]
    assert matches(selector, pod_of(workers())["metadata"]["labels"])
    assert not matches(selector, pod_of(epp())["metadata"]["labels"])
    assert [p["number"] for p in pool["spec"]["targetPorts"]] == \
        [container_port(workers(), "http")]


def test_the_pool_names_the_epp_service_and_its_grpc_port() -> None:
    ref = one("InferencePool")["spec"]["endpointPickerRef"]
    assert ref.get("kind", "Service") == "Service" and ref.get("group", "") == ""
    assert ref["failureMode"] == "FailClose"  # as docs/operations.md says
    service = one("Service", ref["name"])
    assert matches(service["spec"]["selector"], pod_of(epp())["metadata"]["labels"])
    port = service_port(service, ref["port"]["number"])
    assert port["appProtocol"] in ("http2", "kubernetes.io/h2c")  # gRPC, in plaintext
    assert container_port(epp(), port["targetPort"]) == int(flag(epp(), "--grpc-port"))


def test_the_epp_resolves_the_pods_the_pool_admits() -> None:
    name, port = flag(epp(), "--worker-dns").rsplit(":", 1)
    service = one("Service", name)
    assert service["spec"]["clusterIP"] == "None", "--worker-dns needs a headless Service"
    assert service["spec"]["selector"] == one("InferencePool")["spec"]["selector"]["matchLabels"]
    target = service_port(service, int(port))["targetPort"]
    assert container_port(workers(), target) in \
        [p["number"] for p in one("InferencePool")["spec"]["targetPorts"]]


def test_the_route_sends_the_openai_api_to_the_pool_from_one_gateway() -> None:
    route = one("HTTPRoute")
    (parent,) = route["spec"]["parentRefs"]
    assert (parent["group"], parent["kind"]) == ("gateway.networking.k8s.io", "Gateway")
    (rule,) = route["spec"]["rules"]
    (backend,) = rule["backendRefs"]
    assert (backend["group"], backend["kind"], backend["name"]) == \
        ("inference.networking.k8s.io", "InferencePool", one("InferencePool")["metadata"]["name"])
    assert [m["path"] for m in rule["matches"]] == [{"type": "PathPrefix", "value": "/v1"}]
    # the network policies admit the Envoy pods of the Gateway the route attaches to
    envoy = {"gateway.networking.k8s.io/gateway-name": parent["name"]}
    for policy_name in ("kvserve-worker-epp-mode", "kvserve-epp"):
        peers = [p["podSelector"]["matchLabels"]
                 for rule in one("NetworkPolicy", policy_name)["spec"]["ingress"]
                 for p in rule["from"] if "podSelector" in p]
        assert envoy in peers, policy_name


def test_the_network_policies_open_the_epp_mode_paths_only() -> None:
    worker_rules = one("NetworkPolicy", "kvserve-worker-epp-mode")["spec"]
    assert matches(worker_rules["podSelector"]["matchLabels"],
                   pod_of(workers())["metadata"]["labels"])
    (rule,) = worker_rules["ingress"]
    peers = [p["podSelector"]["matchLabels"] for p in rule["from"]]
    assert any(matches(p, pod_of(epp())["metadata"]["labels"]) for p in peers)
    assert [p["port"] for p in rule["ports"]] == ["http"]
    container_port(workers(), "http")
    epp_rules = one("NetworkPolicy", "kvserve-epp")["spec"]
    assert matches(epp_rules["podSelector"]["matchLabels"], pod_of(epp())["metadata"]["labels"])
    assert epp_rules["policyTypes"] == worker_rules["policyTypes"] == ["Ingress"]
    ports = {p["port"] for r in epp_rules["ingress"] for p in r["ports"]}
    assert ports == {"grpc", "http"}
    for name in ports:
        container_port(epp(), name)  # a named port the EPP's container has


def test_the_epp_pod_probes_scrape_and_secrets() -> None:
    deployment, container = epp(), only_container(epp())
    assert container["image"].startswith("kvserve-gateway:")  # no torch in the EPP
    assert container["args"][0] == "epp"
    grpc_port = container_port(deployment, "grpc")
    assert container["readinessProbe"]["grpc"] == {"port": grpc_port, "service": "readiness"}
    assert container["livenessProbe"]["grpc"] == {"port": grpc_port, "service": "liveness"}
    annotations = pod_of(deployment)["metadata"]["annotations"]
    assert int(annotations["prometheus.io/port"]) == container_port(deployment, "http") == \
        int(flag(deployment, "--port"))
    monitor = one("ServiceMonitor")
    service = one("Service", "kvserve-epp")
    assert matches(monitor["spec"]["selector"]["matchLabels"], service["metadata"]["labels"])
    assert {e["port"] for e in monitor["spec"]["endpoints"]} <= \
        {p["name"] for p in service["spec"]["ports"]}
    secrets = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in container["env"]}
    worker_secrets = {e["name"]: e["valueFrom"]["secretKeyRef"]
                      for e in only_container(workers())["env"] if "valueFrom" in e}
    assert secrets["KVSERVE_TRUSTED_SALT_KEY"] == worker_secrets["KVSERVE_TRUSTED_SALT_KEY"]
    assert not secrets["KVSERVE_SALT_SECRET"].get("optional", False)
    assert int(flag(deployment, "--replicas")) == deployment["spec"]["replicas"]
    # a request waiting for a slot holds the Gateway's ext_proc call: both waits are bounded
    # alike, neither left at the proxy's default
    assert flag(deployment, "--queue-timeout") == flag(deployment, "--max-queue-wait")
    pod = pod_of(deployment)["spec"]
    account = one("ServiceAccount", pod["serviceAccountName"])
    assert account["automountServiceAccountToken"] is False  # DNS, not the Kubernetes API
    assert pod["securityContext"]["runAsUser"] == \
        pod_of(workers())["spec"]["securityContext"]["runAsUser"]
    assert one("PodDisruptionBudget", "kvserve-epp")["spec"]["selector"]["matchLabels"] == \
        deployment["spec"]["selector"]["matchLabels"]


def test_the_epp_arguments_parse_with_kvserve(monkeypatch: pytest.MonkeyPatch) -> None:
    """With `kvserve epp` present, its own parser; before it, `kvserve gateway`'s parser takes
    every argument but the EPP-only flags, which are checked here by form."""
    from kvserve.cli import build_parser
    from kvserve.gateway.cli.gateway import tenancy_from
    from kvserve.gateway.core.pipeline import make_policy, parse_policy_options

    monkeypatch.setenv("KVSERVE_SALT_SECRET", "s" * 32)  # the Secret, as the pod's env has it
    parser = build_parser()
    (commands,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    argv = list(only_container(epp())["args"])
    if "epp" not in commands.choices:
        for name in EPP_ONLY_FLAGS:
            assert flag(epp(), name)
        assert int(flag(epp(), "--grpc-port")) > 0
        assert flag(epp(), "--worker-dns").rsplit(":", 1)[1].isdigit()
        argv = ["gateway", *(a for a in argv[1:] if not a.startswith(EPP_ONLY_FLAGS))]
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:
        pytest.fail(f"kvserve refuses the EPP's arguments {argv}: exit {exc.code}")
    make_policy(args.policy, **parse_policy_options(args.policy_option))
    tenancy_from(args)  # --replicas > 1 with the shared salt secret
    assert args.replicas == epp()["spec"]["replicas"]
