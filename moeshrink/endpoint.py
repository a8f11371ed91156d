"""The consumer's side of a build's server: wait for its endpoint file, then talk to it.

A consumer starts together with the service job (Snakemake runs a service group at once), so it
waits until the endpoint says `ready` or `failed`. Once serving, a request that fails because the
server has gone names the build and the server's log instead of a bare connection error.
"""
from __future__ import annotations

import os
import time
from pathlib import Path

from moeshrink.errors import MoeshrinkError
from moeshrink.ioutil import read_json
from moeshrink.vllm_server import ServerClient, log_tail


class EndpointError(MoeshrinkError, RuntimeError):
    pass


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class Endpoint(ServerClient):
    def __init__(self, record: dict):
        super().__init__(record["base_url"], record["api_key"])
        self.record = record
        self.build = record["build"]
        self.model = record["served_model_name"]
        self.log = Path(record["log"])

    def alive(self) -> bool:
        return _alive(int(self.record["server_pid"]))

    def request(self, method: str, path: str, body: dict | None = None, timeout: float = 600) -> tuple[int, dict]:
        try:
            return super().request(method, path, body, timeout)
        except OSError as error:
            if not self.alive():
                raise EndpointError(f"the vLLM server of build {self.build!r} died during the request to {path}; "
                                    f"last lines of {self.log}:\n{log_tail(self.log, 50)}") from error
            raise

    def get_text(self, path: str, timeout: float = 30) -> str:
        try:
            return super().get_text(path, timeout)
        except OSError as error:
            if not self.alive():
                raise EndpointError(f"the vLLM server of build {self.build!r} is gone; "
                                    f"last lines of {self.log}:\n{log_tail(self.log, 50)}") from error
            raise


def _read(path: Path) -> dict | None:
    try:
        return read_json(path)
    except (OSError, ValueError):  # not there yet, or being written by the shell
        return None


def wait_for_endpoint(path: Path, timeout_s: float, poll_s: float = 2, grace_s: float = 15,
                      appear_s: float = 30) -> Endpoint:
    """The build's server once it answers. The serve job writes `starting` at once (Snakemake wants a
    service's output to exist within its latency wait), then `ready` or `failed`. Fails within
    seconds, naming the cause, when the endpoint file disappears after it was seen (Snakemake
    removes a service's output when it ends the build's group, e.g. because another job of the
    group failed), when no serve job writes it within `appear_s`, and when its supervisor or server
    is gone (a supervisor gone within `grace_s` may be an earlier run's file about to be replaced)."""
    started = time.time()
    build = path.parent.name
    seen = False
    while time.time() - started < timeout_s:
        record = _read(path)
        if record is None:
            if seen and not path.exists():
                raise EndpointError(f"build {build!r}: {path} disappeared while waiting for the server: its serve "
                                    f"job has ended (Snakemake ends a build's service group when one of its jobs "
                                    f"fails; see the logs of the build's other jobs)")
            if not path.exists() and time.time() - started > appear_s:
                raise EndpointError(f"build {build!r}: no serve job wrote {path} within {appear_s:.0f} s")
        else:
            seen = True
            if record.get("state") == "failed":
                raise EndpointError(f"{build}: the server could not start. Likely cause: "
                                    f"{record['likely_cause']}\n{record['error']}\nlast lines of {record['log']}:\n"
                                    f"{record['log_tail']}")
            supervisor_alive = _alive(int(record.get("supervisor_pid", 0)))
            if record.get("state") == "ready" and supervisor_alive:
                endpoint = Endpoint(record)
                if endpoint.ready():
                    return endpoint
                if not endpoint.alive():
                    raise EndpointError(f"build {build!r}: {path}: the server (pid {record['server_pid']}) is gone; "
                                        f"last lines of {endpoint.log}:\n{log_tail(endpoint.log, 50)}")
            elif not supervisor_alive and time.time() - started > grace_s:
                log = Path(record.get("log", path.parent / "server.log"))
                raise EndpointError(f"build {build!r}: {path}: the serve job (pid {record.get('supervisor_pid')}) "
                                    f"ended without a server; last lines of {log}:\n{log_tail(log, 50)}")
        time.sleep(poll_s)
    raise EndpointError(f"build {build!r}: {path}: no server answered within {timeout_s:.0f} s "
                        f"(serve.startup_timeout_s)")
