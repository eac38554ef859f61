"""The Kubernetes manifests of deploy/kubernetes, checked offline.

Every document of every YAML file there validates: Kubernetes' built-in kinds strictly (an unknown
field is an error) against the schemas kubernetes-validate bundles, the KubeRay RayService against
deploy/kubernetes/schemas/rayservice-v1.json with its pod templates validated as Kubernetes
PodTemplateSpecs. Beyond the schemas: the verifier's container runs flags the real `cloud-verifier
serve` parser takes (a renamed flag fails here, not at the pod's start), its probes ask /readyz and
/healthz on its named port, the CLOUD_VERIFIER_* variables name ServerConfig fields, the fleet's
serveConfigV2 names its import path and arguments, and the GPU manifests ask for a GPU. Broken
manifests are refused, so the validation can fail.
"""

from __future__ import annotations

import argparse
import copy
import json
import re
from collections.abc import Callable, Iterator
from dataclasses import fields
from functools import cache
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from cloud_verifier.cli import build_parser
from cloud_verifier.fleet.config import FleetArgs
from cloud_verifier.server_config import WEIGHTS, ServerConfig, field_type
from shared.config_cli import config_values

ROOT = Path(__file__).resolve().parents[2]
MANIFESTS = ROOT / "deploy" / "kubernetes"
RAYSERVICE_SCHEMA = MANIFESTS / "schemas" / "rayservice-v1.json"
# a recent release among those kubernetes-validate bundles
KUBERNETES_VERSION = "1.33.0"
FLEET_IMPORT_PATH = "cloud_verifier.fleet.app:build_app"
FLEET_ARGS = {"model", "weights", "replicas_min", "replicas_max", "max_sessions_per_replica", "direct"}
VERIFIER_FILES = ("verifier.yaml", "verifier-gpu.yaml")
GPU = "nvidia.com/gpu"

Doc = dict[str, Any]


def manifest_files() -> list[Path]:
    return sorted(MANIFESTS.rglob("*.yaml")) + sorted(MANIFESTS.rglob("*.yml"))


def documents(path: Path) -> list[Doc]:
    with path.open(encoding="utf-8") as f:
        return [doc for doc in yaml.safe_load_all(f) if doc is not None]


@cache
def rayservice_validator() -> jsonschema.Draft202012Validator:
    schema = json.loads(RAYSERVICE_SCHEMA.read_text(encoding="utf-8"))
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


def ray_pod_templates(doc: Doc) -> Iterator[tuple[str, Doc]]:
    """(where, template) of a RayService's head group and each worker group."""
    cluster = doc["spec"]["rayClusterConfig"]
    yield "headGroupSpec", cluster["headGroupSpec"]["template"]
    for group in cluster.get("workerGroupSpecs", []):
        yield f"workerGroupSpecs[{group['groupName']}]", group["template"]


def validate(doc: Doc) -> None:
    """Raise if `doc` is not a valid resource (jsonschema.ValidationError or kubernetes-validate's)."""
    if doc.get("apiVersion") == "ray.io/v1" and doc.get("kind") == "RayService":
        rayservice_validator().validate(doc)
        for where, template in ray_pod_templates(doc):
            pod_template = {
                "apiVersion": "v1",
                "kind": "PodTemplate",
                "metadata": {"name": f"{doc['metadata']['name']}-{where}".lower()[:63]},
                "template": template,
            }
            try:
                kubernetes_validate.validate(pod_template, KUBERNETES_VERSION, strict=True)
            except kubernetes_validate.ValidationError as exc:
                raise AssertionError(f"RayService {where}.template: {exc.message}") from exc
        return
    kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


def the(docs: list[Doc], kind: str) -> Doc:
    found = [d for d in docs if d["kind"] == kind]
    assert len(found) == 1, f"expected one {kind}, found {len(found)}"
    return found[0]


def verifier_container(name: str) -> Doc:
    deployment = the(documents(MANIFESTS / name), "Deployment")
    containers = deployment["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1
    result: Doc = containers[0]
    return result


def rayservice() -> Doc:
    return the(documents(MANIFESTS / "rayservice.yaml"), "RayService")


def all_containers() -> Iterator[tuple[str, Doc]]:
    for path in manifest_files():
        for doc in documents(path):
            if doc["kind"] == "Deployment":
                for c in doc["spec"]["template"]["spec"]["containers"]:
                    yield f"{path.name}:{c['name']}", c
            elif doc["kind"] == "RayService":
                for where, template in ray_pod_templates(doc):
                    for c in template["spec"]["containers"]:
                        yield f"{path.name}:{where}:{c['name']}", c


def serve_args(container: Doc) -> list[str]:
    """The `cloud-verifier` arguments of a container of the image (its entry point is cloud-verifier)."""
    command = container.get("command")
    args = [str(a) for a in container.get("args", [])]
    if command is not None:
        assert command[0] == "cloud-verifier", command
        args = [str(a) for a in command[1:]] + args
    return args


def serve_flags(parser: argparse.ArgumentParser) -> set[str]:
    """The option strings of the parser's `serve` command."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return set(action.choices["serve"]._option_string_actions)
    raise AssertionError("cloud-verifier has no serve command")


def parse_serve(args: list[str]) -> ServerConfig:
    """The ServerConfig `args` give, by the real parser; a flag it does not know fails the test, and
    so does an abbreviation of one (argparse would take it)."""
    parser = build_parser()
    try:
        parsed = parser.parse_args(args)
    except SystemExit as exc:  # argparse printed what is wrong to stderr
        raise AssertionError(f"cloud-verifier does not take {args}") from exc
    assert parsed.command == "serve"
    known = serve_flags(parser)
    for arg in args:
        flag = arg.split("=", 1)[0]
        if flag.startswith("--"):
            assert flag in known, f"cloud-verifier serve does not take {flag} (its flags: {sorted(known)})"
    return ServerConfig(**config_values(ServerConfig, parsed))


CASES = [(path, i) for path in manifest_files() for i in range(len(documents(path)))]


def test_manifests_are_there() -> None:
    names = {p.name for p in manifest_files()}
    assert {"verifier.yaml", "verifier-gpu.yaml", "rayservice.yaml"} <= names


@pytest.mark.parametrize(("path", "index"), CASES, ids=[f"{p.name}#{i}" for p, i in CASES])
def test_document_validates(path: Path, index: int) -> None:
    doc = documents(path)[index]
    try:
        validate(doc)
    except (jsonschema.ValidationError, kubernetes_validate.ValidationError) as exc:
        pytest.fail(f"{path.relative_to(ROOT)} #{index} ({doc.get('kind')}): {exc.message}")


@pytest.mark.parametrize("name", VERIFIER_FILES)
def test_verifier_flags_are_real_serve_flags(name: str) -> None:
    container = verifier_container(name)
    config = parse_serve(serve_args(container))
    assert config.host == "0.0.0.0"
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports["http"] == config.port
    assert config.api_key_file is not None, "the verifier in the cluster must ask for keys"
    mounts = {m["mountPath"] for m in container["volumeMounts"]}
    assert str(Path(config.api_key_file).parent) in mounts


@pytest.mark.parametrize("name", VERIFIER_FILES)
def test_verifier_probes(name: str) -> None:
    container = verifier_container(name)
    port_names = {p["name"] for p in container["ports"]}
    expected = {"readinessProbe": "/readyz", "livenessProbe": "/healthz", "startupProbe": "/readyz"}
    for probe, path in expected.items():
        http = container[probe]["httpGet"]
        assert http["path"] == path, f"{probe} asks {http['path']}"
        assert http["port"] == "http" and "http" in port_names, f"{probe} not on the named port"
    startup = container["startupProbe"]
    # the first start fetches the model: at least the image's HEALTHCHECK start period (600 s)
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 600


@pytest.mark.parametrize("name", VERIFIER_FILES)
def test_verifier_pod_settings(name: str) -> None:
    docs = documents(MANIFESTS / name)
    deployment, service = the(docs, "Deployment"), the(docs, "Service")
    pod = deployment["spec"]["template"]
    container = verifier_container(name)
    assert {"cpu", "memory"} <= set(container["resources"]["requests"])
    assert {"cpu", "memory"} <= set(container["resources"]["limits"])
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert pod["spec"]["securityContext"]["runAsNonRoot"] is True
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    assert "emptyDir" in volumes[mounts["/tmp"]]
    claim = volumes[mounts["/cache"]]["persistentVolumeClaim"]["claimName"]
    assert claim == the(docs, "PersistentVolumeClaim")["metadata"]["name"]
    assert pod["metadata"]["annotations"]["prometheus.io/path"] == "/metrics"
    http_port = {p["name"]: p["containerPort"] for p in container["ports"]}["http"]
    assert pod["metadata"]["annotations"]["prometheus.io/port"] == str(http_port)
    assert service["spec"]["type"] == "ClusterIP"
    assert {p["name"] for p in service["spec"]["ports"]} == {"http", "metrics"}
    assert all(p["targetPort"] == "http" for p in service["spec"]["ports"])
    labels = pod["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()
    assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()


def test_environment_variables_are_server_config_fields() -> None:
    names = {f"CLOUD_VERIFIER_{f.name.upper()}": f.name for f in fields(ServerConfig)}
    seen = 0
    for where, container in all_containers():
        for env in container.get("env", []):
            if env["name"].startswith("CLOUD_VERIFIER_"):
                assert env["name"] in names, f"{where}: {env['name']} is no ServerConfig field"
                field_type(names[env["name"]])(env["value"])  # the value its rule reads
                seen += 1
    assert seen > 0


def test_serve_config_names_the_fleet_app() -> None:
    spec = rayservice()["spec"]
    assert isinstance(spec["serveConfigV2"], str)
    serve = yaml.safe_load(spec["serveConfigV2"])
    (app,) = serve["applications"]
    assert app["import_path"] == FLEET_IMPORT_PATH
    args = app["args"]
    assert set(args) == FLEET_ARGS
    field_type("model")(args["model"])
    assert args["weights"] in WEIGHTS
    assert 1 <= args["replicas_min"] <= args["replicas_max"]
    assert args["max_sessions_per_replica"] >= 1
    assert args["direct"] is False  # clients outside the cluster reach only Serve's proxy
    FleetArgs.from_dict(args)  # the arguments build_app takes
    (deployment,) = app["deployments"]
    scaling = deployment["autoscaling_config"]
    assert (scaling["min_replicas"], scaling["max_replicas"]) == (args["replicas_min"], args["replicas_max"])
    assert 0 < scaling["target_ongoing_requests"] <= args["max_sessions_per_replica"]
    # Serve's cap: the sessions and more (FleetArgs.serve_cap, checked in tests/fleet)
    assert deployment["max_ongoing_requests"] > args["max_sessions_per_replica"]


def test_rayservice_groups() -> None:
    cluster = rayservice()["spec"]["rayClusterConfig"]
    head = cluster["headGroupSpec"]
    assert head["rayStartParams"]["metrics-export-port"] == "8080"
    groups = {g["groupName"]: g for g in cluster["workerGroupSpecs"]}
    assert len(groups) == len(cluster["workerGroupSpecs"]) >= 2
    for name, group in groups.items():
        assert group["minReplicas"] <= group["replicas"] <= group["maxReplicas"], name
    for where, container in all_containers():
        if not where.startswith("rayservice.yaml"):
            continue
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert ports.get("metrics") == 8080, where
        assert {"cpu", "memory"} <= set(container["resources"]["requests"]), where
        for probe in ("readinessProbe", "livenessProbe"):
            port = container[probe]["httpGet"]["port"]
            assert port in ports, f"{where}: {probe} on {port}, not a named port"


def test_gpu_manifests_request_a_gpu() -> None:
    container = verifier_container("verifier-gpu.yaml")
    assert container["resources"]["limits"][GPU] == 1
    assert parse_serve(serve_args(container)).device.startswith("cuda")
    cpu = verifier_container("verifier.yaml")
    assert GPU not in cpu["resources"]["limits"]
    gpu_groups = [
        g
        for g in rayservice()["spec"]["rayClusterConfig"]["workerGroupSpecs"]
        if any(GPU in c["resources"]["limits"] for c in g["template"]["spec"]["containers"])
    ]
    assert gpu_groups, "no worker group asks for nvidia.com/gpu"
    for group in gpu_groups:
        for c in group["template"]["spec"]["containers"]:
            assert c["resources"]["requests"][GPU] == c["resources"]["limits"][GPU]


def test_renamed_flag_is_refused() -> None:
    args = serve_args(verifier_container("verifier.yaml"))
    with pytest.raises(AssertionError, match="does not take"):
        parse_serve([a.replace("--kv-blocks", "--kv-pool-blocks") for a in args])
    with pytest.raises(AssertionError, match="does not take --kv-block "):
        parse_serve([a.replace("--kv-blocks", "--kv-block") for a in args])


def _deployment_probe_typo(docs: list[Doc]) -> Doc:
    doc = the(docs, "Deployment")
    probe = doc["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]
    probe["httpGett"] = probe.pop("httpGet")
    return doc


def _deployment_string_replicas(docs: list[Doc]) -> Doc:
    doc = the(docs, "Deployment")
    doc["spec"]["replicas"] = "one"
    return doc


def _service_unknown_field(docs: list[Doc]) -> Doc:
    doc = the(docs, "Service")
    doc["spec"]["ports"][0]["targetPorts"] = "http"
    return doc


def _rayservice_without_cluster(docs: list[Doc]) -> Doc:
    doc = the(docs, "RayService")
    del doc["spec"]["rayClusterConfig"]
    return doc


def _rayservice_unknown_field(docs: list[Doc]) -> Doc:
    doc = the(docs, "RayService")
    doc["spec"]["rayClusterConfig"]["headGroupSpec"]["rayStartParam"] = {}
    return doc


def _rayservice_number_start_param(docs: list[Doc]) -> Doc:
    doc = the(docs, "RayService")
    doc["spec"]["rayClusterConfig"]["headGroupSpec"]["rayStartParams"]["num-cpus"] = 0
    return doc


def _rayservice_worker_without_max(docs: list[Doc]) -> Doc:
    doc = the(docs, "RayService")
    del doc["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["maxReplicas"]
    return doc


def _rayservice_serve_config_as_mapping(docs: list[Doc]) -> Doc:
    doc = the(docs, "RayService")
    doc["spec"]["serveConfigV2"] = yaml.safe_load(doc["spec"]["serveConfigV2"])
    return doc


def _rayservice_pod_template_typo(docs: list[Doc]) -> Doc:
    doc = the(docs, "RayService")
    container = doc["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]
    container["livenessProbe"]["httpGet"]["paths"] = container["livenessProbe"]["httpGet"].pop("path")
    return doc


# what is broken: (file, how, a piece of the error message)
BROKEN: dict[str, tuple[str, Callable[[list[Doc]], Doc], str]] = {
    "probe with a misspelt field": ("verifier.yaml", _deployment_probe_typo, "'httpGett' was unexpected"),
    "replicas as a string": ("verifier.yaml", _deployment_string_replicas, "'one' is not of type"),
    "service port with an unknown field": ("verifier-gpu.yaml", _service_unknown_field, "'targetPorts'"),
    "rayservice without rayClusterConfig": (
        "rayservice.yaml",
        _rayservice_without_cluster,
        "'rayClusterConfig' is a required",
    ),
    "rayservice head with an unknown field": (
        "rayservice.yaml",
        _rayservice_unknown_field,
        "'rayStartParam' was unexpected",
    ),
    "rayStartParams value not a string": (
        "rayservice.yaml",
        _rayservice_number_start_param,
        "0 is not of type 'string'",
    ),
    "worker group without maxReplicas": (
        "rayservice.yaml",
        _rayservice_worker_without_max,
        "'maxReplicas' is a required",
    ),
    "serveConfigV2 not a string": (
        "rayservice.yaml",
        _rayservice_serve_config_as_mapping,
        "is not of type 'string'",
    ),
    "worker pod template with a misspelt field": (
        "rayservice.yaml",
        _rayservice_pod_template_typo,
        "workerGroupSpecs[cpu-workers].template: Additional properties are not allowed ('paths'",
    ),
}


@pytest.mark.parametrize("case", list(BROKEN))
def test_broken_manifest_is_refused(case: str) -> None:
    name, breaks, message = BROKEN[case]
    broken = breaks(copy.deepcopy(documents(MANIFESTS / name)))
    validate(the(documents(MANIFESTS / name), broken["kind"]))  # the document as it is passes
    errors = (jsonschema.ValidationError, kubernetes_validate.ValidationError, AssertionError)
    with pytest.raises(errors, match=re.escape(message)):
        validate(broken)
