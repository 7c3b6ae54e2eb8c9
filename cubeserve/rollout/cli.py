"""`cubeserve rollout ...`: status, canary, promote, rollback, ab, version-set, analyze."""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict
from typing import Any, Callable

from cubeserve.rollout import experiments
from cubeserve.rollout.cluster import DEFAULT_ISVC, HTTPROUTE_API, ISVC_API, Cluster, Rollout
from cubeserve.rollout.errors import NotReady, RolloutError
from cubeserve.rollout.plans import Plan, backend_arm, parse_weights, plan_route_weights, weighted_rule
from cubeserve.rollout.state import STABLE, get, rollout_state
from cubeserve.rollout.version_sets import served_versions
from cubeserve.rollout.versions import VERSIONS_CONFIGMAP

# Exit codes.
DONE, API_ERROR, REFUSED, NOT_READY, DRIFT = 0, 1, 2, 3, 4

# Tests replace this to run the command line against objects in memory.
cluster_factory: Callable[..., Any] = Cluster


def _print_plan(plan: Plan, notes: list[str], out, dry_run: bool) -> None:
    print(plan.summary, file=out)
    for line in plan.changes:
        print(f"  {line}", file=out)
    for note in (*plan.notes, *notes):
        print(f"  note: {note}", file=out)
    if plan.changed:
        print("dry run: nothing was changed" if dry_run else "patched", file=out)


def _status(rollout: Rollout, args, out) -> int:
    isvc, registry, revisions = rollout.read()
    state = rollout_state(isvc, registry, revisions, rollout.mode)
    if args.json:
        print(json.dumps(asdict(state), indent=2, default=str), file=out)
        return DRIFT if state.drift else DONE
    url = get(isvc, "status", "url") or "(no URL yet)"
    print(f"InferenceService {rollout.cluster.namespace}/{args.isvc} ({state.mode}) {url}", file=out)
    print(f"  {state.summary()}", file=out)
    # A stable service whose pods are not available (a new one, none scheduled yet) says so too:
    # KServe reports PredictorReady False for it.
    if state.phase != STABLE or state.ready is False:
        ready = {True: "yes", False: "no", None: "not yet made by KServe"}[state.ready]
        print(f"  ready: {ready}", file=out)
    if state.failure:
        print(f"  FAILED: {state.failure}", file=out)
    for route in state.traffic:
        served = f"version {route.version}" if route.version else (route.uri or "unknown version")
        parts = [f"traffic {route.percent:>3}%", route.target, served, route.tag, route.note]
        print("  " + "  ".join(p for p in parts if p), file=out)
    for line in state.drift:
        print(f"  DRIFT: {line}", file=out)
    print(f"  registry {args.versions_configmap}: {registry.base_uri}/<version>/, versions "
          f"{' '.join(registry.versions) or '(none)'}", file=out)
    loaded = served_versions(state.storage_uri, registry)
    if loaded and len(loaded) > 1:
        print(f"  loads versions {', '.join(map(str, sorted(loaded)))} (a version set: an in-server experiment "
              "may use them)", file=out)
    try:
        line = experiments.describe(experiments.read(rollout.cluster.configmap(args.experiment_configmap)))
    except RolloutError as exc:  # a ConfigMap written by hand: show it, the server refuses it too
        line = f"INVALID: {exc}"
    except Exception as exc:  # noqa: BLE001 - not allowed to read it: say so, the rest stands
        if getattr(exc, "status", None) not in (401, 403):
            raise
        line = f"not readable ({exc.status}): no permission to get ConfigMaps"
    print(f"ConfigMap {args.experiment_configmap}: {line}", file=out)
    if args.httproute:
        route = rollout.cluster.get(HTTPROUTE_API, args.httproute)
        backends = get(route, "spec", "rules", default=[])[weighted_rule(route)]["backendRefs"]
        print(f"HTTPRoute {rollout.cluster.namespace}/{args.httproute}: " +
              ", ".join(f"{backend_arm(b)}={b.get('weight', 1)}% ({b.get('name')})" for b in backends), file=out)
    return DRIFT if state.drift else DONE


def _ab(cluster, args, out) -> int:
    if args.weights is not None and not args.httproute:
        raise RolloutError("--weights: name the cross-pod A/B route with --httproute NAME")
    if args.httproute and args.weights is None:
        raise RolloutError("--httproute: give its --weights (the in-server experiment takes --set / --shadow)")
    if (args.clear or args.weights is not None) and (args.shadow or args.name or args.salt):
        raise RolloutError(f"{'--clear' if args.clear else '--weights'} takes no --shadow, --name or --salt")
    if args.weights is not None:  # the cross-pod overlay: the HTTPRoute's split
        route = cluster.get(HTTPROUTE_API, args.httproute)
        plan = plan_route_weights(route, parse_weights(args.weights))
        if plan.changed and not args.dry_run:
            cluster.patch(HTTPROUTE_API, args.httproute, plan.patch)
        _print_plan(plan, [], out, args.dry_run)
        return DONE
    # The in-server experiment: the ConfigMap every pod of the InferenceService reads.
    configmap = cluster.configmap(args.experiment_configmap)
    registry = cluster.registry(args.versions_configmap)
    if args.clear:
        exp = None
    else:
        exp = experiments.build(args.name, args.set, args.shadow, args.salt,
                                current=experiments.read(configmap, strict=False))
    isvc = None if args.skip_preflight or exp is None else cluster.get(ISVC_API, args.isvc)
    plan = experiments.plan_experiment(configmap, exp, registry, isvc, cluster.namespace, args.experiment_configmap)
    if plan.changed and not args.dry_run:
        cluster.apply_configmap(plan.patch)
    _print_plan(plan, ["the pods read it within about a minute (the kubelet's ConfigMap refresh)"]
                if plan.changed else [], out, args.dry_run)
    return DONE


def _version_set(cluster, args, out) -> int:
    from cubeserve.rollout.version_sets import publish_version_set, set_uri

    registry = cluster.registry(args.versions_configmap)
    versions = [v.strip() for v in args.versions.split(",") if v.strip()]
    uri = set_uri(registry, versions)
    if args.dry_run:
        print(f"would write versions {', '.join(versions)} to {uri}\ndry run: nothing was changed", file=out)
        return DONE
    from cubeserve.storage import StorageError

    try:
        print(publish_version_set(registry, versions), file=out)
    except StorageError as exc:  # the model store, not the cluster: reported as briefly
        print(f"error: {exc}", file=sys.stderr)
        return API_ERROR
    return DONE


def _change(rollout: Rollout, args, out) -> int:
    command = args.rollout_command
    kwargs = dict(version=args.version, percent=args.percent) if command == "canary" else dict(force=args.force)

    def waiting(exc: NotReady, seconds: float) -> None:
        print(f"waiting: {exc}", file=out, flush=True)
        time.sleep(seconds)

    rollout.run_until_done(command, wait=getattr(args, "wait", 0) or 0, dry_run=args.dry_run,
                           on_plan=lambda plan, notes: _print_plan(plan, notes, out, args.dry_run),
                           on_wait=waiting, **kwargs)
    return DONE


def _api_message(exc: Exception) -> str:
    """The API server's own words: the `message` of the Status in the response body (e.g. which
    field strict field validation refused), which the client's exception text leaves out."""
    try:
        message = str(json.loads(getattr(exc, "body", None) or "{}").get("message") or "")
    except (ValueError, AttributeError, TypeError):
        return ""
    # A patch refused by strict field validation is quoted whole ('"" is invalid: patch: Invalid
    # value: "{...the object...}": strict decoding error: unknown field "spec.canary"'): its
    # verdict is the end.
    return message.rpartition('": ')[2] if len(message) > 500 and '": ' in message else message


def run_rollout(args, out=None) -> int:
    """The `cubeserve rollout` handler. Exit codes: 0 done (or nothing to do), 1 Kubernetes API
    error, 2 refused, 3 not ready yet, 4 (status) drift found."""
    out = out or sys.stdout
    try:
        cluster = cluster_factory(namespace=args.namespace, context=args.context)
        if args.rollout_command == "ab":
            return _ab(cluster, args, out)
        if args.rollout_command == "version-set":
            return _version_set(cluster, args, out)
        rollout = Rollout(cluster, args.isvc, args.versions_configmap, None if args.mode == "auto" else args.mode,
                          args.kserve_namespace, not getattr(args, "skip_preflight", False))
        if args.rollout_command == "status":
            return _status(rollout, args, out)
        return _change(rollout, args, out)
    except NotReady as exc:
        print(f"not ready: {exc}", file=sys.stderr)
        return NOT_READY
    except RolloutError as exc:
        print(f"refused: {exc}", file=sys.stderr)
        return REFUSED
    except Exception as exc:  # noqa: BLE001 - the kubernetes client's errors, reported briefly
        if type(exc).__name__ != "ApiException" and type(exc).__module__.split(".")[0] not in ("kubernetes", "urllib3"):
            raise
        status = getattr(exc, "status", None)
        message = _api_message(exc)
        print(f"error: {type(exc).__name__}: {' '.join(str(p) for p in (status, getattr(exc, 'reason', None) or exc) if p)}"
              + (f": {message}" if message else ""), file=sys.stderr)
        if status == 409:
            print("the object changed while this command ran: run it again (if it persists, another field "
                  "manager owns a field this command writes: see the object's metadata.managedFields)",
                  file=sys.stderr)
        return API_ERROR


# `analyze` (the promotion gate): 0 pass, 1 fail (or Prometheus could not answer: never a pass),
# 2 a bad threshold or window, 3 not enough data yet (as NOT_READY: ask again later).
GATE_PASSED, GATE_FAILED, NOT_ENOUGH_DATA = DONE, 1, NOT_READY


def run_analyze(args, out=None) -> int:
    """The `cubeserve rollout analyze` handler: the gate's figures and verdict."""
    from cubeserve.rollout import analyze

    out = out or sys.stdout
    try:
        thresholds = analyze.Thresholds(**{name: getattr(args, name) for name in analyze.Thresholds.names()})
        window = analyze.parse_window(args.window)
        result = analyze.analyze(args.prometheus, args.candidate, args.baseline, window, thresholds,
                                 selector=args.selector)
    except ValueError as exc:
        print(f"refused: {exc}", file=sys.stderr)
        return REFUSED
    except analyze.PrometheusError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return GATE_FAILED
    print(json.dumps(result.to_dict(), indent=2) if args.json else result.report(), file=out)
    return {analyze.PASS: GATE_PASSED, analyze.FAIL: GATE_FAILED}.get(result.result, NOT_ENOUGH_DATA)


def _limit(text: str) -> float | None:
    """A threshold, or "none" / "off" for no check."""
    return None if text.strip().lower() in ("none", "off") else float(text)


def _shown(limit) -> str:
    return "off" if limit is None else f"{limit:g}"


def _add_analyze_parser(sub) -> None:
    from cubeserve.rollout.analyze import Thresholds

    defaults = Thresholds()
    a = sub.add_parser(
        "analyze", help="the promotion gate: candidate against baseline from Prometheus",
        description="Compare a candidate checkpoint version with the baseline over a window of Prometheus "
                    "data (error rate, latency, time per token, meshes, shadow agreement). Exit codes: 0 pass, "
                    "1 fail or Prometheus error, 2 bad arguments, 3 not enough data.")
    a.add_argument("--prometheus", required=True, metavar="URL", help="Prometheus, e.g. http://prometheus:9090")
    a.add_argument("--candidate", required=True, help="checkpoint version under test")
    a.add_argument("--baseline", help="checkpoint version to compare with (none: absolute limits only)")
    a.add_argument("--window", default="5m", help="how far back to look: 30s, 5m, 1h (default: %(default)s)")
    a.add_argument("--selector", default="", help='more label matchers, e.g. namespace="models"')
    a.add_argument("--json", action="store_true", help="the analysis as JSON")
    help_of = {"min_requests": "fewer answers per version in the window: not enough data",
               "max_error_rate": "most (failed + unavailable) / answered",
               "max_error_rate_increase": "most error rate above the baseline's",
               "max_p95_seconds": "most p95 latency of successful requests",
               "max_p95_ratio": "most p95 latency as a multiple of the baseline's",
               "max_time_per_token_ratio": "most p95 time per output token as a multiple of the baseline's",
               "max_empty_mesh_rate": "most share of empty meshes",
               "max_not_watertight_rate": "most share of meshes that are not watertight",
               "min_shadow_agreement": "least mean agreement of shadow answers (when a shadow ran)"}
    for name, text in help_of.items():
        kind = int if name == "min_requests" else _limit
        a.add_argument("--" + name.replace("_", "-"), dest=name, type=kind, default=getattr(defaults, name),
                       help=f"{text} (default: {_shown(getattr(defaults, name))}"
                            f"{'' if name == 'min_requests' else '; off: not checked'})")
    a.set_defaults(func=run_analyze)


def add_rollout_parser(subparsers) -> argparse.ArgumentParser:
    """Add `rollout` to a `cubeserve` subparsers object; the handler is `args.func`."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("-n", "--namespace", help="namespace (default: the kubeconfig context's)")
    common.add_argument("--context", help="kubeconfig context")
    common.add_argument("--isvc", default=DEFAULT_ISVC, help="InferenceService name (default: %(default)s)")
    common.add_argument("--versions-configmap", default=VERSIONS_CONFIGMAP,
                        help="ConfigMap listing the known versions (default: %(default)s)")
    common.add_argument("--mode", choices=["auto", "serverless", "raw"], default="auto",
                        help="deployment mode (default: from the InferenceService)")
    common.add_argument("--kserve-namespace", default="kserve",
                        help="namespace of KServe's inferenceservice-config (default: %(default)s)")
    common.add_argument("--experiment-configmap", default=experiments.EXPERIMENT_CONFIGMAP,
                        help="ConfigMap holding the in-server experiment (default: %(default)s)")
    changing = argparse.ArgumentParser(add_help=False)
    changing.add_argument("--dry-run", action="store_true", help="print the change, do not patch")
    changing.add_argument("--skip-preflight", action="store_true",
                          help="do not check the cluster's CRD, runtime and ingress before patching")

    p = subparsers.add_parser(
        "rollout", help="canary / promote / rollback / A-B on the KServe InferenceService",
        description="Roll checkpoint versions out on KServe (see docs/deploy/). "
                    "Version V is the model repository at <baseUri>/<V>/ of the ConfigMap cube3d-versions.")
    sub = p.add_subparsers(dest="rollout_command", required=True)
    s = sub.add_parser("status", parents=[common], help="stable version, canary, traffic, drift")
    s.add_argument("--httproute", help="also show this HTTPRoute's A/B weights (k8s/overlays/ab)")
    s.add_argument("--json", action="store_true", help="the rollout state as JSON")
    c = sub.add_parser("canary", parents=[common, changing], help="start a canary, or change its share")
    c.add_argument("--version", required=True, help="checkpoint version to roll out")
    c.add_argument("--percent", required=True, type=int, help="share of the traffic, 0..100")
    for action, text in (("promote", "give the canary all the traffic and make it stable"),
                         ("rollback", "send all the traffic back to the stable version")):
        a = sub.add_parser(action, parents=[common, changing], help=text)
        a.add_argument("--wait", type=float, default=0, metavar="SECONDS",
                       help="wait up to this long for KServe to make the new revision ready")
        a.add_argument("--force", action="store_true", help="do not check readiness")
    ab = sub.add_parser(
        "ab", parents=[common, changing], help="set the in-server A/B experiment and shadow, or the A/B route's weights",
        description="In-server experiment (sticky per user, every pod of --isvc): --set and/or --shadow, "
                    "or --clear; written to the ConfigMap --experiment-configmap. Cross-pod A/B "
                    "(k8s/overlays/ab): --weights with --httproute.")
    what = ab.add_mutually_exclusive_group()
    what.add_argument("--set", metavar="ARMS", help="the arms, NAME=VERSION:WEIGHT, e.g. control=1:90,candidate=2:10")
    what.add_argument("--clear", action="store_true", help="end the experiment (arms and shadow)")
    what.add_argument("--weights", help="the HTTPRoute's split by arm, adding up to 100, e.g. a=80,b=20 "
                                        "(needs --httproute)")
    ab.add_argument("--shadow", metavar="VERSION:SHARE[:MAX]",
                    help="also copy SHARE (0..1) of the requests to VERSION, never answered from it, e.g. 3:0.25")
    ab.add_argument("--name", help="the experiment's name (default: the running experiment's; salts the users' hash)")
    ab.add_argument("--salt", help="the users' hash salt (default: the name); a new salt reshuffles users")
    ab.add_argument("--httproute", help="the cross-pod A/B overlay's HTTPRoute (for --weights)")
    v = sub.add_parser("version-set", parents=[common, changing],
                       help="write the model repository of several versions (for an in-server experiment)",
                       description="Download versions V1, V2, ... from the registry's store, write them as one "
                                   "Triton model repository at <baseUri>/sets/<V1>-<V2>-.../ and print that URI: "
                                   "the storageUri of an InferenceService whose pods load them all. Uses the "
                                   "storage credentials of the environment (AWS_ACCESS_KEY_ID, S3_ENDPOINT, ...).")
    v.add_argument("--versions", required=True, help="two or more registry versions, e.g. 1,2")
    _add_analyze_parser(sub)
    p.set_defaults(func=run_rollout)
    return p


def main(argv: list[str] | None = None) -> int:
    """`python -m cubeserve.rollout ...`, the same as `cubeserve rollout ...`."""
    parser = argparse.ArgumentParser(prog="cubeserve")
    add_rollout_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)
