"""k8s/monitoring/: the alerts fire when they should and only then (`promtool test rules`), the
dashboard and the alerts query only the metrics that cubeserve/serving/metrics.py defines (names,
suffixes and labels) in PromQL that Prometheus parses, and the scrape keeps the series' labels
on the port and path of cubeserve.deploy."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
import yaml

from cubeserve import deploy
from cubeserve.serving import metrics as m
from k8s_validation import REPO, _rendered, find
from prometheus_server import require_prometheus
from cubeserve.serving.drain import IN_PROGRESS_METRIC

MONITORING = REPO / "k8s" / "monitoring"
NAMESPACE = "models"

COUNTERS = {m.REQUESTS, m.MESHES, m.SHADOW_REQUESTS,
            # per tenant (the gateway's; `cubeserve usage`, tests/test_gateway.py)
            m.TENANT_REQUESTS, m.TENANT_OBJECTS, m.TENANT_SHAPE_TOKENS, m.TENANT_ENGINE_SECONDS}
HISTOGRAMS = {m.REQUEST_DURATION, m.TIME_PER_OUTPUT_TOKEN, m.QUEUE_TIME, m.SHADOW_DURATION, m.SHADOW_AGREEMENT}
# The gauge of the requests each model instance holds (serving/triton_common.py's Drain; the drain
# and the autoscalers read it): labels model, version, instance.
# When each server process started (`cubeserve usage` tells the processes apart): model, version.
START_TIME = {m.SERVER_START_TIME}
GAUGES = {IN_PROGRESS_METRIC, *START_TIME}
# The labels of those series (metrics.py's docstring), and those the scrape adds.
SERIES_LABELS = {"model", "version", "arm", "outcome", "quality", "measure", "baseline", "tenant", "gateway_model",
                 "le", "instance"}
TARGET_LABELS = {"namespace", "pod", "serving_kserve_io_inferenceservice"}


def objects() -> list[dict]:
    return [o for o in yaml.safe_load_all(_rendered(str(MONITORING))) if o]


def rule_groups() -> dict:
    """The PrometheusRule's groups as a Prometheus rule file."""
    return {"groups": find(objects(), "PrometheusRule")["spec"]["groups"]}


def alerts() -> dict[str, dict]:
    return {r["alert"]: r for g in rule_groups()["groups"] for r in g["rules"] if "alert" in r}


def dashboard() -> dict:
    return json.loads((MONITORING / "dashboard.json").read_text())


def dashboard_exprs() -> list[str]:
    return [t["expr"] for p in dashboard()["panels"] for t in p.get("targets", [])]


def promtool(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    _, binary = require_prometheus()
    return subprocess.run([binary, *args], capture_output=True, text=True, cwd=cwd, timeout=120)


# -- what the queries name ---------------------------------------------------------------------------

_KEYWORDS = {"and", "or", "unless", "bool", "offset", "by", "without", "on", "ignoring", "group_left",
             "group_right", "inf", "nan"}


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects (functions, keywords, label lists, matchers,
    strings and ranges left out)."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'', "", expr)
    text = re.sub(r"\{[^}]*\}|\[[^\]]*\]", "", text)
    text = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", text)
    names = re.findall(r"(?<![\w:.$])([a-zA-Z_:][\w:]*)\b(?!\s*\()", text)
    return {n for n in names if n.lower() not in _KEYWORDS}


def grouping_labels(expr: str) -> set[str]:
    return {label.strip() for group in re.findall(r"\b(?:by|without|on|ignoring)\s*\(([^)]*)\)", expr)
            for label in group.split(",") if label.strip()}


def unknown_metrics(expr: str) -> list[str]:
    """Names that are not metrics.py's series as Prometheus exposes them: a counter by its name,
    a histogram only through its _bucket, _sum and _count series; or the engine's gauges."""
    allowed = COUNTERS | GAUGES | {h + suffix for h in HISTOGRAMS for suffix in ("_bucket", "_sum", "_count")}
    return sorted(metric_names(expr) - allowed)


def test_metrics_py_defines_exactly_the_series_checked_here():
    defined = {v for k, v in vars(m).items() if k.isupper() and isinstance(v, str) and v.startswith("cube3d_")}
    assert defined == COUNTERS | HISTOGRAMS | START_TIME


def test_the_name_check_finds_what_it_must():
    expr = ('sum by (version, le) (rate(cube3d_request_duration_seconds_bucket{namespace="$namespace", '
            'outcome=~"ok|failed"}[$__rate_interval])) / ignoring (quality) group_left sum(cube3d_meshes_total)')
    assert metric_names(expr) == {"cube3d_request_duration_seconds_bucket", "cube3d_meshes_total"}
    assert unknown_metrics(expr) == []
    assert unknown_metrics("rate(cube3d_request_duration_seconds[5m])") == ["cube3d_request_duration_seconds"]
    assert unknown_metrics("rate(cube3d_requests_total_bucket[5m]) and up") == ["cube3d_requests_total_bucket", "up"]
    assert grouping_labels("sum by (namespace, version) (x) and on (namespace) y") == {"namespace", "version"}


def test_alerts_and_dashboard_query_only_the_servers_metrics_and_labels():
    exprs = [a["expr"] for a in alerts().values()] + dashboard_exprs()
    assert len(exprs) >= 5 + 9
    for expr in exprs:
        assert unknown_metrics(expr) == [], expr
        assert grouping_labels(expr) <= SERIES_LABELS | TARGET_LABELS, expr
    for variable in dashboard()["templating"]["list"]:
        if variable["type"] == "query":  # Grafana's label_values(<selector>, <label>)
            selector, label = re.fullmatch(r"label_values\((.+), (\w+)\)", variable["query"]["query"]).groups()
            assert unknown_metrics(selector) == [] and label in SERIES_LABELS | TARGET_LABELS


def test_every_dashboard_expr_parses(tmp_path):
    """Prometheus' own parser: each expr (Grafana's variables replaced by values) as a recording rule."""
    exprs = [e.replace("$__rate_interval", "5m").replace("$namespace", NAMESPACE).replace("$version", ".*")
             for e in dashboard_exprs()]
    assert not any("$" in e for e in exprs)
    rules = {"groups": [{"name": "dashboard", "rules": [{"record": f"cube3d:dashboard:{i}", "expr": e}
                                                         for i, e in enumerate(exprs)]}]}
    path = tmp_path / "dashboard-rules.yaml"
    path.write_text(yaml.safe_dump(rules))
    result = promtool("check", "rules", str(path))
    assert result.returncode == 0 and f"SUCCESS: {len(exprs)} rules found" in result.stdout, result.stdout + result.stderr
    path.write_text(yaml.safe_dump({"groups": [{"name": "bad", "rules": [{"record": "x", "expr": "sum by (version (x)"}]}]}))
    assert promtool("check", "rules", str(path)).returncode != 0  # the check can fail


def test_the_dashboard_panels_cover_the_alerts_figures():
    text = json.dumps(dashboard())
    for series in (m.REQUESTS, m.REQUEST_DURATION, m.TIME_PER_OUTPUT_TOKEN, m.QUEUE_TIME, m.MESHES,
                   m.SHADOW_REQUESTS, m.SHADOW_AGREEMENT):
        assert series in text, series
    ids = [p["id"] for p in dashboard()["panels"]]
    assert len(ids) == len(set(ids))
    [configmap] = [o for o in objects() if o["kind"] == "ConfigMap"]
    assert configmap["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(configmap["data"]["cube3d.json"]) == dashboard()


# -- the alerts ---------------------------------------------------------------------------------------

def test_the_rules_pass_promtool_check_and_every_alert_is_documented(tmp_path):
    path = tmp_path / "cube3d-rules.yaml"
    path.write_text(yaml.safe_dump(rule_groups()))
    result = promtool("check", "rules", str(path))
    assert result.returncode == 0, result.stdout + result.stderr
    assert set(alerts()) == {"Cube3DHighErrorRate", "Cube3DSlowRequests", "Cube3DLongQueue", "Cube3DEmptyMeshes",
                             "Cube3DNoTraffic", "Cube3DAtMaxReplicas"}
    for name, rule in alerts().items():
        assert re.fullmatch(r"\d+m", rule["for"]), name
        assert rule["labels"]["severity"] in ("critical", "warning"), name
        assert {"summary", "description", "runbook_url"} <= set(rule["annotations"]), name
        assert "version" in grouping_labels(rule["expr"]), name  # one alert per version


def series(name: str, labels: dict, values: str) -> dict:
    inner = ",".join(f'{k}="{v}"' for k, v in {"namespace": NAMESPACE, **labels}.items())
    return {"series": f"{name}{{{inner}}}", "values": values}


def counter(name: str, labels: dict, per_minute: float, minutes: int = 90) -> dict:
    return series(name, labels, f"0+{per_minute:g}x{minutes}")


def histogram(name: str, buckets: tuple, labels: dict, per_minute: float, value: float, minutes: int = 90) -> list[dict]:
    """`per_minute` observations of `value` every minute."""
    found = [counter(f"{name}_bucket", {**labels, "le": f"{le:g}"}, per_minute if value <= le else 0, minutes)
             for le in buckets]
    found.append(counter(f"{name}_bucket", {**labels, "le": "+Inf"}, per_minute, minutes))
    return found + [counter(f"{name}_count", labels, per_minute, minutes),
                    counter(f"{name}_sum", labels, per_minute * value, minutes)]


def expected(alert: str, labels: dict, value: float | None = None) -> dict:
    """An alert as promtool shows it: its labels, and its annotations rendered for `labels` and
    `value` (the template forms the rules use)."""
    rule = alerts()[alert]
    labels = {"namespace": NAMESPACE, **labels}

    def render(text: str) -> str:
        text = re.sub(r"\{\{ \$labels\.(\w+) \}\}", lambda g: labels.get(g.group(1), ""), text)
        text = text.replace("{{ $value | humanizePercentage }}", f"{value * 100:.4g}%" if value is not None else "")
        text = text.replace('{{ printf "%.0f" $value }}', f"{value:.0f}" if value is not None else "")
        assert "{{" not in text, text
        return text

    return {"exp_labels": {**labels, "severity": rule["labels"]["severity"]},
            "exp_annotations": {k: render(v) for k, v in rule["annotations"].items()}}


def run_promtool_tests(tmp_path: Path, tests: list[dict]) -> None:
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump(rule_groups()))
    (tmp_path / "tests.yaml").write_text(yaml.safe_dump({"rule_files": ["rules.yaml"], "evaluation_interval": "1m",
                                                         "tests": tests}))
    result = promtool("test", "rules", "tests.yaml", cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr


CONTROL = {"model": "cube3d", "version": "1", "arm": "control"}
CANDIDATE = {"model": "cube3d", "version": "2", "arm": "candidate"}
ENGINE_CONTROL = {**CONTROL, "model": "cube3d_stream"}
ENGINE_CANDIDATE = {**CANDIDATE, "model": "cube3d_stream"}


def test_error_rate_alert(tmp_path):
    inputs = [
        # the candidate: 4 of 10 answers fail; the control: 1 of 50; version 3: every answer
        # fails, but fewer than 10 in the window; invalid input and cancellations do not count
        counter(m.REQUESTS, {**CANDIDATE, "outcome": "ok"}, 6), counter(m.REQUESTS, {**CANDIDATE, "outcome": "failed"}, 3),
        counter(m.REQUESTS, {**CANDIDATE, "outcome": "unavailable"}, 1),
        counter(m.REQUESTS, {**CONTROL, "outcome": "ok"}, 49), counter(m.REQUESTS, {**CONTROL, "outcome": "failed"}, 1),
        counter(m.REQUESTS, {**CONTROL, "outcome": "invalid"}, 30), counter(m.REQUESTS, {**CONTROL, "outcome": "cancelled"}, 30),
        counter(m.REQUESTS, {"model": "cube3d", "version": "3", "arm": "", "outcome": "failed"}, 1),
    ]
    run_promtool_tests(tmp_path, [{"interval": "1m", "input_series": inputs, "alert_rule_test": [
        {"eval_time": "8m", "alertname": "Cube3DHighErrorRate", "exp_alerts": []},  # pending: `for` not reached
        {"eval_time": "30m", "alertname": "Cube3DHighErrorRate",
         "exp_alerts": [expected("Cube3DHighErrorRate", {"version": "2", "arm": "candidate"}, 0.4)]},
    ]}])


def test_latency_and_queue_alerts(tmp_path):
    inputs = (histogram(m.REQUEST_DURATION, m.DURATION_BUCKETS, CANDIDATE, 5, 200)  # p95 291 s
              + histogram(m.REQUEST_DURATION, m.DURATION_BUCKETS, CONTROL, 5, 3)
              + histogram(m.QUEUE_TIME, m.QUEUE_BUCKETS, ENGINE_CANDIDATE, 5, 100)  # p95 288 s
              + histogram(m.QUEUE_TIME, m.QUEUE_BUCKETS, ENGINE_CONTROL, 5, 0.7))
    run_promtool_tests(tmp_path, [{"interval": "1m", "input_series": inputs, "alert_rule_test": [
        {"eval_time": "12m", "alertname": "Cube3DSlowRequests", "exp_alerts": []},
        {"eval_time": "40m", "alertname": "Cube3DSlowRequests",
         "exp_alerts": [expected("Cube3DSlowRequests", {"version": "2", "arm": "candidate"}, 291)]},
        {"eval_time": "8m", "alertname": "Cube3DLongQueue", "exp_alerts": []},
        {"eval_time": "40m", "alertname": "Cube3DLongQueue",
         "exp_alerts": [expected("Cube3DLongQueue", {"version": "2"}, 288)]},
    ]}])


def test_empty_mesh_alert(tmp_path):
    inputs = [counter(m.MESHES, {**ENGINE_CANDIDATE, "quality": "ok"}, 7),
              counter(m.MESHES, {**ENGINE_CANDIDATE, "quality": "empty"}, 3),
              counter(m.MESHES, {**ENGINE_CONTROL, "quality": "ok"}, 98),
              counter(m.MESHES, {**ENGINE_CONTROL, "quality": "not_watertight"}, 30),
              counter(m.MESHES, {**ENGINE_CONTROL, "quality": "empty"}, 2)]
    run_promtool_tests(tmp_path, [{"interval": "1m", "input_series": inputs, "alert_rule_test": [
        {"eval_time": "10m", "alertname": "Cube3DEmptyMeshes", "exp_alerts": []},
        {"eval_time": "45m", "alertname": "Cube3DEmptyMeshes",
         "exp_alerts": [expected("Cube3DEmptyMeshes", {"version": "2", "arm": "candidate"}, 0.3)]},
    ]}])


def test_at_max_replicas_alert(tmp_path):
    """Fires for a version on 4 pods each above 8 requests in progress; not on 3 such pods, nor on
    4 pods at the target; the predict model's copy of each request (model cube3d) is not counted."""
    def pods(service, version, count, each):
        return [series(IN_PROGRESS_METRIC, {"model": model, "version": version, "instance": "cube3d_stream_0",
                                            "serving_kserve_io_inferenceservice": service,
                                            "pod": f"{service}-predictor-7c9d8b6f5-p{i}"}, f"{each}+0x60")
                for i in range(count) for model in ("cube3d_stream", "cube3d")]
    inputs = pods("cube3d", "1", 4, 10) + pods("cube3d", "2", 1, 30) + pods("busy", "1", 3, 20) + pods("fine", "1", 4, 8)
    labels = {"serving_kserve_io_inferenceservice": "cube3d", "version": "1"}
    run_promtool_tests(tmp_path, [{"interval": "1m", "input_series": inputs, "alert_rule_test": [
        {"eval_time": "10m", "alertname": "Cube3DAtMaxReplicas", "exp_alerts": []},
        {"eval_time": "30m", "alertname": "Cube3DAtMaxReplicas", "exp_alerts": [expected("Cube3DAtMaxReplicas", labels, 10)]},
    ]}])


def test_no_traffic_alert(tmp_path):
    starved = [  # version 1 answered 100 requests, then none; version 2 serves; version 3 gets shadow
        # copies only (the shadow series has no arm: triton_metrics.Measurements.shadow); version 4
        # was loaded and never got a request: its series is the zero the predict model exports at
        # load (Measurements.loaded, checked on the real server below)
        series(m.REQUESTS, {**CONTROL, "outcome": "ok"}, "100+0x90"),
        counter(m.REQUESTS, {**CANDIDATE, "outcome": "ok"}, 10),
        counter(m.SHADOW_REQUESTS, {"model": "cube3d", "version": "3", "baseline": "2", "outcome": "ok"}, 2),
        series(m.REQUESTS, {"model": "cube3d", "version": "4", "arm": "", "outcome": "ok"}, "0+0x90"),
    ]
    idle = [  # the whole namespace is quiet (a night): nothing is starved
        series(m.REQUESTS, {**CONTROL, "outcome": "ok"}, "100+0x90"),
        series(m.REQUESTS, {**CANDIDATE, "outcome": "ok"}, "50+0x90"),
    ]
    run_promtool_tests(tmp_path, [
        {"interval": "1m", "input_series": starved, "alert_rule_test": [
            {"eval_time": "30m", "alertname": "Cube3DNoTraffic", "exp_alerts": []},
            {"eval_time": "60m", "alertname": "Cube3DNoTraffic",
             "exp_alerts": [expected("Cube3DNoTraffic", {"version": "1"}), expected("Cube3DNoTraffic", {"version": "4"})]},
        ]},
        {"interval": "1m", "input_series": idle, "alert_rule_test": [
            {"eval_time": "60m", "alertname": "Cube3DNoTraffic", "exp_alerts": []}]},
    ])


def test_a_loaded_version_exports_its_request_series_before_any_request(tmp_path):
    """What test_no_traffic_alert's version 4 stands for, on the real server: right after load,
    before any request, each version's answered-request series is there at 0."""
    import urllib.request

    from cubeserve.checkpoint import write_random_weights
    from cubeserve.server.local_triton import LocalTriton, copy_model_repository, free_port

    repo = copy_model_repository(tmp_path / "models")
    write_random_weights("tiny", repo / "cube3d_stream" / "1" / "weights", seed=0)
    with LocalTriton(repo, free_port(), free_port(), free_port(), log_path=tmp_path / "log") as server:
        text = urllib.request.urlopen(server.metrics_url, timeout=10).read().decode()
    line = f'{m.REQUESTS}{{arm="",model="cube3d",outcome="ok",version="1"}} 0'
    assert line in text, [t for t in text.splitlines() if t.startswith(m.REQUESTS)]


def test_a_wrong_expectation_fails_promtool(tmp_path):
    """The harness can fail: the candidate's alert expected on the control."""
    inputs = [counter(m.REQUESTS, {**CANDIDATE, "outcome": "failed"}, 5)]
    with pytest.raises(AssertionError, match="Cube3DHighErrorRate"):
        run_promtool_tests(tmp_path, [{"interval": "1m", "input_series": inputs, "alert_rule_test": [
            {"eval_time": "30m", "alertname": "Cube3DHighErrorRate",
             "exp_alerts": [expected("Cube3DHighErrorRate", {"version": "1", "arm": "control"}, 1.0)]}]}])


# -- the scrape -----------------------------------------------------------------------------------------

def relabel(rules: list[dict], labels: dict) -> dict | None:
    """Prometheus' relabelling (keep and replace, as the rules here use them): the target's labels
    after `rules`, or None when it is dropped. Keys in Prometheus' spelling (source_labels, ...)."""
    labels = dict(labels)
    for rule in rules:
        value = rule.get("separator", ";").join(labels.get(s, "") for s in rule.get("source_labels", []))
        match = re.fullmatch(rule.get("regex", "(.*)"), value)
        action = rule.get("action", "replace")
        if action == "keep":
            if not match:
                return None
        elif action == "replace":
            if match:
                labels[rule["target_label"]] = match.expand(rule.get("replacement", "$1").replace("$", "\\"))
        else:
            raise AssertionError(f"relabel action {action!r}: not expected here")
    return labels


def pod_targets(ip: str = "10.1.2.3") -> list[dict]:
    """What Kubernetes pod discovery makes of a predictor pod: a target per declared container
    port (the init container's none: a target without a port)."""
    common = {"__meta_kubernetes_namespace": NAMESPACE, "__meta_kubernetes_pod_name": "cube3d-predictor-7d9",
              "__meta_kubernetes_pod_ip": ip, "__meta_kubernetes_pod_label_app_kubernetes_io_part_of": "cube-serve",
              "__meta_kubernetes_pod_label_component": "predictor",
              "__meta_kubernetes_pod_label_serving_kserve_io_inferenceservice": "cube3d"}
    return [{**common, "__address__": f"{ip}:8000", "__meta_kubernetes_pod_container_name": "kserve-container",
             "__meta_kubernetes_pod_container_port_number": "8000"},
            {**common, "__address__": f"{ip}:8012", "__meta_kubernetes_pod_container_name": "queue-proxy",
             "__meta_kubernetes_pod_container_port_number": "8012"},
            {**common, "__address__": ip, "__meta_kubernetes_pod_container_name": "storage-initializer"}]


def _prometheus_spelling(rule: dict) -> dict:
    keys = {"sourceLabels": "source_labels", "targetLabel": "target_label"}
    return {keys.get(k, k): v for k, v in rule.items()}


def test_the_pod_monitor_scrapes_the_metrics_port_and_keeps_the_labels():
    monitor = find(objects(), "PodMonitor")
    spec = monitor["spec"]
    assert spec["selector"]["matchLabels"] == {"app.kubernetes.io/part-of": "cube-serve", "component": "predictor"}
    [endpoint] = spec["podMetricsEndpoints"]
    assert endpoint["path"] == deploy.METRICS_PATH and endpoint["honorLabels"] is True
    assert "metricRelabelings" not in endpoint  # nothing rewrites or drops the series' labels
    rules = [_prometheus_spelling(r) for r in endpoint["relabelings"]]
    for rule in rules:  # target relabelling only: the address and which targets, no series label
        assert rule.get("target_label", "__address__").startswith("__") or rule.get("action") == "keep"
    scraped = [t for t in (relabel(rules, t) for t in pod_targets()) if t]
    assert [t["__address__"] for t in scraped] == [f"10.1.2.3:{deploy.METRICS_PORT}"]  # one target per pod
    assert relabel(rules, pod_targets("[fd00::5]")[0])["__address__"] == f"[fd00::5]:{deploy.METRICS_PORT}"
    # The operator's own port filter is not used: the metrics port is not a declared container
    # port (the runtime declares REST only), so `port: ...` would match nothing.
    assert "port" not in endpoint and "targetPort" not in endpoint
    assert spec["podTargetLabels"] == ["serving.kserve.io/inferenceservice"]
    # The preStop drain waits this long for a scrape of a pod's last counts (serving/drain.py).
    assert endpoint["interval"] == f"{deploy.SCRAPE_INTERVAL_S}s"


def test_the_plain_scrape_config_is_the_same_scrape_and_valid(tmp_path):
    config = yaml.safe_load((MONITORING / "scrape-config.yaml").read_text())
    [job] = config["scrape_configs"]
    assert job["metrics_path"] == deploy.METRICS_PATH and job["honor_labels"] is True
    assert job["scrape_interval"] == f"{deploy.SCRAPE_INTERVAL_S}s"  # as the PodMonitor's
    assert "metric_relabel_configs" not in job
    scraped = [t for t in (relabel(job["relabel_configs"], t) for t in pod_targets()) if t]
    assert len(scraped) == 1 and scraped[0]["__address__"] == f"10.1.2.3:{deploy.METRICS_PORT}"
    assert {k: v for k, v in scraped[0].items() if not k.startswith("__")} == {
        "namespace": NAMESPACE, "pod": "cube3d-predictor-7d9", "serving_kserve_io_inferenceservice": "cube3d"}
    other = {**pod_targets()[0], "__meta_kubernetes_pod_label_app_kubernetes_io_part_of": "someone-else"}
    assert relabel(job["relabel_configs"], other) is None
    # Debian builds Prometheus without Kubernetes discovery, so its promtool refuses
    # kubernetes_sd_configs: check everything else (the relabel rules' fields and regexes) with
    # the discovery swapped for a static target.
    job.pop("kubernetes_sd_configs")
    job["static_configs"] = [{"targets": ["10.1.2.3:8000"]}]
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    result = promtool("check", "config", "--syntax-only", str(tmp_path / "prometheus.yml"))
    assert result.returncode == 0, result.stdout + result.stderr


def test_mesh_quality_labels_meshes_as_trimesh_judges_them():
    """cube3d_meshes_total's `quality`, judged on the faces alone, says what trimesh's
    Trimesh.is_watertight says (the pipeline's evaluation): closed, one face missing, a face
    seen twice, faces whose winding disagrees (still closed), and no faces at all."""
    import numpy as np
    import trimesh

    from cubeserve.engine.geometry import Mesh

    sphere = trimesh.creation.icosphere(subdivisions=2)
    flipped = sphere.faces.copy()
    flipped[0] = flipped[0][::-1]
    cases = {"closed": (sphere.faces, m.MESH_OK), "a face missing": (sphere.faces[1:], m.MESH_NOT_WATERTIGHT),
             "a face twice": (np.vstack([sphere.faces, sphere.faces[:1]]), m.MESH_NOT_WATERTIGHT),
             "winding flipped": (flipped, m.MESH_OK)}
    for name, (faces, quality) in cases.items():
        mesh = Mesh(vertices=np.asarray(sphere.vertices, np.float32), faces=np.asarray(faces, np.int64))
        assert m.mesh_quality(mesh) == quality, name
        judged = trimesh.Trimesh(vertices=mesh.vertices, faces=mesh.faces, process=False).is_watertight
        assert (quality == m.MESH_OK) == judged, name
    assert m.mesh_quality(Mesh()) == m.MESH_EMPTY
