"""Pipeline runs that overlap (cubeserve/pipeline/leases.py): version numbers are claimed by a
conditional create, one roll-out at a time holds the lease, and an exit handler changes what is
served only while its run holds it.

The S3 store here is moto's server, which honours S3's conditional writes (If-None-Match: * and
If-Match, answering 412 PreconditionFailed as AWS S3 and MinIO do); rclone's `serve s3`, the
store of `make pipeline`, ignores them (rclone issue #8566), and the probe says so. Runs "started
together" are separate processes released at the same moment."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cubeserve import storage
from cubeserve.pipeline import leases
from cubeserve.pipeline.serving import finish_run
from cubeserve.registry import CHALLENGER, CHAMPION, embedded_uri, open_registry
from cubeserve.server.local_triton import free_port

REPO = Path(__file__).resolve().parents[1]
BUCKET = "models"


@pytest.fixture(scope="module")
def moto_env():
    from moto.server import ThreadedMotoServer

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    env = {"AWS_ACCESS_KEY_ID": "moto", "AWS_SECRET_ACCESS_KEY": "moto-secret",
           "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}", "AWS_DEFAULT_REGION": "us-east-1"}
    try:
        import boto3

        boto3.client("s3", endpoint_url=env["AWS_ENDPOINT_URL"], region_name="us-east-1",
                     aws_access_key_id="moto", aws_secret_access_key="moto-secret").create_bucket(Bucket=BUCKET)
        yield env
    finally:
        server.stop()


@pytest.fixture
def s3_store(moto_env, monkeypatch, request):
    for key, value in moto_env.items():
        monkeypatch.setenv(key, value)
    return f"s3://{BUCKET}/{request.node.name.replace('[', '-').rstrip(']')}"


@pytest.fixture(params=["s3", "local"])
def store(request, tmp_path):
    return request.getfixturevalue("s3_store") if request.param == "s3" else str(tmp_path / "store")


def test_conditional_writes(store):
    uri = storage.join(store, "object.json")
    etag = storage.write_if(uri, "one", None)
    with pytest.raises(storage.PreconditionFailed, match="exists already"):
        storage.write_if(uri, "two", None)  # the second creator loses
    assert storage.read_versioned(uri) == ("one", etag)
    new = storage.write_if(uri, "three", etag)
    with pytest.raises(storage.PreconditionFailed, match="changed since it was read"):
        storage.write_if(uri, "four", etag)  # a stale read loses
    assert storage.read_versioned(uri) == ("three", new) and storage.honours_conditional_writes(store)


def test_rclone_serve_s3_ignores_conditional_writes(tmp_path, monkeypatch):
    """What `make pipeline` runs on: the probe finds out, and the steps say that overlapping runs
    are not protected there (docs/pipeline.md)."""
    from kfp_pipelines.local_services import ObjectStore

    with ObjectStore(tmp_path / "s3") as rclone:
        for key, value in rclone.env().items():
            monkeypatch.setenv(key, value)
        rclone.create_bucket("bucket")
        assert storage.honours_conditional_writes("s3://bucket/models") is False
        assert leases.unprotected_warning("s3://bucket/models").startswith("warning: the store s3://bucket/models")


def test_a_version_number_is_claimed_once(store):
    first = leases.claim_version(store, 1, {"sha256": "a"})
    second = leases.claim_version(store, 1, {"sha256": "b"})  # listed the store before the first claim
    assert (first, second) == (1, 2)
    assert json.loads(storage.read_text(leases.claim_uri(store, 2)))["sha256"] == "b"


def _together(script: str, runs: int, env: dict, tmp_path: Path) -> list[str]:
    """`runs` processes of `script` released at one moment (a file they wait for); their outputs."""
    go = tmp_path / "go"
    code = f"import os, time\nwhile not os.path.exists({str(go)!r}): time.sleep(0.005)\n" + script
    procs = [subprocess.Popen([sys.executable, "-c", code, str(i)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env={**os.environ, **env, "PYTHONPATH": str(REPO)}) for i in range(runs)]
    time.sleep(3)  # every process imported and waiting
    go.touch()
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
        outs.append(out.strip())
    return outs


def test_runs_started_together_get_different_versions(s3_store, moto_env, tmp_path):
    script = ("import sys\nfrom cubeserve.pipeline.leases import claim_version\n"
              f"print(claim_version({s3_store!r}, 1, {{'run': sys.argv[1]}}))\n")
    assert sorted(map(int, _together(script, 4, moto_env, tmp_path))) == [1, 2, 3, 4]


def test_one_roll_out_at_a_time(store):
    lease = leases.acquire(store, "run-a", "2", 600)
    assert lease.owner == "run-a" and leases.holds(store, "run-a")
    with pytest.raises(leases.LeaseHeld, match="pipeline run run-a holds it \\(version 2\\) until 20"):
        leases.acquire(store, "run-b", "3", 600)
    leases.acquire(store, "run-a", "2", 600)  # renewing one's own lease
    assert leases.release(store, "run-b") is False and leases.holds(store, "run-a")  # not b's to give back
    assert leases.release(store, "run-a") is True and not leases.holds(store, "run-a")
    assert leases.acquire(store, "run-b", "3", 0.2).owner == "run-b"
    time.sleep(0.3)  # expired: a run that died without its exit handler does not block others forever
    assert leases.acquire(store, "run-c", "4", 600).owner == "run-c"
    assert leases.release(store, "run-b") is False and leases.holds(store, "run-c")


def test_roll_outs_started_together_one_wins(s3_store, moto_env, tmp_path):
    script = ("import sys\nfrom cubeserve.pipeline import leases\n"
              "try:\n"
              f"    leases.acquire({s3_store!r}, 'run-' + sys.argv[1], '1', 600)\n"
              "    print('won')\n"
              "except leases.LeaseHeld as exc:\n"
              "    print('refused')\n")
    assert sorted(_together(script, 4, moto_env, tmp_path)) == ["refused", "refused", "refused", "won"]


@pytest.fixture
def registry_with_challenger(tmp_path):
    registry = open_registry(embedded_uri(tmp_path / "registry"), "cube3d")
    champion = registry.create("s3://models/m/1/", {"sha256": "a", "triton_version": "1"})
    registry.set_alias(CHAMPION, champion.version)
    new = registry.create("s3://models/m/2/", {"sha256": "b", "triton_version": "2",
                                               "rollout.pipeline_run_id": "run-a"})
    registry.set_alias(CHALLENGER, new.version)
    return registry


def test_an_exit_handler_leaves_serving_alone_once_another_run_holds_the_roll_out(store, registry_with_challenger):
    """Run a's lease expired and run b took the roll-out over: a's exit handler must not unload
    what b serves (a server that is not there would make it fail loudly if it tried)."""
    registry = registry_with_challenger
    leases.acquire(store, "run-b", "3", 600)
    outcome = finish_run("RUNNING", "", registry.uri, "cube3d", "run-a", "local", triton_url="127.0.0.1:9",
                         model_store=store)
    assert "was this run's challenger, but the roll-out is no longer this run's" in outcome, outcome
    assert "pipeline run run-b holds it" in outcome and "could not restore" not in outcome
    assert registry.by_alias(CHALLENGER).version == "2" and leases.holds(store, "run-b")


def test_an_exit_handler_that_holds_the_roll_out_reverts_and_releases_it(store, registry_with_challenger):
    registry = registry_with_challenger
    leases.acquire(store, "run-a", "2", 600)
    outcome = finish_run("RUNNING", "", registry.uri, "cube3d", "run-a", "local", triton_url="127.0.0.1:9",
                         model_store=store)
    # It tried to put the champion back (no server here: reported) and cleared its challenger.
    assert "could not restore the champion's serving" in outcome and "roll-out lease released" in outcome
    assert registry.by_alias(CHALLENGER) is None and registry.get(2).tags["rollout.decision"] == "failed"
    assert not leases.holds(store, "run-a")
