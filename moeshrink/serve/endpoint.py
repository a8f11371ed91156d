"""The lessee's side of a build's server: wait for its record to say `ready`, then talk to it.

A job that has leased its build's server (moeshrink.serve.server_lease) waits here until the supervisor's
record says `ready`, `failed` or `stopped`. Once serving, a request that fails because the server has
gone names the build and the server's log instead of a bare connection error.
"""
from __future__ import annotations

import time
from pathlib import Path

from moeshrink.core.errors import MoeshrinkError
from moeshrink.core.ioutil import read_json
from moeshrink.serve.vllm_server import ServerClient, alive, log_tail


class EndpointError(MoeshrinkError, RuntimeError):
    pass


class Endpoint(ServerClient):
    def __init__(self, record: dict):
        super().__init__(record["base_url"], record["api_key"])
        self.record = record
        self.build = record["build"]
        self.model = record["served_model_name"]
        self.log = Path(record["log"])

    def alive(self) -> bool:
        return alive(int(self.record["server_pid"]))

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


def read_record(path: Path) -> dict | None:
    try:
        return read_json(path)
    except (OSError, ValueError):
        return None


def wait_for_endpoint(path: Path, timeout_s: float, poll_s: float = 2) -> Endpoint:
    """The build's server once it answers. While its supervisor waits for a machine slot (`queued`) no
    time is counted; from `starting` on, it has `timeout_s`. Fails within seconds, naming the cause,
    when the server could not start (`failed`), was stopped, or its supervisor is gone."""
    build = path.parent.name
    deadline = None
    while True:
        record = read_record(path)
        if record is None:
            raise EndpointError(f"build {build!r}: {path} is missing: no supervisor serves this build")
        if not alive(int(record.get("supervisor_pid", 0))):
            record = read_record(path) or record  # it may have said why just before it exited
        state = record.get("state")
        if state == "failed":
            raise EndpointError(f"{build}: the server could not start. Likely cause: "
                                f"{record['likely_cause']}\n{record['error']}\nlast lines of {record['log']}:\n"
                                f"{record['log_tail']}")
        if state == "stopped":
            raise EndpointError(f"build {build!r}: its server was stopped ({record.get('stop_reason')}); last lines "
                                f"of {record['log']}:\n{log_tail(Path(record['log']), 50)}")
        if not alive(int(record.get("supervisor_pid", 0))):
            supervisor_log = Path(record.get("supervisor_log", path.parent / "supervisor.log"))
            raise EndpointError(f"build {build!r}: {path}: its supervisor (pid {record.get('supervisor_pid')}) ended "
                                f"without a server; last lines of {supervisor_log}:\n{log_tail(supervisor_log, 50)}")
        if state != "queued":
            deadline = deadline or time.time() + timeout_s
        if state == "ready":
            endpoint = Endpoint(record)
            if endpoint.ready():
                return endpoint
            if not endpoint.alive():
                raise EndpointError(f"build {build!r}: {path}: the server (pid {record['server_pid']}) is gone; "
                                    f"last lines of {endpoint.log}:\n{log_tail(endpoint.log, 50)}")
        if deadline is not None and time.time() > deadline:
            raise EndpointError(f"build {build!r}: {path}: no server answered within {timeout_s:.0f} s "
                                f"(serve.startup_timeout_s)")
        time.sleep(poll_s)
