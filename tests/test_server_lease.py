"""A build's server shared by reference (moeshrink.serve.server_lease, moeshrink.serve.supervisor's supervisor loop):
leases of dead jobs count for nothing, the machine's slots go to the first build in line, and a
server stops only once no job has held it for the idle grace. Real processes stand in for the jobs
and for vLLM (the end-to-end tests serve with vLLM itself)."""
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from moeshrink.core.ioutil import atomic_write_json
from moeshrink.serve import server_lease, supervisor
from moeshrink.serve.endpoint import EndpointError, wait_for_endpoint
from moeshrink.serve.server_lease import (
    ENDPOINT_FILE,
    LEASES_DIR,
    MachineSlot,
    flags_fingerprint,
    live_leases,
    process_key,
    queue_order,
)
from moeshrink.serve.vllm_server import VLLMServer, alive


def _sleeper(seconds: float = 120) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", f"import time; time.sleep({seconds})"], start_new_session=True)


def _lease(serve_dir: Path, pid: int) -> None:
    (serve_dir / LEASES_DIR).mkdir(parents=True, exist_ok=True)
    atomic_write_json(serve_dir / LEASES_DIR / process_key(pid), {"pid": pid})


@pytest.fixture()
def slots(tmp_path, monkeypatch) -> Path:
    directory = tmp_path / "slots"
    monkeypatch.setenv(server_lease.SLOTS_ENV, str(directory))
    monkeypatch.setattr(server_lease, "SETTLE_S", 0.0)
    return directory


def test_leases_of_dead_jobs_count_for_nothing(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    zombie = subprocess.Popen([sys.executable, "-c", "pass"])  # exited, not yet reaped: still gone
    time.sleep(1)
    for pid in (os.getpid(), dead.pid, zombie.pid):
        _lease(tmp_path, pid)
    reused = tmp_path / LEASES_DIR / f"{os.getpid()}-1"  # our pid, once held by a process started at another time
    reused.write_text("{}")
    assert not alive(zombie.pid) and not alive(dead.pid)
    assert live_leases(tmp_path) == [os.getpid()]
    assert sorted(p.name for p in (tmp_path / LEASES_DIR).iterdir()) == [process_key(os.getpid())]
    zombie.wait()


def test_the_reference_queues_first_and_flags_are_fingerprinted_in_any_key_order():
    config = {"reference_build": "original", "builds": {"twx3": {}, "original": {}, "pruned75": {}}}
    assert [queue_order(config, b) for b in ("original", "twx3", "pruned75")] == [0, 1, 2]
    assert flags_fingerprint({"a": 1, "b": [2]}) == flags_fingerprint({"b": [2], "a": 1})
    assert flags_fingerprint({"a": 1}) != flags_fingerprint({"a": 2})


def test_a_machine_slot_goes_to_the_first_build_in_line(slots):
    holder = MachineSlot(1, order=9, directory=slots)
    assert holder.acquire() == 0
    order_taken: list[int] = []

    def wait_for_slot(order: int) -> None:
        slot = MachineSlot(1, order=order, directory=slots)
        slot.acquire()
        order_taken.append(order)
        time.sleep(0.3)
        slot.release()

    waiters = [threading.Thread(target=wait_for_slot, args=(order,)) for order in (3, 1, 2)]
    for waiter in waiters:
        waiter.start()
    time.sleep(1.5)
    assert order_taken == []
    holder.release()
    for waiter in waiters:
        waiter.join(timeout=30)
    assert order_taken == [1, 2, 3]
    assert not list((slots / "queue").iterdir())


def test_a_queued_supervisor_gives_up_when_no_job_holds_it(slots):
    holder = MachineSlot(1, order=0, directory=slots)
    holder.acquire()
    waiter = MachineSlot(1, order=1, directory=slots)
    with pytest.raises(server_lease.LeaseError, match="stopped while waiting"):
        waiter.acquire(abort=lambda: True)
    assert not list((slots / "queue").iterdir())
    holder.release()


def _served(tmp_path: Path, slots: Path, grace_s: float) -> tuple[VLLMServer, supervisor._Idle, Path, MachineSlot]:
    """A supervisor's state once its server answers; a sleeping process stands in for vLLM."""
    serve_dir = tmp_path / "serve" / "twx3"
    serve_dir.mkdir(parents=True)
    atomic_write_json(serve_dir / ENDPOINT_FILE, {"state": "ready", "supervisor_pid": os.getpid()})
    server = VLLMServer(tmp_path, serve_dir / "server.log")
    server.process = _sleeper()
    slot = MachineSlot(1, order=1, directory=slots)
    slot.acquire()
    return server, supervisor._Idle(serve_dir, grace_s), serve_dir, slot


def test_a_server_stops_only_after_its_last_lease_and_the_idle_grace(tmp_path, slots):
    server, idle, serve_dir, slot = _served(tmp_path, slots, grace_s=2.0)
    job_a, job_b = _sleeper(), _sleeper()
    _lease(serve_dir, job_a.pid)
    _lease(serve_dir, job_b.pid)
    outcome: list[int] = []
    loop = threading.Thread(target=lambda: outcome.append(supervisor._serve_while_leased("twx3", server, serve_dir,
                                                                                         idle, 5)))
    loop.start()
    try:
        job_a.kill()  # one job dies mid-eval: its lease counts for nothing, the other still holds the server
        job_a.wait()
        time.sleep(3)
        assert loop.is_alive() and server.process.poll() is None
        released = time.time()
        (serve_dir / LEASES_DIR / process_key(job_b.pid)).unlink()  # the last job releases
        loop.join(timeout=30)
        assert outcome == [0] and server.process.poll() is not None
        assert 1.5 <= time.time() - released < 10
        record = json.loads((serve_dir / ENDPOINT_FILE).read_text())
        assert record["state"] == "stopped" and record["api_key"] is None
        assert record["stop_reason"] == "no job held it for the idle grace"
    finally:
        for process in (job_a, job_b, server.process):
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
        slot.release()


def test_an_unleased_server_hands_the_machine_over_to_a_build_blocked_on_it(tmp_path, slots):
    """Jobs run one build after another, so a build queued for the machine means the server's own jobs are
    done: it stops at once instead of after the grace. A supervisor that only just queued (it may yet find a
    free slot) does not count."""
    server, idle, serve_dir, slot = _served(tmp_path, slots, grace_s=600.0)
    idle.handover = slot.others_waiting
    job = _sleeper()
    _lease(serve_dir, job.pid)
    waiter = MachineSlot(1, order=2, directory=slots)
    queued = threading.Thread(target=waiter.acquire)
    outcome: list[int] = []
    loop = threading.Thread(target=lambda: outcome.append(supervisor._serve_while_leased("twx3", server, serve_dir,
                                                                                         idle, 5)))
    try:
        queued.start()
        time.sleep(0.5)
        assert not slot.others_waiting()  # queued 0.5 s ago: not yet blocked
        assert slot.others_waiting(blocked_for_s=0.2)
        loop.start()
        time.sleep(3)
        assert loop.is_alive()  # its job still holds it
        released = time.time()
        (serve_dir / LEASES_DIR / process_key(job.pid)).unlink()
        loop.join(timeout=30)
        assert outcome == [0] and time.time() - released < 10  # the grace is 600 s
        record = json.loads((serve_dir / ENDPOINT_FILE).read_text())
        assert record["stop_reason"] == "no job held it and another build waits for the machine"
        slot.release()
        queued.join(timeout=30)
        assert waiter.handle is not None  # the blocked build took the slot
    finally:
        for process in (job, server.process):
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
        slot.release()
        waiter.release()


def test_a_failed_start_reaches_the_lessee_with_its_cause(tmp_path):
    endpoint = tmp_path / "endpoint.json"
    atomic_write_json(endpoint, {"state": "failed", "likely_cause": "out of memory: the build does not fit",
                                 "error": "vLLM exited with code 1", "log": "server.log", "log_tail": "line 1\nline 2",
                                 "supervisor_pid": 0})
    with pytest.raises(EndpointError, match=r"could not start. Likely cause: out of memory(.|\n)*line 2"):
        wait_for_endpoint(endpoint, timeout_s=5, poll_s=0.1)


def test_a_record_whose_supervisor_is_gone_fails_the_lessee_at_once(tmp_path):
    endpoint = tmp_path / "twx3" / "endpoint.json"
    endpoint.parent.mkdir()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    atomic_write_json(endpoint, {"state": "starting", "supervisor_pid": dead.pid, "log": "server.log"})
    started = time.time()
    with pytest.raises(EndpointError, match=r"build 'twx3': .* its supervisor \(pid \d+\) ended without a server"):
        wait_for_endpoint(endpoint, timeout_s=1800, poll_s=0.1)
    assert time.time() - started < 5


def test_waiting_in_the_queue_counts_no_startup_time(tmp_path):
    endpoint = tmp_path / "twx3" / "endpoint.json"
    endpoint.parent.mkdir()
    atomic_write_json(endpoint, {"state": "queued", "supervisor_pid": os.getpid(), "log": "server.log"})

    def start_then_stop() -> None:
        time.sleep(1.5)
        atomic_write_json(endpoint, {"state": "starting", "supervisor_pid": os.getpid(), "log": "server.log"})
        time.sleep(1.5)
        atomic_write_json(endpoint, {"state": "stopped", "stop_reason": "terminated", "supervisor_pid": os.getpid(),
                                     "log": str(tmp_path / "server.log")})

    writer = threading.Thread(target=start_then_stop)
    writer.start()
    with pytest.raises(EndpointError, match=r"no server answered within 1 s"):
        wait_for_endpoint(endpoint, timeout_s=1, poll_s=0.1)  # 1.5 s queued, then 1 s starting
    writer.join()
    with pytest.raises(EndpointError, match=r"its server was stopped \(terminated\)"):
        wait_for_endpoint(endpoint, timeout_s=1, poll_s=0.1)


def test_the_end_of_the_workflow_stops_only_the_idle_servers(tmp_path):
    supervisors = {build: _sleeper() for build in ("idle", "held")}
    try:
        for build, process in supervisors.items():
            atomic_write_json(tmp_path / build / ENDPOINT_FILE, {"state": "ready", "supervisor_pid": process.pid})
        _lease(tmp_path / "held", os.getpid())
        assert server_lease.stop_idle_servers(tmp_path, ["idle", "held", "never_served"], timeout_s=10) == ["idle"]
        assert supervisors["idle"].wait(timeout=10) == -signal.SIGTERM
        assert supervisors["held"].poll() is None
    finally:
        for process in supervisors.values():
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
