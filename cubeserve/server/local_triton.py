"""Run the real Triton Inference Server that ships in the `nvidia-pytriton` wheel, on
127.0.0.1, with this project's model repository: for `make serve`, `make demo` and the tests.

The wheel carries `tritonserver` and the python backend; the backend's stub for this Python
version must sit next to the backend once, and the stub finds packages through the `python3`
first on PATH (it ignores PYTHONPATH), so the running interpreter's `bin` goes first.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import time
import urllib.error
import urllib.request
from pathlib import Path

from cubeserve import deploy
from cubeserve.lifetime import ends_with_this_process
from cubeserve.serving.repository import MODEL_REPOSITORY, with_string_parameters
from cubeserve.serving.stubs import children, process_tree

REPO_ROOT = Path(__file__).resolve().parents[2]
# The trained demo checkpoint shipped with the project (`make demo-model` rebuilds it).
DEMO_MODEL = REPO_ROOT / "models" / "demo"


def tritonserver_home() -> Path:
    try:
        import pytriton
    except ImportError as exc:
        raise RuntimeError("Triton is not installed: pip install 'nvidia-pytriton==0.7.0'") from exc
    return Path(pytriton.__file__).parent / "tritonserver"


def prepare_python_backend(home: Path) -> None:
    """Put the python backend stub for this Python next to the backend (once)."""
    target = home / "backends" / "python" / "triton_python_backend_stub"
    if not target.exists():
        version = f"{sys.version_info.major}.{sys.version_info.minor}"
        source = home / "python_backend_stubs" / version / "triton_python_backend_stub"
        if not source.exists():
            raise RuntimeError(f"the Triton wheel has no python backend stub for Python {version}")
        shutil.copy2(source, target)


def _cmdline(pid: int) -> bytes | None:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return None


# "LOW-HIGH": free_port() picks in this range instead of asking the kernel. The tests' parallel
# workers each get a range of their own below the kernel's ephemeral ports (tests/conftest.py):
# with the kernel's pick, two workers could be handed one port between one's pick and its bind.
PORT_RANGE_ENV = "CUBESERVE_PORT_RANGE"
_next_port = [None]


def free_port() -> int:
    """A port on 127.0.0.1 that nothing listens on now (for a server about to start)."""
    span = os.environ.get(PORT_RANGE_ENV)
    if not span:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]
    low, high = (int(p) for p in span.split("-"))
    if _next_port[0] is None:  # each process from its own place (a child may pick while its parent does)
        _next_port[0] = random.randrange(high - low + 1)
    for _ in range(high - low + 1):  # in turn through the range: a port given out is not reused soon
        port = low + _next_port[0] % (high - low + 1)
        _next_port[0] += 1
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
                return port
            except OSError:
                continue
    raise RuntimeError(f"no free port in ${PORT_RANGE_ENV}={span}")


# Set by tests/conftest.py: every server started here keeps a log, in this folder unless it is
# given one (which the folder then links to), so that the run can count the crashes they show.
SERVER_LOGS_ENV = "CUBESERVE_SERVER_LOGS"


class LocalTriton:
    """A tritonserver bound to 127.0.0.1 under cubeserve's supervisor (`process`; tritonserver is
    its child), stopped by its PID, as a pod runs it: clients reach the supervisor's front ends
    on `http_port` (REST) and `grpc_port`, tritonserver's own endpoints are `triton_http_port` and
    `triton_grpc_port`, and the admin APIs need `admin_headers` (HTTP) or `grpc_admin_headers`
    (gRPC metadata).

    `supervised`: the supervisor also starts tritonserver again when a python backend stub dies,
    giving the other requests `fault_grace` seconds to finish first; `on_fault="exit"` makes it
    exit instead, as in a container; unsupervised, a dead stub is left to the models (the
    supervisor's --on-fault none). `drained_grace`: see the supervisor's --drained-grace.
    `admin_key`: default $CUBE3D_ADMIN_KEY, else a new one for this server; `admin_key_file`: where
    the supervisor writes it while the server runs. `supervisor_args`: more of the supervisor's
    flags (e.g. its front ends' limits)."""

    def __init__(self, model_repository: str | Path = MODEL_REPOSITORY, http_port: int = deploy.HTTP_PORT,
                 grpc_port: int = deploy.GRPC_PORT, metrics_port: int = deploy.METRICS_PORT,
                 log_path: str | Path | None = None,
                 extra_args: tuple[str, ...] = (), verbose: bool = False, supervised: bool = False,
                 fault_grace: float = 10.0, on_fault: str = "restart", drained_grace: float | None = None,
                 env: dict[str, str] | None = None, triton_http_port: int | None = None,
                 admin_key: str | None = None, admin_key_file: str | Path | None = None,
                 supervisor_args: tuple[str, ...] = (), triton_grpc_port: int | None = None):
        self.model_repository = Path(model_repository)
        self.extra_env = dict(env or {})  # e.g. CUBE3D_EXPERIMENT_FILE
        self.http_port, self.grpc_port, self.metrics_port = http_port, grpc_port, metrics_port
        if triton_http_port is None:
            triton_http_port = deploy.TRITON_HTTP_PORT if http_port == deploy.HTTP_PORT else free_port()
        self.triton_http_port = triton_http_port
        if triton_grpc_port is None:
            triton_grpc_port = deploy.TRITON_GRPC_PORT if grpc_port == deploy.GRPC_PORT else free_port()
        self.triton_grpc_port = triton_grpc_port
        self.admin_key_file = Path(admin_key_file) if admin_key_file else None
        self.supervisor_args = tuple(supervisor_args)
        self.admin_key = deploy.check_admin_key(admin_key or os.environ.get(deploy.ADMIN_KEY_ENV)
                                                or deploy.new_admin_key())
        self.log_path = Path(log_path) if log_path else None
        self.extra_args = tuple(extra_args)
        self.verbose = verbose
        self.supervised, self.fault_grace, self.on_fault = supervised, fault_grace, on_fault
        self.drained_grace = drained_grace  # None: the supervisor's default
        self.process: subprocess.Popen | None = None
        self._log_file = None

    @property
    def http_url(self) -> str:
        return f"127.0.0.1:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}/metrics"

    @property
    def admin_headers(self) -> dict[str, str]:
        return {deploy.ADMIN_HEADER: self.admin_key}

    @property
    def grpc_admin_headers(self) -> dict[str, str]:
        return {deploy.GRPC_ADMIN_METADATA: self.admin_key}

    def tritonserver_pid(self) -> int:
        """The tritonserver process: the supervisor's one child (its stubs are tritonserver's)."""
        [pid] = children(self.process.pid)
        return pid

    def command(self) -> list[str]:
        grace = [] if self.drained_grace is None else ["--drained-grace", str(self.drained_grace)]
        key_file = [f"--admin-key-file={self.admin_key_file}"] if self.admin_key_file else []
        return [sys.executable, "-m", "cubeserve.server.supervisor",
                "--on-fault", self.on_fault if self.supervised else "none",
                "--fault-grace", str(self.fault_grace), *grace, *key_file, *self.supervisor_args,
                "--rest-address=127.0.0.1", f"--rest-port={self.http_port}",
                "--grpc-address=127.0.0.1", f"--grpc-port={self.grpc_port}", "--", *self.server_command()]

    def server_command(self) -> list[str]:
        home = tritonserver_home()
        return [
            str(home / "bin" / "tritonserver"),
            f"--model-repository={self.model_repository}",
            f"--backend-directory={home / 'backends'}",
            "--http-address=127.0.0.1", f"--http-port={self.triton_http_port}",
            "--grpc-address=127.0.0.1", f"--grpc-port={self.triton_grpc_port}",
            "--metrics-address=127.0.0.1", f"--metrics-port={self.metrics_port}",
            *deploy.COMMON_FLAGS,
            *self.extra_args,
        ]

    def environment(self) -> dict[str, str]:
        env = dict(os.environ)
        env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
        # The stub embeds libpython; prefer this interpreter's own library where it has one.
        libdir = sysconfig.get_config_var("LIBDIR")
        if libdir and Path(libdir).is_dir():
            env["LD_LIBRARY_PATH"] = os.pathsep.join(filter(None, [libdir, env.get("LD_LIBRARY_PATH")]))
        env.setdefault("HF_HUB_OFFLINE", "1")
        env.update(self.extra_env)
        env[deploy.ADMIN_KEY_ENV] = self.admin_key  # the supervisor locks the admin APIs with it
        return env

    def start(self, timeout: float = 300.0) -> "LocalTriton":
        prepare_python_backend(tritonserver_home())
        logs = os.environ.get(SERVER_LOGS_ENV)
        if logs:
            entry = Path(logs) / f"tritonserver-{os.getpid()}-{time.monotonic_ns()}.log"
            if self.log_path:
                entry.symlink_to(self.log_path.resolve())
            else:
                self.log_path = entry
        if self.log_path:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            self._log_file = open(self.log_path, "wb")
            out = self._log_file
        else:
            out = None if self.verbose else subprocess.DEVNULL
        self.process = subprocess.Popen(self.command(), env=self.environment(), stdout=out,
                                        stderr=subprocess.STDOUT if out is not None else None,
                                        preexec_fn=ends_with_this_process())
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"tritonserver exited with code {self.process.returncode}" + self._log_tail())
            if self.ready():
                return self
            time.sleep(0.25)
        self.stop()
        raise RuntimeError(f"tritonserver was not ready within {timeout:.0f} s" + self._log_tail())

    def ready(self) -> bool:
        """Ready, and its metrics answer: the metrics port can open after the REST one (a test
        reading metrics right after start found it closed, once in CI)."""
        try:
            with urllib.request.urlopen(f"http://{self.http_url}{deploy.READY_PATH}", timeout=2) as r:
                if r.status != 200:
                    return False
            with urllib.request.urlopen(self.metrics_url, timeout=2) as r:
                return r.status == 200
        except (urllib.error.URLError, ConnectionError, OSError):
            return False

    def stop(self, timeout: float = 60.0) -> None:
        """SIGTERM, then after `timeout` s SIGKILL to every process of the server. Triton waits up
        to its exit timeout (deploy.EXIT_TIMEOUT_S, longer than `timeout`) for requests still in
        flight, and the supervisor waits for Triton: killing only the supervisor would leave
        tritonserver and its stubs running."""
        if self.process is None or self.process.poll() is not None:
            return
        tree = {pid: _cmdline(pid) for pid in process_tree(self.process.pid)}
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            killed = []
            for pid, cmdline in tree.items():
                if cmdline and _cmdline(pid) == cmdline:  # still the same process
                    try:
                        os.kill(pid, signal.SIGKILL)
                        killed.append(pid)
                    except ProcessLookupError:
                        pass
            self.process.wait()
            self._say_killed(tree, killed, f"{timeout:g} s after SIGTERM")
        if self._log_file:
            self._log_file.close()

    def kill(self) -> None:
        """kill -9 of every process of the server at once, as a container's kill (its grace period
        over, an out-of-memory kill of the group)."""
        tree = {pid: _cmdline(pid) for pid in process_tree(self.process.pid)}
        self._say_killed(tree, list(tree), "with every process of it (kill -9)")  # first: a stub's crash comes after
        for pid in tree:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.process.wait()
        if self._log_file:
            self._log_file.close()

    def _say_killed(self, tree: dict, killed: list[int], how: str) -> None:
        """The supervisor, killed too, cannot say how tritonserver ended: this line in the server's
        log does (tests/stub_crashes.py reads it)."""
        if not self._log_file:
            return
        servers = [pid for pid in killed if os.path.basename(tree[pid].split(b"\0")[0]) == b"tritonserver"]
        now = time.time()
        stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(now)) + f",{int(now % 1 * 1000):03d}"
        self._log_file.write("".join(f"{stamp} cubeserve local server: tritonserver (pid {pid}) killed, {how}\n"
                                     for pid in servers).encode())
        self._log_file.flush()

    def _log_tail(self, lines: int = 30) -> str:
        if not self.log_path or not self.log_path.exists():
            return ""
        text = self.log_path.read_text(errors="replace").splitlines()[-lines:]
        return "\n--- tritonserver log (tail) ---\n" + "\n".join(text)

    def __enter__(self) -> "LocalTriton":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def copy_model_repository(target: Path, engine_parameters: dict | None = None) -> Path:
    """triton_models/ (both models' configs and code, no weights) copied into `target`, with
    string parameters of cube3d_stream/config.pbtxt set (e.g. {"max_objects": 1})."""
    target = Path(target)
    for model in (deploy.PREDICT_MODEL, deploy.STREAM_MODEL):
        shutil.copytree(MODEL_REPOSITORY / model, target / model, ignore=shutil.ignore_patterns("weights", "__pycache__"))
    config = target / deploy.STREAM_MODEL / "config.pbtxt"
    config.write_text(with_string_parameters(config.read_text(), engine_parameters or {}, config))
    return target


def ensure_demo_weights(model_repository: Path = MODEL_REPOSITORY, demo_model: Path = DEMO_MODEL) -> Path:
    """Give every `cube3d_stream` version directory without weights a copy of the demo model
    (tiny random weights where the demo model is absent, e.g. an installed package)."""
    from cubeserve.checkpoint import write_random_weights

    written = None
    for version_dir in sorted((model_repository / deploy.STREAM_MODEL).iterdir()):
        if version_dir.is_dir() and version_dir.name.isdigit() and not (version_dir / "weights").exists():
            written = version_dir / "weights"
            if (demo_model / "config.yaml").is_file():
                shutil.copytree(demo_model, written)
            else:
                write_random_weights("tiny", written, seed=int(version_dir.name) - 1)
    return written or model_repository / deploy.STREAM_MODEL
