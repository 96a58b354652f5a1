"""deploy/k8s against the Kubernetes schemas (kubernetes-validate, offline, strict: unknown fields fail) and
against the CLI: container args, environment variables (inline and through ConfigMaps/Secrets), probe and
Service ports, and grace periods that outlast the drain. No cluster here: nothing is applied."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from tests.deploy.cli_contract import REPO, check_env, listen_port, parse_command

K8S = REPO / "deploy" / "k8s"
# Oldest Kubernetes the docs claim (gRPC probes are GA since 1.27; policy/v1 PDB, autoscaling/v2 HPA) and
# the newest schemas the package ships.
VERSIONS = ["1.29.0", kubernetes_validate.latest_version()]


def manifest_files() -> list[Path]:
    return sorted(p for p in K8S.glob("*.yaml") if p.name != "kustomization.yaml")


@pytest.fixture(scope="module")
def resources() -> list[dict[str, Any]]:
    docs = [d for p in manifest_files() for d in yaml.safe_load_all(p.read_text()) if d]
    assert docs
    return docs


def find(resources: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    matches = [r for r in resources if r["kind"] == kind and r["metadata"]["name"] == name]
    assert len(matches) == 1, f"expected one {kind}/{name}, found {len(matches)}"
    return matches[0]


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("path", manifest_files(), ids=lambda p: p.name)
def test_manifest_validates_against_the_kubernetes_schema(path: Path, version: str) -> None:
    for doc in yaml.safe_load_all(path.read_text()):
        if doc:
            kubernetes_validate.validate(doc, version, strict=True)


def test_kustomization_lists_every_manifest() -> None:
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    assert sorted(kustomization["resources"]) == sorted(p.name for p in manifest_files())


def container_env(resources: list[dict[str, Any]], container: dict[str, Any]) -> dict[str, str]:
    """The container's environment: envFrom ConfigMaps/Secrets (resolved from the manifests) then env."""
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        if "configMapRef" in source:
            env.update(find(resources, "ConfigMap", source["configMapRef"]["name"])["data"])
        elif "secretRef" in source:
            secret = find(resources, "Secret", source["secretRef"]["name"])
            env.update(secret.get("stringData", {}))
            env.update({k: "(base64)" for k in secret.get("data", {})})
    for item in container.get("env", []):
        env[item["name"]] = item.get("value", "(from a reference)")
    return env


PLANES = {"orchestrator": 50051, "toolgateway": 50052}


@pytest.mark.parametrize("name", sorted(PLANES))
def test_deployment_runs_the_cli_with_accepted_settings(resources: list[dict[str, Any]], name: str) -> None:
    deployment = find(resources, "Deployment", name)
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    args = container.get("command", [])[1:] + container["args"] if "command" in container else container["args"]
    ctx = parse_command(args)
    assert ctx.command.name == name
    config = check_env(name, container_env(resources, container))
    port = listen_port(config)
    assert str(config.listen).startswith("0.0.0.0:")
    assert config.store_url.startswith(("redis://", "rediss://")), "replicas share a Redis store"
    assert deployment["spec"]["replicas"] >= 2
    assert [p["containerPort"] for p in container["ports"]] == [port]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["grpc"]["port"] == port, f"{name}: {probe} must be a gRPC probe on {port}"
    resources_ = container["resources"]
    assert resources_["requests"]["cpu"] and resources_["requests"]["memory"] and resources_["limits"]["memory"]
    pre_stop = container.get("lifecycle", {}).get("preStop", {})
    pre_stop_s = (
        float(pre_stop["exec"]["command"][-1])
        if "exec" in pre_stop
        else float(pre_stop.get("sleep", {}).get("seconds", 0))
    )
    assert pod["terminationGracePeriodSeconds"] > config.drain_s + pre_stop_s, (
        f"{name}: grace {pod['terminationGracePeriodSeconds']}s must outlast drain {config.drain_s}s "
        f"+ preStop {pre_stop_s}s"
    )
    assert pod["securityContext"]["runAsNonRoot"] is True


def test_orchestrators_are_authenticated_and_share_a_run_id(resources: list[dict[str, Any]]) -> None:
    (container,) = find(resources, "Deployment", "orchestrator")["spec"]["template"]["spec"]["containers"]
    env = container_env(resources, container)
    config = check_env("orchestrator", env)
    assert config.api_keys and not config.insecure, "a cluster-reachable orchestrator requires API keys"
    secret = find(resources, "Secret", "rlgate-secrets")
    assert {"RLGATE_API_KEYS", "FLEET_API_KEY"} <= set(secret["stringData"])
    assert config.run_id, "one stable run id for all replicas (reconciliation)"
    assert config.shutdown_mode == "handoff", "a pod that stops must not close the sessions of the whole run"
    gateway_host = config.gateway_address.rsplit(":", 1)[0]
    assert gateway_host.startswith("toolgateway.rlgate."), "clients are sent to the gateway's headless Service"


@pytest.mark.parametrize("name", sorted(PLANES))
def test_services_are_headless_and_select_their_pods(resources: list[dict[str, Any]], name: str) -> None:
    service = find(resources, "Service", name)
    deployment = find(resources, "Deployment", name)
    assert service["spec"]["clusterIP"] == "None", "headless, so clients balance across pods"
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()
    (port,) = service["spec"]["ports"]
    assert port["port"] == PLANES[name] and port["targetPort"] == "grpc"
    pdb = find(resources, "PodDisruptionBudget", name)
    assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert pdb["spec"]["minAvailable"] < deployment["spec"]["replicas"], "a PDB must still allow a drain"


def test_gateway_autoscales(resources: list[dict[str, Any]]) -> None:
    hpa = find(resources, "HorizontalPodAutoscaler", "toolgateway")
    target = hpa["spec"]["scaleTargetRef"]
    assert (target["kind"], target["name"]) == ("Deployment", "toolgateway")
    assert hpa["spec"]["minReplicas"] >= 2 and hpa["spec"]["maxReplicas"] > hpa["spec"]["minReplicas"]


def test_redis_persists_append_only_on_a_volume_claim(resources: list[dict[str, Any]]) -> None:
    redis = find(resources, "StatefulSet", "redis")
    (container,) = redis["spec"]["template"]["spec"]["containers"]
    args = container["args"]
    assert args[args.index("--appendonly") + 1] == "yes"
    claims = {c["metadata"]["name"] for c in redis["spec"]["volumeClaimTemplates"]}
    assert {m["name"] for m in container["volumeMounts"]} <= claims
    service = find(resources, "Service", redis["spec"]["serviceName"])
    common = find(resources, "ConfigMap", "rlgate-common")["data"]["RLGATE_STORE_URL"]
    assert f"//{service['metadata']['name']}." in common and ":6379/" in common


def test_only_the_planes_reach_redis(resources: list[dict[str, Any]]) -> None:
    policy = find(resources, "NetworkPolicy", "redis")
    redis_labels = find(resources, "StatefulSet", "redis")["spec"]["template"]["metadata"]["labels"]
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= redis_labels.items()
    (rule,) = policy["spec"]["ingress"]
    (peer,) = rule["from"]
    allowed = {e["key"]: set(e["values"]) for e in peer["podSelector"]["matchExpressions"]}
    assert allowed["app.kubernetes.io/name"] == set(PLANES)
    assert [p["port"] for p in rule["ports"]] == [6379]
