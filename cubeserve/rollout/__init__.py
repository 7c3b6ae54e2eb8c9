"""`cubeserve rollout`: canary, promote, roll back and A/B-split cube-serve on KServe.

Every command is two steps. First a pure plan: the InferenceService as the API server returns
it, the checkpoint versions, and what its pods serve (the Knative revisions its status names, or
its predictor Deployments' ReplicaSets) go in; a `Plan` comes
out, holding one JSON merge patch (RFC 7386) and the fields it changes, or a `RolloutError`
saying why not. Then a thin client checks the cluster (preflight) and sends that patch with the
object's resourceVersion as a precondition and its own field manager.

    versions.py   checkpoint versions (the ConfigMap cube3d-versions)
    state.py      what the InferenceService is doing, from the status KServe writes
    plans.py      canary / promote / rollback as patches (Serverless and Raw strategies); the
                  cross-pod A/B route's weights
    experiments.py  the in-server experiment (arms, shadow) in the ConfigMap cube3d-experiment
    version_sets.py  one model repository holding several versions (for an experiment's pod)
    patch.py      JSON merge patches and their field-by-field description
    preflight.py  the cluster can take the patch (CRD fields, runtime, Gateway API)
    cluster.py    the Kubernetes API (Cluster) and one InferenceService on it (Rollout)
    analyze.py    the promotion gate: a candidate version against its baseline, from Prometheus
    cli.py        the command line
"""

from cubeserve.rollout.cli import add_rollout_parser, main, run_rollout
from cubeserve.rollout.cluster import HTTPROUTE_API, ISVC_API, Cluster, Rollout
from cubeserve.rollout.errors import NotReady, RolloutError
from cubeserve.rollout.patch import describe_changes, merge_patch
from cubeserve.rollout.plans import Plan, parse_weights, plan_route_weights, plan_canary, plan_promote, plan_rollback
from cubeserve.rollout.state import (CANARY, FIELD_MANAGER, RAW, ROLLING_BACK, SERVERLESS, STABLE, UPDATING,
                                     ReplicaSet, RolloutState, deployment_mode, replica_sets_of, rollout_state)
from cubeserve.rollout.versions import VERSIONS_CONFIGMAP, VersionRegistry, predictor_name

__all__ = ["add_rollout_parser", "main", "run_rollout", "HTTPROUTE_API", "ISVC_API", "Cluster", "Rollout",
           "NotReady", "RolloutError", "describe_changes", "merge_patch", "Plan", "parse_weights", "plan_route_weights",
           "plan_canary", "plan_promote", "plan_rollback", "CANARY", "FIELD_MANAGER", "RAW", "ROLLING_BACK",
           "SERVERLESS", "STABLE", "UPDATING", "ReplicaSet", "RolloutState", "replica_sets_of", "deployment_mode", "rollout_state",
           "VERSIONS_CONFIGMAP", "VersionRegistry", "predictor_name"]
