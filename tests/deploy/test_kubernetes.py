"""The Kubernetes manifests in deploy/kubernetes: Kubernetes' schemas, and plugserve's truth.

Every object is validated against Kubernetes' JSON schemas (kubernetes-validate, strict:
unknown fields refused) at the oldest and newest version this deployment supports; KServe's
objects against the schemas of tests/deploy/kserve.py. The rest checks the manifests against
the server itself: its routes, its defaults, its settings loader and its argument parser.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import tomllib
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate.utils as kv
import pytest
import yaml
from aiohttp.test_utils import TestClient

from plugserve.registry.fleet.etcd_store import EtcdLocation
from plugserve.server.config import (
    ADMIN_TOKEN_ENV,
    ADMIN_TOKEN_FILE_ENV,
    ETCD_PASSWORD_ENV,
    INFERENCE_TOKEN_ENV,
    INFERENCE_TOKEN_FILE_ENV,
    Settings,
)
from plugserve.server.runtime.shutdown import SHUTDOWN_MARGIN_S
from tests.deploy import kserve
from tests.deploy.files import (
    DOCKER,
    KUBERNETES,
    entrypoint,
    find,
    manifests,
    serve_settings,
    yaml_documents,
)
from tests.helpers import ROOT

OLDEST = "1.29.0"
"""The oldest Kubernetes the manifests are checked against (autoscaling/v2, policy/v1)."""
SECRET_ENV = {
    ADMIN_TOKEN_ENV,
    ADMIN_TOKEN_FILE_ENV,
    INFERENCE_TOKEN_ENV,
    INFERENCE_TOKEN_FILE_ENV,
    ETCD_PASSWORD_ENV,
}
"""The variables server/config.py reads a secret from."""
KSERVE_KINDS = set(kserve.SCHEMAS)
CORE = [(p, d) for p, d in manifests() if d["kind"] not in KSERVE_KINDS]
KSERVE = [(p, d) for p, d in manifests() if d["kind"] in KSERVE_KINDS]


def _id(item: tuple[Path, dict[str, Any]]) -> str:
    path, doc = item
    return f"{path.relative_to(KUBERNETES)}:{doc['kind']}/{doc['metadata']['name']}"


@pytest.mark.parametrize("version", [OLDEST, kv.latest_version()])
@pytest.mark.parametrize("item", CORE, ids=_id)
def test_manifest_fits_kubernetes_schema(item: tuple[Path, dict[str, Any]], version: str) -> None:
    kv.validate(item[1], version, strict=True)


@pytest.mark.parametrize("item", KSERVE, ids=_id)
def test_kserve_object_fits_kserves_schema(item: tuple[Path, dict[str, Any]]) -> None:
    kserve.validate(item[1])


def test_schemas_refuse_a_misspelt_field() -> None:
    """Both validations reject what a cluster would reject (so a pass means something)."""
    deployment = find("Deployment", "plugserve")
    deployment["spec"]["template"]["spec"]["terminationGracePeriod"] = 60
    with pytest.raises(kv.ValidationError):
        kv.validate(deployment, kv.latest_version(), strict=True)
    runtime = find("ServingRuntime")
    runtime["spec"]["supportedModelFormat"] = runtime["spec"].pop("supportedModelFormats")
    with pytest.raises(jsonschema.ValidationError):
        kserve.validate(runtime)
    runtime = find("ServingRuntime")
    runtime["spec"]["containers"][0]["ports"][0]["containerPort"] = "http"
    with pytest.raises(jsonschema.ValidationError):
        kserve.validate(runtime)


@pytest.mark.parametrize("folder", [KUBERNETES, KUBERNETES / "kserve"], ids=["base", "kserve"])
def test_kustomization_lists_its_manifests(folder: Path) -> None:
    kustomization = yaml.safe_load((folder / "kustomization.yaml").read_text())
    listed = set(kustomization["resources"])
    present = {p.name for p in folder.glob("*.yaml")} - {"kustomization.yaml"}
    # Not applied: the Secret is made by hand (random tokens); values are Helm's.
    apart = {"secret.example.yaml", "prometheus-adapter-values.yaml"}
    assert listed == present - apart


@pytest.mark.parametrize("folder", [KUBERNETES, KUBERNETES / "kserve"], ids=["base", "kserve"])
def test_kustomize_builds(folder: Path) -> None:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed: kustomize's own build is not run")
    done = subprocess.run(
        [kubectl, "kustomize", str(folder)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    built = {(d["kind"], d["metadata"]["name"]) for d in yaml.safe_load_all(done.stdout) if d}
    listed = yaml.safe_load((folder / "kustomization.yaml").read_text())["resources"]
    expected = {
        (d["kind"], d["metadata"]["name"]) for name in listed for d in yaml_documents(folder / name)
    }
    assert built == expected


# -- the Deployment against the server --


def _pod() -> dict[str, Any]:
    pod: dict[str, Any] = find("Deployment", "plugserve")["spec"]["template"]["spec"]
    return pod


def _container() -> dict[str, Any]:
    (container,) = _pod()["containers"]
    assert "command" not in container  # the image's entrypoint runs, args follow it
    return container


def _config_text() -> str:
    text: str = find("ConfigMap", "plugserve-config")["data"]["plugserve.toml"]
    return text


def _secret_values() -> dict[str, str]:
    (secret,) = yaml_documents(KUBERNETES / "secret.example.yaml")
    values: dict[str, str] = secret["stringData"]
    return values


def _environ(container: dict[str, Any]) -> dict[str, str]:
    """The container's environment as the kubelet makes it (the example Secret's values)."""
    environ = {}
    for var in container.get("env", []):
        source = var.get("valueFrom", {})
        if "secretKeyRef" in source:
            environ[var["name"]] = _secret_values()[source["secretKeyRef"]["key"]]
        elif "fieldRef" in source:
            environ[var["name"]] = "plugserve-7d9f8-abcde"
        else:
            environ[var["name"]] = var["value"]
    return environ


def _expand(args: list[str], environ: dict[str, str]) -> list[str]:
    """``$(VAR)`` in args, expanded as Kubernetes does (only variables the container has)."""
    for arg in args:
        for name in re.findall(r"\$\((\w+)\)", arg):
            assert name in environ, f"{arg} names {name}, which the container does not set"
    return [re.sub(r"\$\((\w+)\)", lambda m: environ[m.group(1)], a) for a in args]


def _deployment_settings(tmp_path: Path) -> Settings:
    container = _container()
    environ = _environ(container)
    argv = entrypoint(DOCKER / "Dockerfile")[:2] + _expand(container["args"], environ)
    config = "--config"
    mounted = argv[argv.index(config) + 1]
    assert mounted == "/etc/plugserve/plugserve.toml"
    argv[argv.index(config) + 1] = str(tmp_path / "plugserve.toml")
    image = entrypoint(DOCKER / "Dockerfile")
    return serve_settings(image[1:] + argv[2:], _config_text(), tmp_path, environ)


def test_container_command_is_one_plugserve_accepts(tmp_path: Path) -> None:
    """The image's entrypoint, then the Deployment's args, through plugserve's parser and
    loader, with the ConfigMap's plugserve.toml and the Secret's environment."""
    settings = _deployment_settings(tmp_path)
    values = _secret_values()
    assert settings.admin_token == values["admin-token"]
    assert settings.inference_token == values["inference-token"]
    assert settings.replica_id == "plugserve-7d9f8-abcde"
    assert settings.host == "0.0.0.0"
    assert settings.worker_count == 2


def test_config_map_names_the_config_file_the_args_give(tmp_path: Path) -> None:
    container = _container()
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in _pod()["volumes"]}
    config = container["args"][container["args"].index("--config") + 1]
    (name,) = (n for n, path in mounts.items() if config.startswith(path + "/"))
    assert volumes[name]["configMap"]["name"] == "plugserve-config"
    assert Path(config).name in find("ConfigMap", "plugserve-config")["data"]


def test_secret_variables_are_the_ones_the_server_reads() -> None:
    secret_vars = {
        v["name"]: v["valueFrom"]["secretKeyRef"]
        for v in _container()["env"]
        if "secretKeyRef" in v.get("valueFrom", {})
    }
    assert {ADMIN_TOKEN_ENV, INFERENCE_TOKEN_ENV} <= set(secret_vars)
    assert set(secret_vars) <= SECRET_ENV
    (secret,) = yaml_documents(KUBERNETES / "secret.example.yaml")
    for ref in secret_vars.values():
        assert ref["name"] == secret["metadata"]["name"]
        assert ref["key"] in secret["stringData"]


def _probe_ports(container: dict[str, Any]) -> dict[str, int]:
    named = {p.get("name"): p["containerPort"] for p in container["ports"]}
    found = {}
    for probe in ("livenessProbe", "readinessProbe"):
        port = container[probe]["httpGet"]["port"]
        found[container[probe]["httpGet"]["path"]] = named[port] if isinstance(port, str) else port
    return found


async def test_probes_reach_the_servers_health_routes(client: object, tmp_path: Path) -> None:
    """The probes' paths answer 200 on a real app, on the port the settings give."""
    settings = _deployment_settings(tmp_path)
    probes = _probe_ports(_container())
    assert probes == {"/v2/health/live": settings.port, "/v2/health/ready": settings.port}
    runtime = find("ServingRuntime")["spec"]["containers"][0]
    assert set(_probe_ports(runtime)) == set(probes)
    app: TestClient = await client()  # type: ignore[operator]
    for path in probes:
        response = await app.get(path)
        assert response.status == 200, path
    assert (await app.get("/v2/health/nothing")).status == 404  # the check can fail


def test_service_ports_are_the_servers(tmp_path: Path) -> None:
    settings = _deployment_settings(tmp_path)
    named = {p["name"]: p["containerPort"] for p in _container()["ports"]}
    assert named == {"http": settings.port, "grpc": settings.grpc_port}
    service = find("Service", "plugserve")
    selector = service["spec"]["selector"]
    labels = find("Deployment", "plugserve")["spec"]["template"]["metadata"]["labels"]
    assert selector.items() <= labels.items()
    ports = {p["name"]: named[p["targetPort"]] for p in service["spec"]["ports"]}
    assert ports == {"http": settings.port, "grpc": settings.grpc_port}
    # The control plane stays on each pod's loopback, out of the Service.
    assert settings.admin_port not in ports.values()
    assert settings.admin_host == "127.0.0.1"


def test_grace_period_covers_prestop_and_drain(tmp_path: Path) -> None:
    """Kubernetes' grace runs from preStop: it must outlast preStop, the drain and its bound."""
    settings = _deployment_settings(tmp_path)
    command = _container()["lifecycle"]["preStop"]["exec"]["command"]
    assert command[0] == "sleep"
    pre_stop = float(command[1])
    assert pre_stop >= 5  # long enough for the endpoints to drop the pod
    grace = _pod()["terminationGracePeriodSeconds"]
    assert grace > pre_stop + settings.drain_timeout_s + SHUTDOWN_MARGIN_S
    predictor = find("InferenceService")["spec"]["predictor"]
    assert predictor["terminationGracePeriodSeconds"] > (
        Settings().drain_timeout_s + SHUTDOWN_MARGIN_S
    )


def test_pod_runs_as_the_images_user_on_a_read_only_root() -> None:
    pod = _pod()
    image_user = next(
        line.split()[1]
        for line in reversed((DOCKER / "Dockerfile").read_text().splitlines())
        if line.startswith("USER ")
    )
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert str(pod["securityContext"]["runAsUser"]) == image_user.split(":")[0]
    security = _container()["securityContext"]
    assert security["readOnlyRootFilesystem"] is True
    assert security["allowPrivilegeEscalation"] is False
    mounts = {m["mountPath"]: m for m in _container()["volumeMounts"]}
    tmp = {v["name"]: v for v in _pod()["volumes"]}[mounts["/tmp"]["name"]]
    assert "emptyDir" in tmp  # the supervisor's sockets (/tmp/plugserve-*)


def test_plugins_and_models_come_from_the_shared_volume(tmp_path: Path) -> None:
    settings = _deployment_settings(tmp_path)
    mounts = {m["mountPath"]: m for m in _container()["volumeMounts"]}
    volumes = {v["name"]: v for v in _pod()["volumes"]}
    for folder in (settings.plugins_dir, settings.models_dir):
        (mount,) = (m for path, m in mounts.items() if folder.is_relative_to(path))
        assert mount["readOnly"] is True  # whoever deploys writes it, never the server
        claim = volumes[mount["name"]]["persistentVolumeClaim"]["claimName"]
        pvc = find("PersistentVolumeClaim", claim)
        assert pvc["spec"]["accessModes"] == ["ReadWriteMany"]  # every replica, and deployers
    # A network volume's changes come from other hosts: inotify cannot see them.
    assert _environ(_container())["WATCHFILES_FORCE_POLLING"] == "true"


def test_fleet_registry_points_at_the_etcd_service(tmp_path: Path) -> None:
    settings = _deployment_settings(tmp_path)
    location = EtcdLocation.parse(settings.registry)
    etcd = find("Service", "plugserve-etcd")
    client_port = next(p["port"] for p in etcd["spec"]["ports"] if p["name"] == "client")
    assert location.endpoints == (f"http://{etcd['metadata']['name']}:{client_port}",)
    statefulset = find("StatefulSet", "plugserve-etcd")
    assert statefulset["spec"]["serviceName"] == etcd["metadata"]["name"]
    labels = statefulset["spec"]["template"]["metadata"]["labels"]
    assert etcd["spec"]["selector"].items() <= labels.items()
    # The one member's name and URLs are its pod's stable DNS name: <set>-0.<service>.
    member = f"{statefulset['metadata']['name']}-0"
    flags = dict(
        arg.removeprefix("--").split("=", 1)
        for arg in statefulset["spec"]["template"]["spec"]["containers"][0]["command"][1:]
    )
    dns = f"{member}.{etcd['metadata']['name']}"
    assert flags["name"] == member
    assert flags["advertise-client-urls"] == f"http://{dns}:{client_port}"
    assert flags["initial-cluster"] == f"{member}={flags['initial-advertise-peer-urls']}"
    assert flags["initial-advertise-peer-urls"].startswith(f"http://{dns}:")


def test_disruption_budget_and_autoscaler_fit_the_deployment() -> None:
    deployment = find("Deployment", "plugserve")
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    pdb = find("PodDisruptionBudget", "plugserve")
    assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()
    hpa = find("HorizontalPodAutoscaler", "plugserve")
    target = hpa["spec"]["scaleTargetRef"]
    assert (target["kind"], target["name"]) == ("Deployment", deployment["metadata"]["name"])
    # A node drain can always evict one pod: more replicas than the budget keeps.
    assert hpa["spec"]["minReplicas"] > pdb["spec"]["minAvailable"]
    assert deployment["spec"]["replicas"] > pdb["spec"]["minAvailable"]


def _copy_iris(root: Path) -> tuple[Path, Path]:
    plugins, models = root / "plugins", root / "models"
    for part in ("runner/iris/1.0.0", "preprocessor/scale/1.0.0", "postprocessor/label/1.0.0"):
        shutil.copytree(ROOT / "plugins" / part, plugins / part)
    shutil.copytree(ROOT / "models" / "iris", models / "iris")
    return plugins, models


async def test_autoscaler_metric_is_one_the_server_exports(client: object, tmp_path: Path) -> None:
    """The HPA's metric is the adapter rule's name for a series /metrics really has."""
    values = yaml.safe_load((KUBERNETES / "prometheus-adapter-values.yaml").read_text())
    (rule,) = values["rules"]["custom"]
    hpa = find("HorizontalPodAutoscaler", "plugserve")
    (metric,) = hpa["spec"]["metrics"]
    assert metric["type"] == "Pods"
    assert metric["pods"]["metric"]["name"] == rule["name"]["as"]
    series = re.match(r"(\w+)\{(.*)\}$", rule["seriesQuery"].strip())
    assert series, rule["seriesQuery"]
    name, matchers = series.groups()
    assert re.fullmatch(rule["name"]["matches"], name)
    wanted = dict(re.findall(r'(\w+)="([^"]*)"', matchers))  # label="value" matchers
    assert {"namespace", "pod"} <= set(re.findall(r"(\w+)!=", matchers))
    plugins_dir, models_dir = _copy_iris(tmp_path)
    app: TestClient = await client(plugins_dir=plugins_dir, models_dir=models_dir)  # type: ignore[operator]
    text = await (await app.get("/metrics")).text()
    samples = [
        dict(re.findall(r'(\w+)="([^"]*)"', labels))
        for labels in re.findall(rf"^{name}\{{(.*)\}} ", text, re.MULTILINE)
    ]
    assert any(wanted.items() <= s.items() for s in samples), text


# -- KServe --


def test_kserve_runtime_serves_the_inference_service(tmp_path: Path) -> None:
    """KServe would place the InferenceService on plugserve's runtime, which plugserve runs."""
    runtime = find("ServingRuntime")
    service = find("InferenceService")
    model = service["spec"]["predictor"]["model"]
    assert model["runtime"] == runtime["metadata"]["name"]
    formats = {f["name"] for f in runtime["spec"]["supportedModelFormats"]}
    assert model["modelFormat"]["name"] in formats == {"onnx"}
    assert model["protocolVersion"] in runtime["spec"]["protocolVersions"]
    (container,) = runtime["spec"]["containers"]
    assert container["name"] == "kserve-container"  # the name KServe looks for
    assert container["command"] == entrypoint(DOCKER / "Dockerfile")[:2]
    settings = serve_settings(container["command"][1:] + container["args"], None, tmp_path)
    (port,) = container["ports"]
    assert port["containerPort"] == settings.port
    assert settings.grpc_port == 0  # one port per pod (serverless): HTTP only
    assert "grpc-v2" not in runtime["spec"]["protocolVersions"]
    # KServe's storage initializer downloads the storageUri to /mnt/models.
    assert settings.plugins_dir.is_relative_to("/mnt/models")
    assert settings.models_dir.is_relative_to("/mnt/models")
    annotations = runtime["spec"]["annotations"]
    assert annotations["prometheus.kserve.io/port"] == str(settings.port)
    assert annotations["prometheus.kserve.io/path"] == "/metrics"


def test_config_map_toml_is_plain_toml() -> None:
    """The ConfigMap's plugserve.toml holds only settings the server knows."""
    keys = set(tomllib.loads(_config_text()))
    assert keys <= set(Settings.model_fields)
    assert "drain_timeout_s" in keys  # the grace period check above reads it from here
