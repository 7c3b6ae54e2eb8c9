"""k8s/: every overlay renders with kubectl's kustomize, every object is valid for the API that
receives it, and the runtime agrees with triton_models/, the ports and cubeserve.deploy."""

from __future__ import annotations

import copy
import json
import re
import shlex
from urllib.parse import urlparse

import kubernetes_validate
import pytest
import yaml

from cubeserve import deploy
from cubeserve.rollout import VersionRegistry
from k8s_validation import (KSERVE_CRDS, KUBERNETES_VERSION, OVERLAYS, REPO, crd_errors, dockerfile_instructions, find,
                            load_crd_schemas, render, validate)

GPU = "nvidia.com/gpu"
# Fields of predictor.model that KServe consumes itself; the rest is the container.
KSERVE_MODEL_FIELDS = {"modelFormat", "runtime", "runtimeVersion", "protocolVersion", "storageUri", "storage"}


def isvcs(objects):
    return [o for o in objects if o["kind"] == "InferenceService"]


def runtime_container(objects):
    runtime = find(objects, "ServingRuntime", "cube-serve-triton")
    [container] = [c for c in runtime["spec"]["containers"] if c["name"] == "kserve-container"]
    return container


def registry(objects) -> VersionRegistry:
    return VersionRegistry.from_configmap(find(objects, "ConfigMap", "cube3d-versions"))


def raw_with_canary() -> dict:
    """The raw overlay's InferenceService with the canary `cubeserve rollout canary` adds."""
    from cubeserve.rollout import merge_patch, plans

    isvc = find(render("raw"), "InferenceService")
    return merge_patch(isvc, plans.Raw().start(isvc, "2", "s3://replace-me-model-bucket/cube3d/2/", 10))


def kserve_pod(isvc: dict, runtime: dict) -> dict:
    """The predictor pod KServe builds: the runtime's container overridden by predictor.model
    (args appended, env merged by name), the predictor's volumes. Storage initializer left out."""
    [container] = [copy.deepcopy(c) for c in runtime["spec"]["containers"] if c["name"] == "kserve-container"]
    predictor = isvc["spec"]["predictor"]
    for key, value in predictor["model"].items():
        if key in KSERVE_MODEL_FIELDS:
            continue
        if key == "args":
            container["args"] = container.get("args", []) + value
        elif key == "env":
            names = {e["name"] for e in value}
            container["env"] = [e for e in container.get("env", []) if e["name"] not in names] + value
        else:
            container[key] = copy.deepcopy(value)
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": f"{isvc['metadata']['name']}-predictor"},
            "spec": {"containers": [container],
                     "volumes": copy.deepcopy(predictor.get("volumes", []) + runtime["spec"].get("volumes", []))}}


@pytest.fixture(scope="module", params=OVERLAYS)
def overlay(request):
    return request.param, render(request.param)


# -- rendering and schemas --------------------------------------------------------------------------

def test_every_overlay_renders_to_valid_objects(overlay):
    name, objects = overlay
    kinds = sorted(o["kind"] for o in objects)
    expected = {"canary": ["ConfigMap", "InferenceService", "ServingRuntime"],
                "raw": ["ConfigMap", "InferenceService", "ServingRuntime"],
                "cpu": ["ConfigMap", "InferenceService", "ServingRuntime"],
                "ab": ["ConfigMap", "InferenceGraph", "InferenceService", "InferenceService", "ServingRuntime"]}
    assert kinds == expected[name]
    for obj in objects:
        assert validate(obj) == [], f"{name}: {obj['kind']} {obj['metadata']['name']}"
        assert obj["metadata"]["labels"]["app.kubernetes.io/part-of"] == "cube-serve"


@pytest.mark.skipif(not KSERVE_CRDS.is_dir(), reason="KServe CRDs not beside the repository (../shared/kserve-crds)")
def test_every_overlay_matches_the_kserve_crds():
    schemas = load_crd_schemas(KSERVE_CRDS)
    for name in OVERLAYS:
        for obj in render(name):
            assert crd_errors(obj, schemas) == [], f"{name}: {obj['kind']} {obj['metadata']['name']}"


def test_the_kserve_package_knows_the_raw_deployment_canary():
    # spec.canary[] (RawDeployment canaries) is recent; the validator relies on the package's
    # models to check it, so the package in use must have them.
    from k8s_validation import kserve_models as models

    assert models.V1beta1InferenceServiceSpec.attribute_map["canary"] == "canary"
    assert set(models.V1beta1CanarySpec.attribute_map.values()) == {"predictor", "trafficPercent"}


@pytest.mark.parametrize("where, mutate", [
    ("isvc storageUri", lambda o: o["spec"]["predictor"]["model"].update(storageURI=o["spec"]["predictor"]["model"].pop("storageUri"))),
    ("isvc probe", lambda o: o["spec"]["predictor"]["model"]["readinessProbe"]["httpGet"].update(paht="/v2")),
    ("isvc canary", lambda o: o["spec"]["predictor"].update(canaryTraficPercent=10)),
    ("isvc volume", lambda o: o["spec"]["predictor"]["volumes"][0]["emptyDir"].update(medium_="Memory")),
    ("isvc type", lambda o: o["spec"]["predictor"].update(minReplicas="1")),
    ("isvc required", lambda o: o["spec"]["predictor"]["model"].pop("modelFormat")),
    ("isvc webhook", lambda o: o["spec"]["predictor"]["model"].update(name="kserve-container")),
])
def test_the_validator_rejects_misspelled_and_invalid_fields(where, mutate):
    obj = find(render("canary"), "InferenceService")
    assert validate(obj) == []
    mutate(obj)
    assert validate(obj), f"{where}: not rejected"


def test_the_validator_rejects_bad_runtimes_graphs_and_core_objects():
    objects = render("ab")
    runtime = find(objects, "ServingRuntime")
    runtime["spec"]["containers"][0]["ports"][0]["containerPort"] = "8000"
    assert any("containerPort" in e for e in validate(runtime))
    runtime = find(objects, "ServingRuntime")
    runtime["spec"]["supportedModelFormat"] = runtime["spec"].pop("supportedModelFormats")
    assert any("did you mean 'supportedModelFormats'" in e for e in validate(runtime))
    graph = find(objects, "InferenceGraph")
    graph["spec"]["nodes"]["root"]["steps"][0]["wieght"] = 5
    assert validate(graph)
    graph = find(objects, "InferenceGraph")
    graph["spec"]["nodes"]["root"]["steps"][0]["weight"] = 70  # 70 + 20
    assert any("add up to 90" in e for e in validate(graph))
    configmap = find(objects, "ConfigMap")
    configmap["dat"] = configmap.pop("data")
    assert validate(configmap)
    isvc = raw_with_canary()
    isvc["spec"]["canary"][0]["predictor"]["model"].pop("name")
    assert any("model.name is required" in e for e in validate(isvc))


@pytest.mark.skipif(not KSERVE_CRDS.is_dir(), reason="KServe CRDs not beside the repository (../shared/kserve-crds)")
def test_the_strict_crd_schemas_reject_misspelled_fields():
    schemas = load_crd_schemas(KSERVE_CRDS)
    isvc = raw_with_canary()
    isvc["spec"]["canary"][0]["trafficPercnt"] = 10
    isvc["spec"]["canary"][0]["predictor"]["model"].pop("name")
    errors = crd_errors(isvc, schemas)
    assert any("trafficPercnt" in e for e in errors) and any("'name' is a required property" in e for e in errors)


def test_the_pod_kserve_builds_is_a_valid_secure_pod(overlay):
    name, objects = overlay
    runtime = find(objects, "ServingRuntime")
    for isvc in isvcs(objects):
        pod = kserve_pod(isvc, runtime)
        kubernetes_validate.validate(pod, KUBERNETES_VERSION, strict=True)
        [container] = pod["spec"]["containers"]
        volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
        assert {m["name"] for m in container["volumeMounts"]} <= set(volumes)
        shm = [m for m in container["volumeMounts"] if m["mountPath"] == "/dev/shm"]
        assert shm and volumes[shm[0]["name"]]["emptyDir"]["medium"] == "Memory"
        security = container["securityContext"]
        assert security["runAsNonRoot"] is True and security["runAsUser"] == deploy.IMAGE_UID != 0
        assert security["allowPrivilegeEscalation"] is False and security["capabilities"]["drop"] == ["ALL"]
        resources = container["resources"]
        assert {"cpu", "memory"} <= set(resources["requests"]) and {"cpu", "memory"} <= set(resources["limits"])
        startup = container["startupProbe"]
        budget = startup["periodSeconds"] * startup["failureThreshold"]
        if name == "cpu":  # the tiny model, no GPU anywhere
            assert GPU not in json.dumps(isvc)
            assert budget >= 60
        else:  # one whole GPU, and minutes for the weights and the CUDA graphs
            assert resources["requests"][GPU] == resources["limits"][GPU] == "1"
            assert budget >= 600


# -- one source of truth: cubeserve.deploy ------------------------------------------------------------

def test_runtime_args_are_the_deploy_modules(overlay):
    name, objects = overlay
    store = deploy.IMAGE_MODEL_REPOSITORY if name == "cpu" else deploy.KSERVE_MODEL_DIR
    container = runtime_container(objects)
    assert container["args"] == deploy.server_command(store)
    assert "command" not in container  # the image's entrypoint runs the args
    # No argument added by an InferenceService (KServe would append it to these).
    assert all("args" not in isvc["spec"]["predictor"]["model"] for isvc in isvcs(objects))


def test_ports_probes_and_metrics_are_the_deploy_modules(overlay):
    _, objects = overlay
    container = runtime_container(objects)
    assert [p["containerPort"] for p in container["ports"]] == [deploy.HTTP_PORT]
    args = container["args"]
    assert f"--http-port={deploy.HTTP_PORT}" in args and f"--grpc-port={deploy.GRPC_PORT}" in args
    assert f"--metrics-port={deploy.METRICS_PORT}" in args
    runtime = find(objects, "ServingRuntime")
    assert runtime["spec"]["annotations"]["prometheus.kserve.io/port"] == str(deploy.METRICS_PORT)
    assert runtime["spec"]["annotations"]["prometheus.kserve.io/path"] == deploy.METRICS_PATH
    for isvc in isvcs(objects):
        annotations = isvc["metadata"]["annotations"]
        assert annotations["prometheus.io/scrape"] == "true"
        assert annotations["prometheus.io/port"] == str(deploy.METRICS_PORT)
        assert annotations["prometheus.io/path"] == deploy.METRICS_PATH
        model = isvc["spec"]["predictor"]["model"]
        for probe, path in (("startupProbe", deploy.READY_PATH), ("readinessProbe", deploy.READY_PATH),
                            ("livenessProbe", deploy.LIVE_PATH)):
            assert model[probe]["httpGet"] == {"path": path, "port": deploy.HTTP_PORT}, probe
        assert model["protocolVersion"] in runtime["spec"]["protocolVersions"]
        assert model["runtime"] == runtime["metadata"]["name"]
        assert model["modelFormat"]["name"] in [f["name"] for f in runtime["spec"]["supportedModelFormats"]]


def _pbtxt_field(text: str, key: str) -> str:
    return re.search(rf'^{key}:\s*"([^"]+)"', text, re.M).group(1)


def test_triton_models_layout_is_what_the_runtime_and_graph_expect():
    repo = REPO / "triton_models"
    assert sorted(p.name for p in repo.iterdir() if p.is_dir()) == sorted([deploy.PREDICT_MODEL, deploy.STREAM_MODEL])
    for model in (deploy.PREDICT_MODEL, deploy.STREAM_MODEL):
        config = (repo / model / "config.pbtxt").read_text()
        assert _pbtxt_field(config, "name") == model and _pbtxt_field(config, "backend") == "python"
        assert (repo / model / "1" / "model.py").is_file()
    predict = (repo / deploy.PREDICT_MODEL / "config.pbtxt").read_text()
    assert re.search(rf'key: "engine_model" value: {{ string_value: "{deploy.STREAM_MODEL}" }}', predict)
    # The A/B router calls each arm's predict endpoint of the `cube3d` model on port 80 of its Service.
    graph = find(render("ab"), "InferenceGraph")
    arms = sorted(i["metadata"]["name"] for i in isvcs(render("ab")))
    hosts = []
    for step in graph["spec"]["nodes"]["root"]["steps"]:
        url = urlparse(step["serviceUrl"])
        assert url.path == f"/v2/models/{deploy.PREDICT_MODEL}/infer" and url.port is None
        hosts.append(url.hostname)
    assert hosts == [f"{arm}-predictor" for arm in arms]


def test_local_server_and_client_defaults_are_the_deploy_modules():
    import inspect

    from cube3d_client import Cube3DClient
    from cube3d_client.cli import build_parser
    from cubeserve.serving.local_triton import LocalTriton

    defaults = inspect.signature(LocalTriton).parameters
    assert (defaults["http_port"].default, defaults["grpc_port"].default, defaults["metrics_port"].default) == \
        (deploy.HTTP_PORT, deploy.GRPC_PORT, deploy.METRICS_PORT)
    client = inspect.signature(Cube3DClient).parameters
    assert client["url"].default.endswith(f":{deploy.HTTP_PORT}")
    assert (client["model"].default, client["stream_model"].default) == (deploy.PREDICT_MODEL, deploy.STREAM_MODEL)
    assert build_parser().get_default("url").endswith(f":{deploy.HTTP_PORT}")
    try:
        command = LocalTriton().command()
    except RuntimeError:  # the Triton wheel is not installed
        pytest.skip("nvidia-pytriton not installed")
    assert set(deploy.COMMON_FLAGS) <= set(command)


# -- the image --------------------------------------------------------------------------------------

def test_dockerfile_builds_the_runtime_the_manifests_expect():
    steps = dockerfile_instructions(REPO / "k8s" / "Dockerfile")
    by = lambda k: [a for i, a in steps if i == k]  # noqa: E731
    [base] = by("FROM")
    image, _, tag = base.partition(":")
    assert image == "nvcr.io/nvidia/tritonserver" and re.fullmatch(r"\d\d\.\d\d-py3", tag), base
    assert "latest" not in json.dumps(steps)
    assert steps[-1][0] == "CMD" and json.loads(by("CMD")[-1]) == deploy.server_command(deploy.IMAGE_MODEL_REPOSITORY)
    assert not by("ENTRYPOINT")  # NVIDIA's entrypoint script runs CMD / the runtime's args
    assert by("USER")[-1] == f"{deploy.IMAGE_UID}:{deploy.IMAGE_UID}"
    copies = [shlex.split(a) for a in by("COPY")]
    assert ["triton_models", "./triton_models"] in copies
    [workdir] = by("WORKDIR")
    assert f"{workdir}/triton_models" == deploy.IMAGE_MODEL_REPOSITORY
    assert sorted(int(p) for a in by("EXPOSE") for p in a.split()) == \
        [deploy.HTTP_PORT, deploy.GRPC_PORT, deploy.METRICS_PORT]
    runs = " ".join(by("RUN"))
    assert '"torch==${TORCH_VERSION}"' in runs and "ARG" in dict(steps) and "TORCH_VERSION=2.13.0" in by("ARG")
    # Warp (marching cubes on the GPU) and everything the pipeline's steps import
    assert 'pip install --no-cache-dir ".[gpu,pipeline]"' in runs
    assert ["models/demo", f"./triton_models/{deploy.STREAM_MODEL}/1/weights"] in copies
    # The build context's filter keeps local weights out of the image.
    ignore = (REPO / "k8s" / "Dockerfile.dockerignore").read_text().split()
    assert "triton_models/*/*/weights" in ignore and "!models/demo/" in ignore


def test_image_references_are_pinned(overlay):
    _, objects = overlay
    image = runtime_container(objects)["image"]
    name, _, tag = image.rpartition(":")
    assert name.endswith("/cube-serve") and tag and tag != "latest", image


# -- the overlays' rollout settings -------------------------------------------------------------------

def test_storage_uris_are_registry_versions_and_placeholders(overlay):
    name, objects = overlay
    reg = registry(objects)
    assert "replace-me" in reg.base_uri
    for isvc in isvcs(objects):
        uri = isvc["spec"]["predictor"]["model"].get("storageUri")
        assert uri is None if name == "cpu" else reg.version_of(uri), uri  # cpu: the model in the image


def test_overlays_carry_no_rollout_owned_fields(overlay):
    """One writer per field: the rollout fields are `cubeserve rollout`'s (tests/test_rollout.py
    shows an overlay applied again after a promote does not move traffic); the overlays set up
    the service and its first version only."""
    _, objects = overlay
    for isvc in isvcs(objects):
        assert "canary" not in isvc["spec"]
        assert {"canaryTrafficPercent", "name"}.isdisjoint(isvc["spec"]["predictor"])
        assert "cube-serve.io/stable-version" not in isvc["metadata"].get("annotations", {})
        assert isvc["metadata"]["annotations"]["serving.kserve.io/deploymentMode"] in ("Serverless", "RawDeployment")


def test_base_is_the_gpu_deployment_without_a_mode():
    # The overlays choose the mode; the base alone would take the cluster's default.
    path = REPO / "k8s" / "base" / "inferenceservice" / "inferenceservice.yaml"
    isvc = yaml.safe_load(path.read_text())
    assert "serving.kserve.io/deploymentMode" not in isvc["metadata"]["annotations"]
    assert isvc["spec"]["predictor"]["model"]["resources"]["limits"][GPU] == "1"


def test_the_mlflow_registry_manifest_is_valid():
    """k8s/mlflow/ (the pipeline's registry server) is plain Kubernetes: every object validates."""
    objects = [o for o in yaml.safe_load_all((REPO / "k8s" / "mlflow" / "mlflow.yaml").read_text()) if o]
    assert {o["kind"] for o in objects} >= {"Deployment", "Service"}
    for obj in objects:
        assert validate(obj) == [], (obj["kind"], validate(obj))


def test_the_pipelines_rbac_allows_exactly_what_the_steps_call():
    """k8s/pipeline/: the ServiceAccount, Role and RoleBinding the pipeline's steps run as.
    They read and patch the InferenceService and the ConfigMap of the versions, and read what
    the rollout's state and preflight read (package, roll_out, the exit handler:
    cubeserve.pipeline.serving, cubeserve.rollout.Cluster), no more."""
    from cubeserve import rollout
    from k8s_validation import _rendered

    objects = [o for o in yaml.safe_load_all(_rendered(str(REPO / "k8s" / "pipeline"))) if o]
    for obj in objects:
        assert validate(obj) == [], (obj["kind"], validate(obj))
    account, role, binding = (find(objects, kind) for kind in ("ServiceAccount", "Role", "RoleBinding"))
    rules = {(tuple(r["apiGroups"]), tuple(r["resources"]), tuple(r.get("resourceNames", ()))): sorted(r["verbs"])
             for r in role["rules"]}
    assert rules == {
        ((rollout.cluster.GROUP,), (rollout.ISVC_API[1],), (rollout.cluster.DEFAULT_ISVC,)): ["get", "patch"],
        (("",), ("configmaps",), (rollout.VERSIONS_CONFIGMAP,)): ["get", "patch"],
        # The preflight: the runtime the InferenceService names exists.
        ((rollout.cluster.GROUP,), ("servingruntimes",), ("cube-serve-triton",)): ["get"],
        # Serverless state: the storageUri of each revision the status names.
        (("serving.knative.dev",), ("revisions",), ()): ["get"],
    }
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account["metadata"]["name"]}]
