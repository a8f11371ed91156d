"""A build's vLLM server for the jobs that lease it (moeshrink.serve.server_lease): the supervisor.

`run_service` takes a machine slot (waiting its turn), starts the server with the flags config gives,
waits for /health and /v1/models, then records the endpoint its lessees wait for (URL, per-run API
key, served name, log) and serves until no live lease has been held for `serve.idle_grace_s`, or
until SIGTERM/SIGINT/SIGHUP. It then stops the server's whole process group: SIGTERM, SIGKILL after
a timeout. If the server cannot start, the record says so, with the likely cause and the log's last
50 lines, and every lessee fails with it.

On the CPU the card is emulated: the KV-cache room the prediction gives (utilisation x card -
weights - reserve) is handed to vLLM in bytes, so that its token count can be checked against ours.
"""
from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

from moeshrink.core.checkpoint import MANIFEST_FILE, CheckpointError, verify_folder
from moeshrink.core.ioutil import atomic_write_json, read_json
from moeshrink.core.provenance import now_iso
from moeshrink.serve.server_lease import (
    LOCK_FILE,
    PID_FILE,
    LeaseError,
    MachineSlot,
    live_leases,
    locked,
    merge_record,
    update_record,
)
from moeshrink.serve.serverlog import likely_cause
from moeshrink.serve.vllm_server import ServerError, VLLMServer, log_tail

log = logging.getLogger("moeshrink.serve.supervisor")
CPU_MIN_BATCHED_TOKENS = 2048  # vLLM's SchedulerConfig.DEFAULT_MAX_NUM_BATCHED_TOKENS


def on_cpu() -> bool:
    try:
        import torch

        return not torch.cuda.is_available()
    except ImportError:
        return True


# vLLM 0.32 on the CPU cannot load the AOT artifact it saves (the CPU platform compiles with the plain
# Inductor backend, whose function lacks `finalize_loading`: "Compiling model again due to a load
# failure"), so with AOT compile on every start compiles twice over. Without it, Inductor's own FX
# graph cache serves a repeated start: engine init 6 s instead of 15 s (measured 2026-12-04).
CPU_SERVER_ENV = {"VLLM_USE_AOT_COMPILE": "0"}


def server_env(cpu: bool) -> dict[str, str]:
    return dict(CPU_SERVER_ENV) if cpu else {}


# the agreement eval's endpoint: prompt log-probabilities as arrays (moeshrink_kernels/vllm/prompt_logprobs.py)
PROMPT_LOGPROBS_ENDPOINT = "moeshrink_kernels.vllm.prompt_logprobs.PromptLogprobsEndpoint"


def server_args(serve: dict, kv_cache_bytes: int | None, dtype: str | None = None) -> list[str]:
    """vLLM flags from the `serve` config subtree; `kv_cache_bytes` is the emulated card's room (CPU),
    `dtype` the dtype to compute in (None: vLLM's choice)."""
    args = ["--tensor-parallel-size", str(serve["tensor_parallel_size"]),
            "--kv-cache-dtype", serve["kv_cache_dtype"],
            "--max-model-len", str(serve["max_model_len"]),
            "--max-logprobs", str(serve["max_logprobs"]),
            "--load-format", "moeshrink",
            "--middleware", PROMPT_LOGPROBS_ENDPOINT]
    if kv_cache_bytes is None:
        args += ["--gpu-memory-utilization", str(serve["gpu_memory_utilization"])]
    else:
        # No prompt is ever split across steps on the CPU: vLLM rewinds the per-request generator of a
        # seeded request whose prefill is partial with `set_offset`, which a CPU generator does not
        # have, and the engine dies (vllm/v1/worker/gpu_model_runner.py, _bookkeeping_sync). vLLM
        # already turns chunked prefill off for MLA on CPUs without AMX; with AMX it leaves it on.
        args += ["--kv-cache-memory-bytes", str(kv_cache_bytes), "--no-enable-chunked-prefill",
                 "--max-num-batched-tokens", str(max(int(serve["max_model_len"]), CPU_MIN_BATCHED_TOKENS))]
    if dtype:
        args += ["--dtype", dtype]
    if serve["block_size"]:
        args += ["--block-size", str(serve["block_size"])]
    if serve["tool_call_parser"]:
        args += ["--enable-auto-tool-choice", "--tool-call-parser", serve["tool_call_parser"]]
    if serve["chat_template"]:
        args += ["--chat-template", str(serve["chat_template"])]
    return args + [str(a) for a in serve["extra_args"]]


class _Stop:
    """Set by SIGTERM/SIGINT/SIGHUP: stop serving now, whoever holds a lease."""
    requested = False

    @classmethod
    def handler(cls, signum, frame) -> None:
        cls.requested = True

    @classmethod
    def now(cls) -> bool:
        return cls.requested


class _Idle:
    """How long the build's server has gone without a live lease. Once it serves, `handover` says whether
    another build's supervisor is blocked on the machine's slots: jobs run one build after another
    (`priority:` in the rules), so an unleased server then has no job left and stops without the grace."""

    def __init__(self, serve_dir: Path, grace_s: float):
        self.serve_dir = serve_dir
        self.grace_s = grace_s
        self.since: float | None = None
        self.handover: Callable[[], bool] = lambda: False

    def expired(self) -> str | None:
        """Why the server should stop now, if it should. Call under the lock."""
        if live_leases(self.serve_dir):
            self.since = None
            return None
        now = time.time()
        self.since = self.since or now
        if now - self.since >= self.grace_s:
            return "no job held it for the idle grace"
        return "no job held it and another build waits for the machine" if self.handover() else None

    def expired_now(self) -> bool:
        with locked(self.serve_dir / LOCK_FILE):
            return self.expired() is not None


def run_service(build: str, model_dir: Path, serve: dict, prediction_path: Path, endpoint_path: Path,
                log_path: Path, queue_order: int = 0) -> int:
    serve_dir = endpoint_path.parent
    serve_dir.mkdir(parents=True, exist_ok=True)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, _Stop.handler)
    update_record(serve_dir, state="queued", build=build, supervisor_pid=os.getpid(), log=str(log_path))
    slot = MachineSlot(int(serve["servers_per_machine"]), queue_order)
    idle = _Idle(serve_dir, float(serve["idle_grace_s"]))
    try:
        slot_number = slot.acquire(abort=lambda: _Stop.now() or idle.expired_now())
    except LeaseError as error:
        update_record(serve_dir, state="stopped", stopped_at=now_iso(),
                      stop_reason="terminated while queued" if _Stop.now() else "no job held it while it queued")
        log.info("%s: %s", build, error)
        return 0
    idle.handover = slot.others_waiting
    try:
        return _serve(build, model_dir, serve, prediction_path, serve_dir, log_path, slot_number, idle)
    finally:
        slot.release()


def _serve(build: str, model_dir: Path, serve: dict, prediction_path: Path, serve_dir: Path, log_path: Path,
           slot_number: int, idle: _Idle) -> int:
    update_record(serve_dir, state="starting", machine_slot=slot_number, starting_at=now_iso())
    if (model_dir / MANIFEST_FILE).exists():  # a damaged shard is named here, not deep in vLLM's loader
        try:
            verify_folder(model_dir, read_json(model_dir / MANIFEST_FILE))
        except CheckpointError as error:
            return _failed(serve_dir, log_path, str(error))
    prediction = read_json(prediction_path)
    cpu = on_cpu()
    kind = dtype = None
    if cpu:  # the dtype, and the room left on the emulated card, depend on what this CPU can do
        from moeshrink.core.machine import cpu_facts
        from moeshrink.serve import memory
        from moeshrink.serve.served_memory import for_cpu

        facts = cpu_facts()
        config = read_json(model_dir / "config.json")
        dtype = memory.serving_dtype(serve["dtype"], config, facts)
        kind = memory.cpu_kind(facts, memory.served_as(config, dtype)) if facts else None
        prediction = for_cpu(prediction, kind, dtype)
    elif serve["dtype"] != "auto":
        dtype = serve["dtype"]
    kv_cache_bytes = prediction["kv_cache_bytes"] if cpu else None
    if cpu and kv_cache_bytes <= 0:
        return _failed(serve_dir, log_path, f"the emulated card has no room for a KV cache: "
                       f"{prediction['kv_cache_gib']:.3f} GiB (serve.memory: card_gib, reserve_gib)")
    server = VLLMServer(model_dir, log_path, args=server_args(serve, kv_cache_bytes, dtype), env=server_env(cpu),
                        served_name=build, startup_timeout_s=float(serve["startup_timeout_s"]))
    started = time.time()
    try:
        server.start(abort=lambda: _Stop.now() or idle.expired_now())
    except ServerError as error:
        if _Stop.now() or idle.since is not None:
            with locked(serve_dir / LOCK_FILE):
                _stopped(serve_dir, server, float(serve["stop_timeout_s"]), "no job held it while it started")
            return 0
        return _failed(serve_dir, log_path, str(error).splitlines()[0])
    atomic_write_json(serve_dir / PID_FILE, {"pid": server.process.pid, "pgid": os.getpgid(server.process.pid),
                                             "model_dir": str(model_dir), "started": now_iso()})
    update_record(
        serve_dir, state="ready", base_url=server.base_url, api_key=server.api_key, served_model_name=build,
        model_dir=str(model_dir), server_pid=server.process.pid,
        command=[a if a != server.api_key else "<per-run key>" for a in server.command()], args=server.args,
        startup_seconds=round(time.time() - started, 1), ready_at=now_iso(), platform="cpu" if cpu else "gpu",
        kv_cache_bytes_requested=kv_cache_bytes, cpu_kind=kind, dtype=dtype)
    log.info("%s served at %s after %.0f s", build, server.base_url, time.time() - started)
    return _serve_while_leased(build, server, serve_dir, idle, float(serve["stop_timeout_s"]))


def _serve_while_leased(build: str, server: VLLMServer, serve_dir: Path, idle: _Idle, stop_timeout_s: float) -> int:
    """Serve until no live lease has been held for the idle grace. The stop happens under the lock, so
    that a job leasing meanwhile waits for it and then starts a fresh server."""
    while True:
        if server.process.poll() is not None:
            log.error("the server of %s exited with code %s while serving", build, server.process.returncode)
            with locked(serve_dir / LOCK_FILE):
                _stopped(serve_dir, server, stop_timeout_s, f"the server exited with code {server.process.returncode}")
            return 1
        with locked(serve_dir / LOCK_FILE):
            reason = "terminated" if _Stop.now() else idle.expired()
            if reason:
                _stopped(serve_dir, server, stop_timeout_s, reason)
                log.info("%s stopped (%s)", build, reason)
                return 0
        time.sleep(1)


def _stopped(serve_dir: Path, server: VLLMServer, stop_timeout_s: float, reason: str) -> None:
    """Stop the server and record it; the caller holds the lock."""
    server.stop(timeout_s=stop_timeout_s)
    (serve_dir / PID_FILE).unlink(missing_ok=True)
    merge_record(serve_dir, state="stopped", stopped_at=now_iso(), stop_reason=reason, api_key=None)


def _failed(serve_dir: Path, log_path: Path, message: str) -> int:
    tail = log_tail(log_path, 50)
    cause = likely_cause(tail)
    update_record(serve_dir, state="failed", likely_cause=cause, error=message, log=str(log_path), log_tail=tail)
    log.error("likely cause: %s\n%s\nlast 50 lines of %s:\n%s", cause, message, log_path, tail)
    return 1
