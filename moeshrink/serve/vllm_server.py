"""Start vLLM's OpenAI-compatible server on 127.0.0.1, wait until it answers, stop it cleanly.

The server runs in its own process group with its log in a file; stopping sends SIGTERM to the
whole group, then SIGKILL after a timeout, so no engine or worker process outlives it.
"""
from __future__ import annotations

import ctypes
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from moeshrink.core.errors import MoeshrinkError

# Thread counts a scheduler sets for its job (Snakemake sets them all to the job's `threads`). vLLM's
# CPU build pins its engine to cores of its own choosing and sizes torch's threads to them; an
# inherited larger count makes threads spin against each other on one core.
SCHEDULER_THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "GOTO_NUM_THREADS",
                         "VECLIB_MAXIMUM_THREADS", "NUMEXPR_NUM_THREADS")


class ServerError(MoeshrinkError, RuntimeError):
    pass


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def log_tail(path: Path, lines: int = 50) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def alive(pid: int) -> bool:
    """The process exists and is not a zombie waiting to be reaped (a supervisor that exited while the
    job that spawned it still runs is one)."""
    if pid <= 0:
        return False
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return sys.platform != "linux"  # no /proc entry on Linux: gone


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL it when the process that started it dies (Linux), so a
    killed supervisor cannot leave a server behind."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


class ServerClient:
    """Requests to a running OpenAI-compatible server with its API key."""

    def __init__(self, base_url: str, api_key: str):
        self.base_url = base_url
        self.api_key = api_key

    def request(self, method: str, path: str, body: dict | None = None, timeout: float = 600) -> tuple[int, dict]:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.base_url + path, data=data, method=method,
                                     headers={"Content-Type": "application/json",
                                              "Authorization": f"Bearer {self.api_key}"})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as response:
                return response.status, json.loads(response.read() or b"null")
        except urllib.error.HTTPError as error:
            return error.code, {"error": error.read().decode(errors="replace")}

    def get(self, path: str) -> tuple[int, dict]:
        return self.request("GET", path)

    def post(self, path: str, body: dict) -> tuple[int, dict]:
        return self.request("POST", path, body)

    def get_text(self, path: str, timeout: float = 30) -> str:
        with urllib.request.urlopen(self.base_url + path, timeout=timeout) as response:
            return response.read().decode(errors="replace")

    def ready(self) -> bool:
        try:
            with urllib.request.urlopen(self.base_url + "/health", timeout=5) as response:
                if response.status != 200:
                    return False
            return self.get("/v1/models")[0] == 200
        except (urllib.error.URLError, ConnectionError, OSError):
            return False


class VLLMServer(ServerClient):
    def __init__(self, model_dir: Path, log_path: Path, args: list[str] | None = None, env: dict | None = None,
                 startup_timeout_s: float = 900, served_name: str | None = None):
        self.model_dir = Path(model_dir)
        self.log_path = Path(log_path)
        self.args = args or []
        self.env = env or {}
        self.startup_timeout_s = startup_timeout_s
        self.served_name = served_name or self.model_dir.name
        self.port = free_port()
        super().__init__(f"http://127.0.0.1:{self.port}", secrets.token_hex(16))
        self.process: subprocess.Popen | None = None

    def command(self) -> list[str]:
        return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(self.model_dir),
                "--served-model-name", self.served_name, "--host", "127.0.0.1", "--port", str(self.port),
                "--api-key", self.api_key, *self.args]

    def start(self, abort=lambda: False) -> VLLMServer:
        """Start and wait until it answers; `abort()` returning True gives up (and stops it)."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "w")
        inherited = {k: v for k, v in os.environ.items() if k not in SCHEDULER_THREAD_VARS}
        self.process = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT,
                                        env={**inherited, **self.env}, start_new_session=True,
                                        preexec_fn=_die_with_parent)
        deadline = time.time() + self.startup_timeout_s
        while time.time() < deadline:
            if self.process.poll() is not None:
                raise ServerError(f"vLLM exited with code {self.process.returncode} while starting "
                                  f"{self.model_dir}; last lines of {self.log_path}:\n{log_tail(self.log_path)}")
            if self.ready():
                return self
            if abort():
                self.stop()
                raise ServerError(f"stopped while starting {self.model_dir} (the job was terminated)")
            time.sleep(2)
        self.stop()
        raise ServerError(f"vLLM did not answer /health within {self.startup_timeout_s:.0f} s; "
                          f"last lines of {self.log_path}:\n{log_tail(self.log_path)}")

    def stop(self, timeout_s: float = 30) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        group = os.getpgid(self.process.pid)
        os.killpg(group, signal.SIGTERM)
        try:
            self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(group, signal.SIGKILL)
            self.process.wait()
        # engine and worker processes share the group; make sure none is left
        try:
            os.killpg(group, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def __enter__(self) -> VLLMServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
