"""k8s/: every overlay renders with kubectl's kustomize, every object is valid for the API that
receives it, and the runtime agrees with triton_models/, the ports and cubeserve.deploy."""

from __future__ import annotations

import copy
import json
import re
import shlex

import kubernetes_validate
import pytest
import yaml

from cubeserve import deploy
from guards import cannot_run
from cubeserve.rollout import VersionRegistry
from k8s_validation import (GATEWAY_API_RELEASES, GATEWAY_API_TOO_OLD, KSERVE_RELEASES, KUBERNETES_VERSION,
                            MIN_KSERVE, OVERLAYS, REPO,
                            SUPPORTED_KSERVE, crd_errors, dockerfile_instructions, find, gateway_api_errors,
                            kserve_version, rbac_allows, releases_before, render, render_dir, require_crds,
                            require_releases, supported_releases, validate)

GPU = "nvidia.com/gpu"
MODE = "serving.kserve.io/deploymentMode"
RAW_OVERLAYS = ("raw", "cpu", "ab", "experiment")  # k8s/components/raw-deployment
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


# Lists of a container that a strategic merge patch merges by a key (the rest are replaced).
_MERGE_KEYS = {"env": "name", "ports": "containerPort", "volumeMounts": "mountPath"}


def _strategic_merge(base, patch, field: str = ""):
    """What KServe's MergeRuntimeContainers does (a strategic merge patch of the runtime's
    container with predictor.model; pkg/controller/v1beta1/inferenceservice/utils/utils.go):
    the InferenceService wins field by field, maps merge recursively, env/ports/volumeMounts by
    their key, args are appended (v0.20; replaced before), other lists replaced."""
    if isinstance(base, dict) and isinstance(patch, dict):
        out = copy.deepcopy(base)
        for key, value in patch.items():
            out[key] = _strategic_merge(base[key], value, key) if key in base else copy.deepcopy(value)
        return out
    if field == "args":
        return base + patch
    if field in _MERGE_KEYS:
        key = _MERGE_KEYS[field]
        replaced = {item[key] for item in patch}
        return [copy.deepcopy(i) for i in base if i[key] not in replaced] + copy.deepcopy(patch)
    return copy.deepcopy(patch)


def kserve_pod(isvc: dict, runtime: dict) -> dict:
    """The predictor pod KServe builds: the runtime's container merged with predictor.model, the
    predictor's pod fields (volumes, terminationGracePeriodSeconds). Storage initializer left out."""
    [container] = [c for c in runtime["spec"]["containers"] if c["name"] == "kserve-container"]
    predictor = isvc["spec"]["predictor"]
    model = {k: v for k, v in predictor["model"].items() if k not in KSERVE_MODEL_FIELDS}
    spec = {"containers": [_strategic_merge(container, model)],
            "volumes": copy.deepcopy(predictor.get("volumes", []) + runtime["spec"].get("volumes", []))}
    if "terminationGracePeriodSeconds" in predictor:
        spec["terminationGracePeriodSeconds"] = predictor["terminationGracePeriodSeconds"]
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": f"{isvc['metadata']['name']}-predictor",
                                                            "labels": predictor_pod_labels(isvc, runtime)},
            "spec": spec}


def predictor_pod_labels(isvc: dict, runtime: dict) -> dict:
    """The labels KServe puts on a predictor's pods (both modes): the runtime's pod labels, the
    InferenceService's, the predictor's, then its own two (pkg/controller/v1beta1/inferenceservice/
    components/predictor.go, `utils.Union(sRuntimeLabels, isvc.Labels, predictorLabels, ...)`)."""
    return {**runtime["spec"].get("labels", {}), **isvc["metadata"].get("labels", {}),
            **isvc["spec"]["predictor"].get("labels", {}),
            "serving.kserve.io/inferenceservice": isvc["metadata"]["name"], "component": "predictor"}


@pytest.fixture(scope="module", params=OVERLAYS)
def overlay(request):
    return request.param, render(request.param)


# -- rendering and schemas --------------------------------------------------------------------------

def test_every_overlay_renders_to_valid_objects(overlay):
    name, objects = overlay
    kinds = sorted(o["kind"] for o in objects)
    expected = {"canary": ["ConfigMap", "InferenceService", "ServiceAccount", "ServingRuntime"],
                "raw": ["ConfigMap", "InferenceService", "ServiceAccount", "ServingRuntime"],
                "raw-canary": ["ConfigMap", "InferenceService", "ServiceAccount", "ServingRuntime"],
                "cpu": ["ConfigMap", "InferenceService", "ServiceAccount", "ServingRuntime"],
                "ab": ["ConfigMap", "HTTPRoute", "InferenceService", "InferenceService", "ServiceAccount",
                       "ServingRuntime"],
                "experiment": ["ConfigMap", "InferenceService", "ServiceAccount", "ServingRuntime"]}
    assert kinds == expected[name]
    for obj in objects:
        assert validate(obj) == [], f"{name}: {obj['kind']} {obj['metadata']['name']}"
        assert obj["metadata"]["labels"]["app.kubernetes.io/part-of"] == "cube-serve"


def test_every_overlay_matches_the_newest_kserve_crds(overlay):
    name, objects = overlay
    schemas = require_crds()
    for obj in objects:
        assert crd_errors(obj, schemas) == [], f"{name}: {obj['kind']} {obj['metadata']['name']}"


# -- the KServe releases each overlay supports (docs/deploy/compatibility.md) -----------------------------

def test_the_compatibility_table_covers_every_overlay_and_the_releases_at_hand():
    assert set(MIN_KSERVE) == set(OVERLAYS)
    releases = require_releases()
    # The declared range and every overlay's minimum are releases whose CRDs are checked.
    assert set(SUPPORTED_KSERVE) | set(MIN_KSERVE.values()) <= set(releases), releases
    assert all(kserve_version(SUPPORTED_KSERVE[0]) <= kserve_version(m) <= kserve_version(SUPPORTED_KSERVE[1])
               for m in MIN_KSERVE.values())


def test_every_overlay_matches_the_crds_of_every_release_it_supports(overlay):
    """Strict: a field a release does not know is an error (its API server would drop it)."""
    name, objects = overlay
    require_releases()
    checked = supported_releases(MIN_KSERVE[name])
    # The minimum's own CRDs are at hand (it may be an excluded release: then the next one is first).
    assert MIN_KSERVE[name] in KSERVE_RELEASES and checked and checked[-1] == SUPPORTED_KSERVE[1], checked
    for release in checked:
        schemas = require_crds(release)
        for obj in objects:
            assert crd_errors(obj, schemas) == [], f"{name} on KServe {release}: {obj['kind']} {obj['metadata']['name']}"


def test_the_crds_are_in_the_repository_for_every_release_checked():
    """A clone with nothing beside it runs every CRD check: the data is tests/data/kserve, each file
    naming the kserve/kserve ref it came from; the releases span the supported range and the one
    before each overlay's minimum (which must refuse it) where there is one."""
    import gzip

    import k8s_validation as kv

    releases = kv.require_releases()
    assert releases[0] == kv.SUPPORTED_KSERVE[0] and kv.SUPPORTED_KSERVE[1] in releases
    for ref in (*releases, "newest"):
        body = json.loads(gzip.decompress((kv.KSERVE_DATA / f"{ref}.json.gz").read_bytes()))
        assert body["source"].startswith("kserve/kserve ") and sorted(body["crds"]) == sorted(kv.KSERVE_CRD_FILES)
        assert "description" not in json.dumps(body["crds"]["serving.kserve.io_servingruntimes.yaml"])[:20000]
        assert kv.require_crds(None if ref == "newest" else ref)[("serving.kserve.io/v1beta1", "InferenceService")]
    assert "../shared" not in (REPO / "tests" / "k8s_validation.py").read_text()


def test_the_releases_before_an_overlays_minimum_refuse_it(overlay):
    """The declared minimum is not too high: the release before it refuses the overlay (and it
    is not too low: the minimum itself accepts it, above). For an overlay whose minimum is the
    oldest supported release, nothing older is claimed."""
    name, objects = overlay
    require_releases()
    older = releases_before(MIN_KSERVE[name])
    if MIN_KSERVE[name] == SUPPORTED_KSERVE[0]:
        return
    assert older, f"{name}: no release older than {MIN_KSERVE[name]} at hand to show it is needed"
    for release in older:
        schemas = require_crds(release)
        errors = [e for obj in objects for e in crd_errors(obj, schemas)]
        assert errors, f"{name}: KServe {release} accepts it; its minimum {MIN_KSERVE[name]} is too high"


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


def test_the_validator_rejects_bad_runtimes_routes_and_core_objects():
    objects = render("ab")
    runtime = find(objects, "ServingRuntime")
    runtime["spec"]["containers"][0]["ports"][0]["containerPort"] = "8000"
    assert any("containerPort" in e for e in validate(runtime))
    runtime = find(objects, "ServingRuntime")
    runtime["spec"]["supportedModelFormat"] = runtime["spec"].pop("supportedModelFormats")
    assert any("did you mean 'supportedModelFormats'" in e for e in validate(runtime))
    route = find(render("ab"), "HTTPRoute")
    route["spec"]["rules"][2]["backendRefs"][0]["wieght"] = 5
    assert any("'wieght' was unexpected" in e for e in validate(route))
    route = find(render("ab"), "HTTPRoute")
    route["spec"]["rules"][2]["backendRefs"][0]["weight"] = "80"
    assert any("'80' is not of type 'integer'" in e for e in validate(route))
    route = find(render("ab"), "HTTPRoute")
    route["spec"]["rules"][0]["timeouts"]["request"] = "ten minutes"
    assert any("timeouts.request" in e for e in validate(route))
    route = find(render("ab"), "HTTPRoute")  # the CRD's CEL rules, checked by hand
    route["spec"]["rules"][2]["backendRefs"][0]["filters"][0]["type"] = "RequestHeaderModifier"
    assert any("must be configured by 'requestHeaderModifier'" in e for e in validate(route))
    route = find(render("ab"), "HTTPRoute")
    filters = route["spec"]["rules"][2]["backendRefs"][0]["filters"]
    filters.append(copy.deepcopy(filters[0]))
    assert any("ResponseHeaderModifier filter cannot be repeated" in e for e in validate(route))
    route = find(render("ab"), "HTTPRoute")
    route["spec"]["rules"][2]["timeouts"]["backendRequest"] = "20m"
    assert any("backendRequest must be <= request" in e for e in validate(route))
    configmap = find(objects, "ConfigMap")
    configmap["dat"] = configmap.pop("data")
    assert validate(configmap)
    isvc = raw_with_canary()
    isvc["spec"]["canary"][0]["predictor"]["model"].pop("name")
    assert any("model.name is required" in e for e in validate(isvc))


def test_the_strict_crd_schemas_reject_misspelled_fields():
    schemas = require_crds()
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
        # The restricted Pod Security Standard, from the runtime (the InferenceService sets none).
        security = container["securityContext"]
        assert security["runAsNonRoot"] is True and security["runAsUser"] == deploy.IMAGE_UID != 0
        assert security["runAsGroup"] == deploy.IMAGE_UID
        assert security["allowPrivilegeEscalation"] is False and security["capabilities"]["drop"] == ["ALL"]
        assert security["seccompProfile"] == {"type": "RuntimeDefault"}
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


def test_the_runtime_alone_sets_the_security_context_and_selects_nothing_by_itself(overlay):
    """One place: the ServingRuntime's container carries the security context, so an
    InferenceService that selects the runtime runs restricted without repeating it (KServe merges
    field by field: one that sets e.g. runAsUser keeps the rest). And the runtime is never chosen
    for an InferenceService that does not name it (autoSelect: other Triton services of the
    namespace would run this image)."""
    _, objects = overlay
    runtime = find(objects, "ServingRuntime")
    assert runtime_container(objects)["securityContext"] == {
        "runAsNonRoot": True, "runAsUser": deploy.IMAGE_UID, "runAsGroup": deploy.IMAGE_UID,
        "allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]},
        "seccompProfile": {"type": "RuntimeDefault"}}
    for fmt in runtime["spec"]["supportedModelFormats"]:
        assert fmt["autoSelect"] is False and "priority" not in fmt, fmt
    for isvc in isvcs(objects):
        assert "securityContext" not in isvc["spec"]["predictor"]["model"]
        assert isvc["spec"]["predictor"]["model"]["runtime"] == runtime["metadata"]["name"]
        overridden = copy.deepcopy(isvc)
        overridden["spec"]["predictor"]["model"]["securityContext"] = {"runAsUser": 20000}
        security = kserve_pod(overridden, runtime)["spec"]["containers"][0]["securityContext"]
        assert security["runAsUser"] == 20000 and security["capabilities"] == {"drop": ["ALL"]}


# -- stopping a pod (docs/deploy/draining.md; tests/test_drain.py runs it) --------------------------------

def test_the_raw_overlays_drain_a_pod_before_it_stops(overlay):
    """RawDeployment: the preStop hook is cubeserve.deploy's drain, the grace period covers it and
    then Triton's own shutdown, and Triton's exit timeout is the request timeout."""
    from cubeserve.serving import drain

    name, objects = overlay
    args = runtime_container(objects)["args"]
    assert f"--exit-timeout-secs={deploy.EXIT_TIMEOUT_S}" in args  # both modes
    assert deploy.EXIT_TIMEOUT_S == deploy.REQUEST_TIMEOUT_S
    runtime = find(objects, "ServingRuntime")
    for isvc in isvcs(objects):
        predictor = isvc["spec"]["predictor"]
        assert predictor["timeout"] == deploy.REQUEST_TIMEOUT_S
        if name not in RAW_OVERLAYS:
            continue
        assert isvc["metadata"]["annotations"][MODE] == "RawDeployment"
        hook = predictor["model"]["lifecycle"]
        assert hook == {"preStop": {"exec": {"command": deploy.PRESTOP_COMMAND}}}
        options = drain.build_parser().parse_args(deploy.PRESTOP_COMMAND[3:])  # the command parses
        assert deploy.PRESTOP_COMMAND[:3] == [deploy.SUPERVISOR[0], "-m", "cubeserve.serving.drain"]
        # it finds tritonserver by its own REST port (behind the front end)
        assert (options.http_port, options.metrics_port) == (deploy.TRITON_HTTP_PORT, deploy.METRICS_PORT)
        assert options.timeout == deploy.DRAIN_TIMEOUT_S >= deploy.REQUEST_TIMEOUT_S
        assert options.scrape_interval == deploy.SCRAPE_INTERVAL_S  # k8s/monitoring's (tests/test_monitoring.py)
        assert deploy.PRESTOP_MAX_S > options.timeout + max(options.settle, options.scrape_interval
                                                            + deploy.DRAIN_SCRAPE_MARGIN_S)
        grace = predictor["terminationGracePeriodSeconds"]
        assert grace == deploy.TERMINATION_GRACE_PERIOD_S
        assert grace >= deploy.REQUEST_TIMEOUT_S + deploy.PRESTOP_MAX_S
        assert grace >= deploy.PRESTOP_MAX_S + deploy.EXIT_TIMEOUT_S
        pod = kserve_pod(isvc, runtime)
        assert pod["spec"]["terminationGracePeriodSeconds"] == grace
        assert pod["spec"]["containers"][0]["lifecycle"] == hook


def test_the_serverless_overlay_leaves_draining_to_knative():
    """Knative refuses `lifecycle` on the user container and terminationGracePeriodSeconds in the
    pod spec (k8s/components/raw-deployment cites where), and drains through queue-proxy."""
    isvc = find(render("canary"), "InferenceService")
    assert isvc["metadata"]["annotations"][MODE] == "Serverless"
    text = json.dumps(isvc)
    assert "lifecycle" not in text and "terminationGracePeriodSeconds" not in text and "preStop" not in text


def test_the_raw_deployment_component_is_the_only_place_of_the_mode():
    """The raw overlays take the mode from the component, not from patches of their own."""
    for name in RAW_OVERLAYS:
        kustomization = yaml.safe_load((REPO / "k8s" / "overlays" / name / "kustomization.yaml").read_text())
        assert kustomization["components"][0] == "../../components/raw-deployment"
        assert MODE.replace("/", "~1") not in json.dumps(kustomization.get("patches", []))


# -- one source of truth: cubeserve.deploy ------------------------------------------------------------

def test_runtime_args_are_the_deploy_modules(overlay):
    name, objects = overlay
    store = deploy.IMAGE_MODEL_REPOSITORY if name == "cpu" else deploy.KSERVE_MODEL_DIR
    container = runtime_container(objects)
    assert container["args"] == deploy.server_command(store)
    assert "command" not in container  # the image's entrypoint runs the args
    # No argument added by an InferenceService (KServe would append it to these).
    assert all("args" not in isvc["spec"]["predictor"]["model"] for isvc in isvcs(objects))


def test_the_admin_key_comes_from_a_secret_and_the_pod_locks_the_admin_apis(overlay):
    """docs/security.md: the pod's container gets the admin key from the Secret (never a value
    in the manifests; not optional, so a pod without it does not start), and its command, run
    by the supervisor, gives tritonserver the restricted-API flags for HTTP and gRPC (with a key
    of the supervisor's own: the admin key is checked by the front ends); both of tritonserver's
    endpoints listen on the loopback, behind the front ends on the pod's ports."""
    from cubeserve.server import supervisor

    _, objects = overlay
    runtime = find(objects, "ServingRuntime")
    for isvc in isvcs(objects):
        container = kserve_pod(isvc, runtime)["spec"]["containers"][0]
        [env] = [e for e in container["env"] if e["name"] == deploy.ADMIN_KEY_ENV]
        assert env == {"name": deploy.ADMIN_KEY_ENV, "valueFrom": {"secretKeyRef": {
            "name": deploy.ADMIN_SECRET, "key": deploy.ADMIN_KEY_ENV}}}
        args = container["args"]
        command = args[args.index("--") + 1:]
        assert f"--rest-port={deploy.HTTP_PORT}" in args and f"--grpc-port={deploy.GRPC_PORT}" in args[:args.index("--")]
        key = deploy.new_admin_key()
        locked = supervisor.locked_command(command, deploy.HTTP_PORT, deploy.GRPC_PORT, key)
        assert "--http-address=127.0.0.1" in command and "--grpc-address=127.0.0.1" in command
        apis = ",".join(deploy.RESTRICTED_APIS)
        assert locked[-2:] == [f"--http-restricted-api={apis}:{deploy.ADMIN_HEADER}={key}",
                               f"--grpc-restricted-protocol={apis}:{deploy.ADMIN_HEADER}={key}"]
    # No key of any kind is written in k8s/.
    text = "\n".join(p.read_text() for p in (REPO / "k8s").rglob("*.yaml"))
    assert not re.search(r"[0-9a-f]{32,}", text)
    assert set(deploy.RESTRICTED_APIS) == {"shared-memory", "model-repository", "logging", "trace", "statistics"}


def test_the_supervisor_refuses_a_tritonserver_reachable_from_outside():
    from cubeserve.server.supervisor import locked_command

    key = deploy.new_admin_key()
    rest = ["--http-address=127.0.0.1", "--http-port=8010"]
    for command, problem in (
            (["tritonserver", "--http-port=8010", "--allow-grpc=false"], "loopback"),  # Triton's default: 0.0.0.0
            (["tritonserver", "--http-address=0.0.0.0", "--http-port=8010", "--allow-grpc=false"], "loopback"),
            (["tritonserver", "--http-address=127.0.0.1", "--http-port=8000", "--allow-grpc=false"], "must differ"),
            (["tritonserver", *rest], "gRPC endpoint must listen on the loopback"),
            (["tritonserver", *rest, "--grpc-address=0.0.0.0", "--grpc-port=8011"], "loopback"),
            (["tritonserver", *rest, "--grpc-address=127.0.0.1", "--grpc-port=8001"], "must differ"),
            (["tritonserver", *rest, "--grpc-address=127.0.0.1", "--grpc-port=8011", "--http-restricted-api=trace:a=b"],
             "sets the restricted APIs itself")):
        with pytest.raises(ValueError, match=problem):
            locked_command(command, deploy.HTTP_PORT, deploy.GRPC_PORT, key)
    with pytest.raises(ValueError, match="give --grpc-port"):
        locked_command(["tritonserver", *rest], deploy.HTTP_PORT, None, key)
    assert locked_command(["tritonserver", *rest, "--allow-grpc=false"], deploy.HTTP_PORT, None, key)
    for bad in ("", "short", "x" * 40 + ":y", "k=" + "x" * 40):
        with pytest.raises(ValueError, match=deploy.ADMIN_KEY_ENV):
            deploy.check_admin_key(bad)


def test_ports_probes_and_metrics_are_the_deploy_modules(overlay):
    _, objects = overlay
    container = runtime_container(objects)
    # Knative allows one port; a raw Service exposes the gRPC front end on a second
    raw = any(isvc["metadata"]["annotations"].get("serving.kserve.io/deploymentMode") == "RawDeployment"
              for isvc in isvcs(objects))
    assert [p["containerPort"] for p in container["ports"]] == [deploy.HTTP_PORT, *([deploy.GRPC_PORT] if raw else [])]
    args = container["args"]
    # clients reach the supervisor's front ends; tritonserver's REST and gRPC are on the pod's loopback
    supervisor, tritonserver = args[:args.index("--")], args[args.index("--") + 1:]
    assert f"--rest-port={deploy.HTTP_PORT}" in supervisor and "--rest-address=0.0.0.0" in supervisor
    assert f"--grpc-port={deploy.GRPC_PORT}" in supervisor and "--grpc-address=0.0.0.0" in supervisor
    assert f"--http-port={deploy.TRITON_HTTP_PORT}" in tritonserver and "--http-address=127.0.0.1" in tritonserver
    assert f"--grpc-port={deploy.TRITON_GRPC_PORT}" in tritonserver and "--grpc-address=127.0.0.1" in tritonserver
    # ... and metrics on every interface of the pod, where Prometheus and the autoscalers scrape them
    assert f"--metrics-port={deploy.METRICS_PORT}" in tritonserver and "--metrics-address=0.0.0.0" in tritonserver
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


# -- the cross-pod A/B route (k8s/overlays/ab) ----------------------------------------------------------

def test_the_ab_route_pins_splits_and_names_the_arm():
    """Each arm's predictor Service (KServe: <isvc>-predictor, port 80) behind one HTTPRoute: a
    header-matched rule per arm (a match with a header outranks one without), one weighted rule
    for the rest adding up to 100, the arm named in a response header by every backend, and the
    request timeout of cubeserve.deploy on every rule."""
    from cubeserve.rollout import plans

    objects = render("ab")
    route = find(render("ab"), "HTTPRoute")
    arms = {i["metadata"]["name"].rsplit("-", 1)[1]: f"{i['metadata']['name']}-predictor" for i in isvcs(objects)}
    assert arms == {"a": "cube3d-a-predictor", "b": "cube3d-b-predictor"}
    rules = route["spec"]["rules"]
    pinned = {}
    for rule in rules:
        assert rule["timeouts"] == {"request": f"{deploy.REQUEST_TIMEOUT_S}s"}
        for backend in rule["backendRefs"]:
            assert backend["port"] == 80 and backend.get("kind", "Service") == "Service"
            assert backend["name"] == arms[plans.backend_arm(backend)]
        if "matches" in rule:
            [match] = rule["matches"]
            assert set(match) == {"headers"}
            [header] = match["headers"]
            assert (header["type"], header["name"]) == ("Exact", plans.ARM_HEADER)
            [backend] = rule["backendRefs"]
            assert plans.backend_arm(backend) == header["value"]
            pinned[header["value"]] = backend["name"]
    assert pinned == arms
    weighted = rules[plans.weighted_rule(route)]
    assert "matches" not in weighted  # every request that pins no arm
    assert sorted(plans.backend_arm(b) for b in weighted["backendRefs"]) == sorted(arms)
    assert sum(b["weight"] for b in weighted["backendRefs"]) == 100
    [parent] = route["spec"]["parentRefs"]
    assert (parent["kind"], parent["name"], parent["namespace"]) == ("Gateway", "kserve-ingress-gateway", "kserve")


def test_the_ab_route_is_valid_for_every_gateway_api_release_claimed_and_needs_them():
    route = find(render("ab"), "HTTPRoute")
    for release in GATEWAY_API_RELEASES:
        assert gateway_api_errors(route, release) == [], release
    # The release before the minimum has no rule timeouts: it would refuse (prune) them.
    errors = gateway_api_errors(route, GATEWAY_API_TOO_OLD)
    assert errors and all("'timeouts' was unexpected" in e for e in errors), errors


# -- who reaches the servers: k8s/gateway/networkpolicy.yaml ------------------------------------------
# The servers trust x-cube3d-tenant, which the gateway sets (docs/gateway/index.md): the policy lets
# only the gateway's Envoy reach their front ends. Names the manifests do not carry, with their source:
NAMESPACE_NAME = "kubernetes.io/metadata.name"  # every namespace's label: its own name (Kubernetes 1.22+)
# Envoy Gateway runs each Gateway's Envoy in its own namespace, labelled with the Gateway's name
# (internal/gatewayapi: OwningGatewayNameLabel).
ENVOY_GATEWAY_NAMESPACE, OWNING_GATEWAY = "envoy-gateway-system", "gateway.envoyproxy.io/owning-gateway-name"
PROMETHEUS_POD = {"app.kubernetes.io/name": "prometheus"}  # the Prometheus Operator's pods
KNATIVE_NAMESPACE = "knative-serving"
ACTIVATOR, AUTOSCALER = {"app": "activator"}, {"app": "autoscaler"}
# queue-proxy's ports (knative.dev/networking pkg/apis/networking: BackendHTTPPort, BackendHTTP2Port,
# AutoscalingQueueMetricsPort), the Serverless pods' way in.
QUEUE_PROXY_PORTS, QUEUE_PROXY_METRICS_PORT = {8012, 8013}, 9090


def selects(selector: dict, labels: dict) -> bool:
    """A label selector (matchLabels, matchExpressions) against an object's labels."""
    if any(labels.get(key) != value for key, value in selector.get("matchLabels", {}).items()):
        return False
    tests = {"In": lambda key, values: labels.get(key) in values,
             "NotIn": lambda key, values: labels.get(key) not in values,
             "Exists": lambda key, values: key in labels,
             "DoesNotExist": lambda key, values: key not in labels}
    return all(tests[e["operator"]](e["key"], e.get("values", [])) for e in selector.get("matchExpressions", []))


def admits(policy: dict, namespace: str, labels: dict, port: int, own_namespace: str = "models") -> bool:
    """Whether `policy` (applied in `own_namespace`) lets a pod of `namespace` with `labels` open a TCP
    connection to `port` of a pod it selects: some ingress rule names the port (or no ports) and
    a peer of it matches (a peer without namespaceSelector is the policy's own namespace)."""
    def peer_matches(peer: dict) -> bool:
        if "ipBlock" in peer:
            return False  # addresses, not pods
        if "namespaceSelector" in peer:
            in_namespace = selects(peer["namespaceSelector"], {NAMESPACE_NAME: namespace})
        else:
            in_namespace = namespace == own_namespace
        return in_namespace and selects(peer.get("podSelector", {}), labels)

    for rule in policy["spec"].get("ingress", []):
        to_port = "ports" not in rule or any(p["port"] == port and p.get("protocol", "TCP") == "TCP"
                                             for p in rule["ports"])
        if to_port and ("from" not in rule or any(peer_matches(peer) for peer in rule["from"])):
            return True
    return False


@pytest.fixture(scope="module")
def gateway_objects():
    return render_dir("gateway")


def server_ports(objects) -> dict[str, int]:
    """The server's ports, from the ServingRuntime: the supervisor's front ends and tritonserver's
    metrics port (what a pod listens on beyond its loopback)."""
    args = runtime_container(objects)["args"]
    supervisor, tritonserver = args[:args.index("--")], args[args.index("--") + 1:]

    def flag(part, name):
        [value] = [a.split("=", 1)[1] for a in part if a.startswith(f"--{name}=")]
        return int(value)
    return {"rest": flag(supervisor, "rest-port"), "grpc": flag(supervisor, "grpc-port"),
            "metrics": flag(tritonserver, "metrics-port"), "triton-http": flag(tritonserver, "http-port"),
            "triton-grpc": flag(tritonserver, "grpc-port")}


def routed_inference_services(gateway_objects) -> set[str]:
    """The InferenceServices the gateway's HTTPRoute sends to: its Service backends are their
    predictor Services, `<name>-predictor` (KServe's pkg/constants: DefaultPredictorServiceName)."""
    route = find(gateway_objects, "HTTPRoute")
    services = {ref["name"] for rule in route["spec"]["rules"] for ref in rule["backendRefs"]
                if ref.get("kind", "Service") == "Service" and ref.get("group", "") == ""}
    assert services and all(s.endswith("-predictor") for s in services), services
    return {s.removesuffix("-predictor") for s in services}


def test_the_gateways_network_policy_is_valid_and_admits_only_named_peers_and_ports(gateway_objects):
    """Strictly valid (kubernetes-validate), ingress only, and no rule open to every source or
    every port: each peer is a namespace AND a pod selector in one element (two elements would
    be either), no ipBlock."""
    policy = find(gateway_objects, "NetworkPolicy")
    assert validate(policy) == []
    spec = policy["spec"]
    assert spec["policyTypes"] == ["Ingress"] and "egress" not in spec
    assert spec["ingress"]
    for rule in spec["ingress"]:
        assert rule.get("ports") and rule.get("from"), rule
        for peer in rule["from"]:
            assert set(peer) == {"namespaceSelector", "podSelector"}, peer
            assert peer["namespaceSelector"]["matchLabels"].keys() == {NAMESPACE_NAME}, peer
            assert peer["podSelector"].get("matchLabels"), peer
        assert all(p.get("protocol") == "TCP" and isinstance(p["port"], int) and "endPort" not in p
                   for p in rule["ports"]), rule


def test_the_gateways_network_policy_selects_the_routed_predictor_pods(gateway_objects, overlay):
    """The predictor pods of every InferenceService the gateway routes to, and no other: each
    overlay's pods as KServe labels them (predictor_pod_labels) are selected when the route sends
    to their InferenceService (cube3d), and not otherwise (the A/B overlay's arms, behind KServe's
    own Gateway); the selector names exactly the routed ones (a renamed model fails here)."""
    name, objects = overlay
    policy = find(gateway_objects, "NetworkPolicy")
    selector = policy["spec"]["podSelector"]
    routed = routed_inference_services(gateway_objects)
    [by_name] = [e for e in selector["matchExpressions"] if e["key"] == "serving.kserve.io/inferenceservice"]
    assert by_name["operator"] == "In" and set(by_name["values"]) == routed
    runtime = find(objects, "ServingRuntime")
    for isvc in isvcs(objects):
        labels = kserve_pod(isvc, runtime)["metadata"]["labels"]
        assert selects(selector, labels) == (isvc["metadata"]["name"] in routed), (name, isvc["metadata"]["name"])
        # a transformer's or explainer's pods of the same InferenceService are not the server
        assert not selects(selector, {**labels, "component": "transformer"})
    if name != "ab":
        assert {i["metadata"]["name"] for i in isvcs(objects)} <= routed, name


def test_the_gateways_network_policy_admits_the_gateway_prometheus_and_knative_only(gateway_objects):
    """Port by port and peer by peer, from the manifests: the Gateway's Envoy (by the name of
    k8s/gateway's Gateway, the route's parent) to the front ends the ServingRuntime starts;
    Prometheus (the namespace components/autoscaling-keda queries it in) to the metrics port;
    Knative's activator and autoscaler to queue-proxy. Nobody else, nothing else."""
    policy = find(gateway_objects, "NetworkPolicy")
    objects = render("raw")
    ports = server_ports(objects)
    declared = runtime_container(objects)["ports"]
    assert [p["containerPort"] for p in declared] == [ports["rest"], ports["grpc"]]
    [gateway] = [o for o in gateway_objects if o["kind"] == "Gateway"]
    route = find(gateway_objects, "HTTPRoute")
    assert [p["name"] for p in route["spec"]["parentRefs"]] == [gateway["metadata"]["name"]]
    envoy = (ENVOY_GATEWAY_NAMESPACE, {OWNING_GATEWAY: gateway["metadata"]["name"],
                                       "gateway.envoyproxy.io/owning-gateway-namespace": "models"})
    address = find(objects, "InferenceService")["spec"]["predictor"]["autoScaling"]["metrics"][0]["external"][
        "metric"]["serverAddress"]
    service, prometheus_namespace = re.fullmatch(r"https?://([^.]+)\.([^.]+)\.svc(?:\.cluster\.local)?:\d+",
                                                 address).groups()
    assert service == "prometheus-operated"
    prometheus = (prometheus_namespace, {**PROMETHEUS_POD, "prometheus": "k8s"})
    activator, autoscaler = (KNATIVE_NAMESPACE, ACTIVATOR), (KNATIVE_NAMESPACE, AUTOSCALER)
    allowed = [(envoy, {ports["rest"], ports["grpc"]}), (prometheus, {ports["metrics"]}),
               (activator, QUEUE_PROXY_PORTS), (autoscaler, {QUEUE_PROXY_METRICS_PORT})]
    # A client in the models' namespace (also one forging the Envoy's labels there), KServe's own
    # Gateway's Envoy, another pod beside the Envoys, a Prometheus elsewhere, Knative's ingress, ...
    others = [("models", {"app": "client"}), ("models", envoy[1]),
              (ENVOY_GATEWAY_NAMESPACE, {OWNING_GATEWAY: "kserve-ingress-gateway"}), (ENVOY_GATEWAY_NAMESPACE, {}),
              ("default", PROMETHEUS_POD), (prometheus_namespace, {"app": "grafana"}),
              (KNATIVE_NAMESPACE, {"app": "controller"}), ("kourier-system", {"app": "3scale-kourier-gateway"})]
    every_port = set(ports.values()) | QUEUE_PROXY_PORTS | {QUEUE_PROXY_METRICS_PORT, 80, 8022, 9091}
    for (namespace, labels), expected in allowed:
        assert {p for p in every_port if admits(policy, namespace, labels, p)} == expected, (namespace, labels)
    for namespace, labels in others:
        assert not any(admits(policy, namespace, labels, p) for p in every_port), (namespace, labels)
    # Exactly the ports named above, so a port changed in the runtime fails here.
    named = set().union(*(expected for _, expected in allowed))
    assert {p["port"] for rule in policy["spec"]["ingress"] for p in rule["ports"]} == named
    assert not {ports["triton-http"], ports["triton-grpc"]} & named  # tritonserver's own, on the loopback


# -- the in-server experiment (k8s/components/experiment) ------------------------------------------------

def test_the_experiment_overlay_mounts_the_experiment_where_the_server_reads_it():
    """The env var the predict model reads names experiment.json of the ConfigMap that `cubeserve
    rollout ab` writes, mounted whole (a subPath mount is never refreshed) and optional (pods start
    without it); no overlay declares the ConfigMap (its one writer is the rollout tool)."""
    import posixpath

    from cubeserve.rollout import experiments
    from cubeserve.rollout.version_sets import served_versions
    from cubeserve.serving.experiment import EXPERIMENT_FILE_ENV

    objects = render("experiment")
    isvc = find(objects, "InferenceService")
    pod = kserve_pod(isvc, find(objects, "ServingRuntime"))
    [container] = pod["spec"]["containers"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["HF_HUB_OFFLINE"] == "1"  # the runtime's env is kept (merged by name)
    path = env[EXPERIMENT_FILE_ENV]
    [mount] = [m for m in container["volumeMounts"] if m["mountPath"] == posixpath.dirname(path)]
    assert "subPath" not in mount and mount["readOnly"] is True
    assert posixpath.basename(path) == experiments.EXPERIMENT_KEY
    [volume] = [v for v in pod["spec"]["volumes"] if v["name"] == mount["name"]]
    assert volume["configMap"] == {"name": experiments.EXPERIMENT_CONFIGMAP, "optional": True}
    # The pod loads a version set: the versions an experiment may name.
    assert served_versions(isvc["spec"]["predictor"]["model"]["storageUri"], registry(objects)) == {1, 2}
    for name in OVERLAYS:
        assert not [o for o in render(name) if o["metadata"]["name"] == experiments.EXPERIMENT_CONFIGMAP], name
        if name != "experiment":  # one version per pod: no experiment file
            assert EXPERIMENT_FILE_ENV not in json.dumps(render(name)), name


def test_local_server_and_client_defaults_are_the_deploy_modules():
    import inspect

    from cube3d_client import Cube3DClient
    from cube3d_client.cli import build_parser
    from cubeserve.server.local_triton import LocalTriton

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
        cannot_run("nvidia-pytriton not installed")
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
    # Warp (marching cubes on the GPU), everything the pipeline's steps import, the supervisor's front
    # end, Ray Data for `cubeserve batch` on a RayJob's pods (k8s/batch/)
    assert 'pip install --no-cache-dir ".[gpu,pipeline,front,batch,tracing]"' in runs
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
    from cubeserve.rollout.version_sets import served_versions

    for isvc in isvcs(objects):
        uri = isvc["spec"]["predictor"]["model"].get("storageUri")
        if name == "cpu":  # the model in the image
            assert uri is None
        elif name == "experiment":  # several versions (k8s/components/experiment)
            assert served_versions(uri, reg) == {1, 2}, uri
        else:
            assert reg.version_of(uri), uri


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


def test_every_predictor_runs_as_the_account_that_lists_the_storage_secret(overlay):
    """KServe's storage initializer gets credentials only from the Secrets listed on the pod's
    service account, `default` when the InferenceService names none (pkg/credentials/
    service_account_credentials.go, CreateSecretVolumeAndEnv and
    CreateSecretVolumeAndEnvFromServiceAccount's loop over serviceAccount.Secrets; the same at
    v0.14.0 to v0.20.0): every InferenceService of every overlay names the account the overlay
    ships, and that account lists the Secret, but in `cpu`, which downloads nothing: there KServe's
    pod webhook would refuse the pods while the listed Secret is missing (tests/test_node.py)."""
    name, objects = overlay
    accounts = {o["metadata"]["name"]: o for o in objects if o["kind"] == "ServiceAccount"}
    account = accounts[deploy.PREDICTOR_SERVICE_ACCOUNT]
    downloads = any(isvc["spec"]["predictor"]["model"].get("storageUri") for isvc in isvcs(objects))
    assert downloads == (name != "cpu")
    assert ({"name": deploy.STORAGE_SECRET} in account.get("secrets", [])) == downloads
    assert account["automountServiceAccountToken"] is False  # the server never calls the API
    for isvc in isvcs(objects):
        assert isvc["spec"]["predictor"]["serviceAccountName"] == deploy.PREDICTOR_SERVICE_ACCOUNT, \
            isvc["metadata"]["name"]


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


# What every pod of a KFP v2 run does with its service account's token, from kubeflow/pipelines'
# source at tags 2.14.0 and 2.17.0 (same calls in both):
KFP_RUN_CALLS = [
    # backend/src/v2/config/env.go FromConfigMap: ConfigMaps(namespace).Get("kfp-launcher")
    # (driver and launcher; NotFound is fine, Forbidden fails the step).
    ("", "configmaps", "get", "kfp-launcher"),
    # backend/src/v2/objectstore/object_store.go (getS3BucketCredential..., Secrets(namespace).Get):
    # the artifact store's credentials, "mlpipeline-minio-artifact" by default (config/env.go).
    ("", "secrets", "get", "mlpipeline-minio-artifact"),
    # backend/src/v2/driver/k8s.go (the driver reads its own pod: Pods(namespace).Get(podName))
    # and component/launcher_v2.go retryIndexFromPodAnnotation (the launcher reads its own).
    ("", "pods", "get", "any-pod-of-the-run"),
    # Argo's executor reports a step's outputs as a WorkflowTaskResult: KFP's own
    # manifests/kustomize/base/pipeline/pipeline-runner-role.yaml grants exactly create, patch.
    ("argoproj.io", "workflowtaskresults", "create", "any"),
    ("argoproj.io", "workflowtaskresults", "patch", "any"),
]


def test_the_pipelines_rbac_allows_exactly_what_the_steps_call():
    """k8s/pipeline/: the ServiceAccount, Roles and RoleBindings the pipeline's pods run as.
    The steps read and patch the InferenceService and the ConfigMap of the versions, and read what
    the rollout's state and preflight read (package, roll_out, the exit handler:
    cubeserve.pipeline.serving, cubeserve.rollout.Cluster), no more; the run's own machinery
    (KFP's driver and launcher, Argo's executor) gets what the backend's source calls."""
    from cubeserve import rollout
    from k8s_validation import _rendered

    objects = [o for o in yaml.safe_load_all(_rendered(str(REPO / "k8s" / "pipeline"))) if o]
    for obj in objects:
        assert validate(obj) == [], (obj["kind"], validate(obj))
    (account,) = [o for o in objects if o["kind"] == "ServiceAccount"]
    roles = {o["metadata"]["name"]: o for o in objects if o["kind"] == "Role"}
    bindings = [o for o in objects if o["kind"] == "RoleBinding"]
    role = roles["cube-serve-rollout"]
    rules = {(tuple(r["apiGroups"]), tuple(r["resources"]), tuple(r.get("resourceNames", ()))): sorted(r["verbs"])
             for r in role["rules"]}
    assert rules == {
        ((rollout.cluster.GROUP,), (rollout.ISVC_API[1],), (rollout.cluster.DEFAULT_ISVC,)): ["get", "patch"],
        (("",), ("configmaps",), (rollout.VERSIONS_CONFIGMAP,)): ["get", "patch"],
        # The preflight: the runtime the InferenceService names exists.
        ((rollout.cluster.GROUP,), ("servingruntimes",), ("cube-serve-triton",)): ["get"],
        # Serverless state: the storageUri of each revision the status names.
        (("serving.knative.dev",), ("revisions",), ()): ["get"],
        # RawDeployment state: what the predictor Deployments' ReplicaSets serve (listed by
        # KServe's label; a list cannot be limited by resourceNames).
        (("apps",), ("replicasets",), ()): ["list"],
    }
    # The batch pipeline's step: create its RayJob, read it until it ends (tests/test_batch.py
    # records the calls against the KubeRay stand-in).
    assert [(r["apiGroups"], r["resources"], sorted(r["verbs"]), r.get("resourceNames"))
            for r in roles["cube-serve-batch"]["rules"]] == [(["ray.io"], ["rayjobs"], ["create", "get"], None)]
    # Every Role is bound to the account docs/pipeline.md tells users to run as.
    assert {b["roleRef"]["name"] for b in bindings} == set(roles)
    for binding in bindings:
        assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account["metadata"]["name"]}]
    run_rules = roles["cube-serve-pipeline-run"]["rules"]
    for call in KFP_RUN_CALLS:
        assert rbac_allows(run_rules, *call), call
    # ... and nothing beyond those calls: no other Secret, no write to pods or ConfigMaps.
    for extra in [("", "secrets", "get", "cube-serve-s3"), ("", "secrets", "list", ""),
                  ("", "configmaps", "get", "other"), ("", "pods", "delete", "p"), ("", "pods", "list", ""),
                  ("argoproj.io", "workflows", "get", "w")]:
        assert not rbac_allows(run_rules, *extra), extra
