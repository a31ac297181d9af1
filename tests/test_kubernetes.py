"""deploy/kubernetes/: every manifest valid against the published Kubernetes schemas (offline, with
kubernetes-validate), and shaped as docs/deployment.md says: a gateway Deployment
behind a Service and a CPU HorizontalPodAutoscaler, one Redis, engine groups as a StatefulSet whose
pod runs the scheduler and one single-GPU container per tensor-parallel rank."""
from __future__ import annotations

import copy
import re

import kubernetes_validate
import pytest
import yaml

from common.config import GatewayConfig
from tests.conftest import ROOT
from tests.deployments import EngineGroup, check_engine_group, parse_health, parse_pagoda

MANIFESTS = ROOT / "deploy" / "kubernetes"
# the oldest Kubernetes these manifests claim (autoscaling/v2, StatefulSet podManagementPolicy), and
# the newest the installed kubernetes-validate knows
VERSIONS = ["1.28", kubernetes_validate.utils.latest_version()]
ENGINE_POD = "pagoda-engine-0"  # the name of a StatefulSet pod, for $(POD_NAME)


def manifest_files() -> list:
    return sorted(p for p in MANIFESTS.glob("*.yaml") if p.name != "kustomization.yaml")


def resources() -> list[dict]:
    return [doc for path in manifest_files() for doc in yaml.safe_load_all(path.read_text()) if doc]


def resource(kind: str, name: str) -> dict:
    found = [r for r in resources() if r["kind"] == kind and r["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} found"
    return found[0]


def validate(doc: dict, version: str) -> None:
    """Strict: a field the schema does not know fails too (a misspelt `comand` is not ignored)."""
    kubernetes_validate.validate(doc, version, strict=True)


def container_env(container: dict, pod_name: str = ENGINE_POD) -> dict[str, str]:
    """The environment Kubernetes gives `container`: its ConfigMaps' data, then its env."""
    env = {}
    for source in container.get("envFrom", []):
        env.update(resource("ConfigMap", source["configMapRef"]["name"])["data"])
    for var in container.get("env", []):
        if "value" in var:
            env[var["name"]] = var["value"]
        else:
            assert var["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.name"}}, var
            env[var["name"]] = pod_name
    return env


def expand(argv: list[str], env: dict[str, str]) -> list[str]:
    """Kubernetes' $(VAR) expansion of a container's command (an unknown variable stays as written)."""
    return [re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m[1], m[0]), arg) for arg in argv]


def containers(workload: dict) -> dict[str, dict]:
    return {c["name"]: c for c in workload["spec"]["template"]["spec"]["containers"]}


def command_of(container: dict, pod_name: str = ENGINE_POD):
    env = container_env(container, pod_name)
    return parse_pagoda(expand(container["command"], env), env)


def probe_check(container: dict, probe: str):
    return parse_health(container[probe]["exec"]["command"], container_env(container))


# ----------------------------------------------------------------------------- schemas

@pytest.mark.parametrize("version", VERSIONS)
def test_every_manifest_is_valid_against_the_kubernetes_schemas(version):
    kinds = []
    for path in manifest_files():
        for doc in yaml.safe_load_all(path.read_text()):
            # a kind the package has no schema for raises SchemaNotFoundError: never skipped silently
            validate(doc, version)
            kinds.append(f"{doc['kind']}/{doc['metadata']['name']}")
    assert sorted(kinds) == ["ConfigMap/pagoda-config", "Deployment/pagoda-gateway", "Deployment/pagoda-redis",
                             "HorizontalPodAutoscaler/pagoda-gateway", "Service/pagoda-engine",
                             "Service/pagoda-gateway", "Service/pagoda-redis", "StatefulSet/pagoda-engine"]


def test_the_validation_rejects_broken_manifests():
    statefulset = resource("StatefulSet", "pagoda-engine")
    validate(statefulset, VERSIONS[-1])
    misspelt = copy.deepcopy(statefulset)
    rank = misspelt["spec"]["template"]["spec"]["containers"][1]
    rank["comand"] = rank.pop("command")
    with pytest.raises(kubernetes_validate.ValidationError, match="'comand' was unexpected"):
        validate(misspelt, VERSIONS[-1])
    unselected = copy.deepcopy(statefulset)
    del unselected["spec"]["selector"]
    with pytest.raises(kubernetes_validate.ValidationError, match="'selector' is a required property"):
        validate(unselected, VERSIONS[-1])
    hpa = copy.deepcopy(resource("HorizontalPodAutoscaler", "pagoda-gateway"))
    hpa["spec"]["minReplicas"] = "two"
    with pytest.raises(kubernetes_validate.ValidationError, match="'two' is not of type 'integer'"):
        validate(hpa, VERSIONS[-1])
    with pytest.raises(kubernetes_validate.SchemaNotFoundError):
        validate({**statefulset, "apiVersion": "apps/v1beta9"}, VERSIONS[-1])


def test_the_kustomization_applies_every_manifest_and_sets_the_number_of_engine_groups():
    kustomization = yaml.safe_load((MANIFESTS / "kustomization.yaml").read_text())
    assert (kustomization["apiVersion"], kustomization["kind"]) == ("kustomize.config.k8s.io/v1beta1", "Kustomization")
    assert sorted(kustomization["resources"]) == [p.name for p in manifest_files()]
    assert kustomization["replicas"] == [{"name": "pagoda-engine", "count": 2}]
    resource("StatefulSet", "pagoda-engine")


def test_every_service_selects_the_pods_of_one_workload_by_a_port_they_declare():
    workloads = [r for r in resources() if r["kind"] in ("Deployment", "StatefulSet")]
    for service in (r for r in resources() if r["kind"] == "Service"):
        name, selector = service["metadata"]["name"], service["spec"]["selector"]
        selected = [w for w in workloads if selector.items() <= w["spec"]["template"]["metadata"]["labels"].items()]
        assert [w["metadata"]["name"] for w in selected] == [name]
        assert selected[0]["spec"]["selector"]["matchLabels"] == selector
        declared = {p["name"] for c in containers(selected[0]).values() for p in c.get("ports", [])}
        assert {p["targetPort"] for p in service["spec"].get("ports", [])} <= declared, name


# ----------------------------------------------------------------------------- engine groups

def test_an_engine_group_pod_is_a_scheduler_and_one_single_gpu_container_per_rank():
    statefulset = resource("StatefulSet", "pagoda-engine")
    assert statefulset["spec"]["serviceName"] == "pagoda-engine"
    assert resource("Service", "pagoda-engine")["spec"]["clusterIP"] == "None"
    pod = containers(statefulset)
    assert list(pod) == ["scheduler", "rank-0", "rank-1"]
    scheduler = command_of(pod["scheduler"])
    ranks = {name: command_of(c) for name, c in pod.items() if name != "scheduler"}
    assert scheduler.name == "scheduler" and {r.name for r in ranks.values()} == {"worker"}
    check_engine_group(EngineGroup("pagoda-engine", scheduler, list(ranks.values())))
    assert {name: r.args.rank for name, r in ranks.items()} == {"rank-0": 0, "rank-1": 1}
    assert scheduler.engine.tensor_parallel_size == 2
    # one pod, one network: nothing binds beyond the pod's loopback
    assert scheduler.serving.zmq_address == "tcp://127.0.0.1:5557"
    assert {(r.serving.zmq_address, r.serving.dist_init_address) for r in ranks.values()} == {
        ("tcp://127.0.0.1:5557", "tcp://127.0.0.1:29500")}
    # each pod is its own group on /metrics: the engine label is the pod's name
    assert scheduler.serving.engine_id == ENGINE_POD
    assert command_of(pod["scheduler"], "pagoda-engine-1").serving.engine_id == "pagoda-engine-1"
    for name, container in pod.items():
        gpus = {k: v.get("nvidia.com/gpu") for k, v in container["resources"].items()}
        assert gpus == ({"requests": None} if name == "scheduler" else {"requests": 1, "limits": 1}), name
        assert container["image"] == "pagoda:latest"
    assert statefulset["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > scheduler.serving.drain_timeout_s


def test_the_scheduler_reaches_redis_by_its_service_and_its_probes_check_its_own_group():
    pod = containers(resource("StatefulSet", "pagoda-engine"))
    scheduler = command_of(pod["scheduler"])
    redis_service = resource("Service", "pagoda-redis")
    assert scheduler.serving.redis_url == f"redis://pagoda-redis:{redis_service['spec']['ports'][0]['port']}/0"
    for probe in ("startupProbe", "livenessProbe"):
        check = probe_check(pod["scheduler"], probe)
        assert (check.redis_url, check.this_host, check.workers) == (scheduler.serving.redis_url, True, False), probe
    check = probe_check(pod["scheduler"], "readinessProbe")
    assert (check.redis_url, check.this_host, check.workers) == (scheduler.serving.redis_url, True, True)
    for name in ("rank-0", "rank-1"):
        rank = command_of(pod[name])
        for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
            check = probe_check(pod[name], probe)
            assert (check.heartbeat_file, check.max_age) == (rank.serving.heartbeat_file, 15.0), (name, probe)
            assert check.heartbeat_file is not None
        # the heartbeat starts before the model loads: startup allows 300 s of it
        startup = pod[name]["startupProbe"]
        assert startup["periodSeconds"] * startup["failureThreshold"] == 300


# ----------------------------------------------------------------------------- gateway and Redis

def test_the_gateway_listens_for_its_service_and_scales_on_cpu():
    deployment = resource("Deployment", "pagoda-gateway")
    assert "replicas" not in deployment["spec"]  # the autoscaler owns it: an apply must not reset it
    gateway = containers(deployment)["gateway"]
    config = command_of(gateway).configs[GatewayConfig]
    assert config.host == "0.0.0.0"
    assert config.redis_url == "redis://pagoda-redis:6379/0"
    assert [(p["name"], p["containerPort"]) for p in gateway["ports"]] == [("http", config.port)]
    assert resource("Service", "pagoda-gateway")["spec"]["ports"] == [{"name": "http", "port": 8000, "targetPort": "http"}]
    assert gateway["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert gateway["livenessProbe"]["tcpSocket"] == {"port": "http"}  # alive while no engine group is ready
    assert "cpu" in gateway["resources"]["requests"]  # what Utilization is a percentage of
    hpa = resource("HorizontalPodAutoscaler", "pagoda-gateway")
    assert hpa["apiVersion"] == "autoscaling/v2"
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "pagoda-gateway"}
    assert hpa["spec"]["metrics"] == [{"type": "Resource", "resource": {
        "name": "cpu", "target": {"type": "Utilization", "averageUtilization": 70}}}]
    assert 1 <= hpa["spec"]["minReplicas"] < hpa["spec"]["maxReplicas"]
    assert deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > config.drain_timeout_s


def test_redis_keeps_nothing_on_disk_as_in_compose():
    redis = containers(resource("Deployment", "pagoda-redis"))["redis"]
    compose = yaml.safe_load((ROOT / "compose.yaml").read_text())["services"]["redis"]
    assert redis["args"] == compose["command"] == ["redis-server", "--save", "", "--appendonly", "no"]
    assert redis["readinessProbe"]["exec"]["command"] == redis["livenessProbe"]["exec"]["command"] == ["redis-cli", "ping"]
    assert resource("Deployment", "pagoda-redis")["spec"]["strategy"] == {"type": "Recreate"}
    assert resource("ConfigMap", "pagoda-config")["data"]["PAGODA_REDIS_URL"] == "redis://pagoda-redis:6379/0"
    assert resource("Service", "pagoda-redis")["spec"]["ports"] == [{"name": "redis", "port": 6379, "targetPort": "redis"}]
