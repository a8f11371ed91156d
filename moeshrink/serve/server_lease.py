"""A build's vLLM server shared by reference: jobs lease it, the last release stops it.

What `results/serve/{build}/` holds while a server lives:
  server.lock      an flock: one process at a time reads or changes the records below
  endpoint.json    the supervisor's record: state (queued, starting, ready, failed, stopped), URL, key,
                   pids, and the fingerprint of the serve flags the server was started with
  leases/<pid>-<t> one file per job holding the server (pid and start time); a lease whose process is
                   gone counts for nothing
  server.pid.json  the vLLM process group, for stopping a server an earlier supervisor left
  starts.jsonl     one line per server start: when, which job started it

The first job to lease a build's server spawns its supervisor (`moeshrink serve`, in a session of its
own, so that the job's end does not end it); later jobs attach to it. The supervisor waits for a
machine slot (`serve.servers_per_machine`; the builds queue in config order, the reference first),
starts vLLM, and stops it once no live lease has been held for `serve.idle_grace_s`, so jobs that run
back to back reuse one server. A job killed mid-eval leaves a lease whose pid is dead, which counts for
nothing; a supervisor killed outright takes its server with it (PR_SET_PDEATHSIG) and leaves a record
the next lease replaces.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from moeshrink.core.errors import MoeshrinkError
from moeshrink.core.ioutil import atomic_write_json
from moeshrink.core.provenance import now_iso
from moeshrink.serve.endpoint import Endpoint, read_record, wait_for_endpoint
from moeshrink.serve.vllm_server import SCHEDULER_THREAD_VARS, alive

log = logging.getLogger("moeshrink.serve.supervisor")

LOCK_FILE = "server.lock"
ENDPOINT_FILE = "endpoint.json"
LEASES_DIR = "leases"
PID_FILE = "server.pid.json"
STARTS_FILE = "starts.jsonl"
SERVER_LOG = "server.log"
SUPERVISOR_LOG = "supervisor.log"
ACTIVE_STATES = ("queued", "starting", "ready")
SLOTS_ENV = "MOESHRINK_SERVER_SLOTS"
SETTLE_S = 3.0  # supervisors spawned together all queue before the first in line takes a slot


class LeaseError(MoeshrinkError, RuntimeError):
    pass


def process_key(pid: int) -> str:
    """The pid with the process's start time (clock ticks after boot): a pid the kernel reuses for
    another process later is not mistaken for the job or supervisor that held it."""
    try:
        started = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        started = "0"
    return f"{pid}-{started}"


def held_by(key: str) -> int:
    """The pid of a live process a key names (0 if it is gone or the pid now belongs to another)."""
    pid_text, _, started = key.partition("-")
    pid = int(pid_text) if pid_text.isdigit() else 0
    if not alive(pid) or process_key(pid) != f"{pid}-{started}":
        return 0
    return pid


@contextlib.contextmanager
def locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def live_leases(serve_dir: Path) -> list[int]:
    """Pids of the jobs holding the build's server; the files of dead ones are removed. Call under the lock."""
    holders = []
    for lease in sorted((serve_dir / LEASES_DIR).glob("*")):
        if pid := held_by(lease.name):
            holders.append(pid)
        else:
            lease.unlink(missing_ok=True)
    return holders


def flags_fingerprint(serve: dict) -> str:
    """What a server was started with, so that a job never attaches to one started with other flags."""
    return hashlib.sha256(json.dumps(serve, sort_keys=True).encode()).hexdigest()[:16]


def queue_order(config: dict, build: str) -> int:
    """The build's place in the machine's server queue: the reference first (every other build's
    agreement reads its passages), then config order."""
    builds = [config["reference_build"], *[b for b in config["builds"] if b != config["reference_build"]]]
    return builds.index(build)


def stop_leftover(serve_dir: Path) -> None:
    """Stop a server an earlier supervisor left behind (its pid file names the process group)."""
    record_path = serve_dir / PID_FILE
    record = read_record(record_path)
    if record is None:
        record_path.unlink(missing_ok=True)
        return
    group = int(record["pgid"])
    try:
        cmdline = Path(f"/proc/{record['pid']}/cmdline").read_bytes().decode(errors="replace")
    except OSError:
        cmdline = ""
    if record["model_dir"] in cmdline and "vllm.entrypoints" in cmdline:
        log.warning("stopping a server left by an earlier run: pid %s, group %s", record["pid"], group)
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(group, sig)
            except ProcessLookupError:
                break
            time.sleep(5)
    record_path.unlink(missing_ok=True)


@dataclass
class ServerSpec:
    """Everything a supervisor needs to serve one build."""
    build: str
    model_dir: Path
    serve: dict          # the serve keys that change what the server computes (the rules' params)
    operational: dict    # timeouts, idle grace, servers per machine: change nothing it computes
    prediction: Path     # results/serve/{build}/prediction.json
    queue_order: int

    @property
    def serve_dir(self) -> Path:
        return self.prediction.parent

    def supervisor_command(self) -> list[str]:
        return [sys.executable, "-m", "moeshrink", "serve", "--build", self.build, "--model-dir", str(self.model_dir),
                "--serve-json", json.dumps(self.serve), "--operational-json", json.dumps(self.operational),
                "--prediction", str(self.prediction), "--endpoint", str(self.serve_dir / ENDPOINT_FILE),
                "--log", str(self.serve_dir / SERVER_LOG), "--queue-order", str(self.queue_order)]


class ServerLease:
    """One job's hold on its build's server: `acquire()` starts it if none is up (or attaches), then waits
    until it answers; `release()` (or the job's death) gives the hold back."""

    def __init__(self, spec: ServerSpec, holder: str):
        self.spec = spec
        self.holder = holder
        self.lease_file = spec.serve_dir / LEASES_DIR / process_key(os.getpid())
        self._endpoint: Endpoint | None = None

    def acquire(self) -> Endpoint:
        if self._endpoint is not None:
            return self._endpoint
        serve_dir = self.spec.serve_dir
        fingerprint = flags_fingerprint(self.spec.serve)
        said = False
        while True:
            with locked(serve_dir / LOCK_FILE):
                record = read_record(serve_dir / ENDPOINT_FILE)
                active = bool(record) and record.get("state") in ACTIVE_STATES \
                    and alive(int(record.get("supervisor_pid", 0)))
                if active and record.get("flags") != fingerprint:
                    if not live_leases(serve_dir):  # an idle server started with other flags: retire it
                        os.kill(int(record["supervisor_pid"]), signal.SIGTERM)
                    elif not said:
                        log.info("%s: a server with other serve flags is in use; waiting for it to stop", self.spec.build)
                        said = True
                else:
                    if not active:
                        self._spawn(fingerprint)
                    self.lease_file.parent.mkdir(parents=True, exist_ok=True)
                    atomic_write_json(self.lease_file, {"pid": os.getpid(), "holder": self.holder, "since": now_iso()})
                    break
            time.sleep(2)
        timeout_s = float(self.spec.operational["startup_timeout_s"]) + 120
        self._endpoint = wait_for_endpoint(serve_dir / ENDPOINT_FILE, timeout_s)
        return self._endpoint

    def _spawn(self, fingerprint: str) -> None:
        """Start the build's supervisor (under the lock, so that no other job starts a second one)."""
        serve_dir = self.spec.serve_dir
        stop_leftover(serve_dir)
        with open(serve_dir / SUPERVISOR_LOG, "a") as supervisor_log:
            process = subprocess.Popen(self.spec.supervisor_command(), stdin=subprocess.DEVNULL, stdout=supervisor_log,
                                       stderr=subprocess.STDOUT, start_new_session=True, close_fds=True,
                                       env={k: v for k, v in os.environ.items() if k not in SCHEDULER_THREAD_VARS})
        atomic_write_json(serve_dir / ENDPOINT_FILE, {
            "state": "queued", "build": self.spec.build, "supervisor_pid": process.pid, "flags": fingerprint,
            "log": str(serve_dir / SERVER_LOG), "supervisor_log": str(serve_dir / SUPERVISOR_LOG),
            "started_by": self.holder})
        with open(serve_dir / STARTS_FILE, "a") as starts:
            starts.write(json.dumps({"at": now_iso(), "supervisor_pid": process.pid, "started_by": self.holder}) + "\n")
        log.info("%s: no server up; started its supervisor (pid %d)", self.spec.build, process.pid)

    def release(self) -> None:
        self.lease_file.unlink(missing_ok=True)
        self._endpoint = None

    def __enter__(self) -> Endpoint:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def stop_idle_servers(serve_root: Path, builds: list[str], timeout_s: float = 120) -> list[str]:
    """Stop the builds' servers that no job holds (the workflow has ended: no job will come back to
    them within the idle grace); servers other jobs still hold are left alone. Returns the builds stopped."""
    stopping = {}
    for build in builds:
        serve_dir = serve_root / build
        if not (serve_dir / ENDPOINT_FILE).exists():
            continue
        with locked(serve_dir / LOCK_FILE):
            record = read_record(serve_dir / ENDPOINT_FILE) or {}
            pid = int(record.get("supervisor_pid", 0))
            if record.get("state") in ACTIVE_STATES and alive(pid) and not live_leases(serve_dir):
                os.kill(pid, signal.SIGTERM)
                stopping[build] = pid
    deadline = time.time() + timeout_s
    while time.time() < deadline and any(alive(pid) for pid in stopping.values()):
        time.sleep(0.5)
    if stopping:
        log.info("stopped the idle servers of %s", ", ".join(stopping))
    return list(stopping)


def merge_record(serve_dir: Path, **fields) -> dict:
    """The supervisor's change of its record; the caller holds the lock."""
    record = {**(read_record(serve_dir / ENDPOINT_FILE) or {}), **fields}
    atomic_write_json(serve_dir / ENDPOINT_FILE, record)
    os.chmod(serve_dir / ENDPOINT_FILE, 0o600)  # it holds the server's API key while it lives
    return record


def update_record(serve_dir: Path, **fields) -> dict:
    """The supervisor's change of its record, under the lock (an acquirer may be reading it)."""
    with locked(serve_dir / LOCK_FILE):
        return merge_record(serve_dir, **fields)


def slots_dir() -> Path:
    return Path(os.environ.get(SLOTS_ENV) or f"/tmp/moeshrink-server-slots-{os.getuid()}")


class MachineSlot:
    """One of the machine's `count` server slots, held by a supervisor for its whole life (an flock, so a
    killed supervisor frees it). Waiting supervisors queue by (order, pid): the lowest takes the next free slot."""

    def __init__(self, count: int, order: int, directory: Path | None = None):
        self.count = count
        self.directory = directory or slots_dir()
        self.ticket = self.directory / "queue" / f"{order:06d}-{process_key(os.getpid())}"
        self.handle = None

    def acquire(self, abort: Callable[[], bool] = lambda: False) -> int:
        self.ticket.parent.mkdir(parents=True, exist_ok=True)
        self.ticket.touch()
        time.sleep(SETTLE_S)
        try:
            while not abort():
                with locked(self.directory / "queue.lock"):
                    if self._first_in_line():
                        for slot in range(self.count):
                            handle = open(self.directory / f"slot-{slot}.lock", "a")
                            try:
                                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                            except BlockingIOError:
                                handle.close()
                                continue
                            self.handle = handle
                            return slot
                time.sleep(1)
            raise LeaseError("stopped while waiting for a server slot")
        finally:
            self.ticket.unlink(missing_ok=True)

    def _waiting(self) -> list[tuple[int, int, Path]]:
        waiting = []
        for ticket in (self.directory / "queue").glob("*-*"):
            order, _, key = ticket.name.partition("-")
            if pid := held_by(key):
                waiting.append((int(order), pid, ticket))
            else:
                ticket.unlink(missing_ok=True)
        return waiting

    def others_waiting(self, blocked_for_s: float = SETTLE_S + 2) -> bool:
        """Whether another supervisor has queued this long for a slot: every slot is taken, and one
        of them is likely held by a server no job needs any more."""
        now = time.time()
        with locked(self.directory / "queue.lock"):
            for _, _, ticket in self._waiting():
                try:
                    if ticket != self.ticket and now - ticket.stat().st_mtime >= blocked_for_s:
                        return True
                except FileNotFoundError:  # it took a slot meanwhile
                    continue
        return False

    def _first_in_line(self) -> bool:
        waiting = self._waiting()
        return bool(waiting) and min(waiting)[2] == self.ticket

    def release(self) -> None:
        if self.handle is not None:
            self.handle.close()
            self.handle = None
