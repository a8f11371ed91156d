"""One vLLM server per build per run, as a Snakemake service job.

`run_service` starts the server with the flags config gives, waits for /health and /v1/models,
then writes the endpoint file its consumers wait for (URL, per-run API key, served name, log) and
serves until Snakemake terminates the job (SIGTERM once every consumer has finished; SIGINT on
Ctrl-C). It then stops the server's whole process group: SIGTERM, SIGKILL after a timeout. If the
server cannot start, the endpoint file says so, with the likely cause and the log's last 50
lines, and the job fails. A server left by a killed run is found through its pid file and
stopped before a new one starts.

On the CPU the card is emulated: the KV-cache room the prediction gives (utilisation x card -
weights - reserve) is handed to vLLM in bytes, so that its token count can be checked against ours.
"""
from __future__ import annotations

import logging
import os
import signal
import time
from pathlib import Path

from moeshrink.ioutil import atomic_write_json, read_json
from moeshrink.provenance import now_iso
from moeshrink.serverlog import likely_cause
from moeshrink.vllm_server import ServerError, VLLMServer, log_tail

log = logging.getLogger("moeshrink.serve")
PID_FILE = "server.pid.json"
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


def server_args(serve: dict, kv_cache_bytes: int | None) -> list[str]:
    """vLLM flags from the `serve` config subtree; `kv_cache_bytes` is the emulated card's room (CPU)."""
    args = ["--tensor-parallel-size", str(serve["tensor_parallel_size"]),
            "--kv-cache-dtype", serve["kv_cache_dtype"],
            "--max-model-len", str(serve["max_model_len"]),
            "--max-logprobs", str(serve["max_logprobs"]),
            "--load-format", "moeshrink"]
    if kv_cache_bytes is None:
        args += ["--gpu-memory-utilization", str(serve["gpu_memory_utilization"])]
    else:
        # No prompt is ever split across steps on the CPU: vLLM rewinds the per-request generator of a
        # seeded request whose prefill is partial with `set_offset`, which a CPU generator does not
        # have, and the engine dies (vllm/v1/worker/gpu_model_runner.py, _bookkeeping_sync). vLLM
        # already turns chunked prefill off for MLA on CPUs without AMX; with AMX it leaves it on.
        args += ["--kv-cache-memory-bytes", str(kv_cache_bytes), "--no-enable-chunked-prefill",
                 "--max-num-batched-tokens", str(max(int(serve["max_model_len"]), CPU_MIN_BATCHED_TOKENS))]
    if serve["block_size"]:
        args += ["--block-size", str(serve["block_size"])]
    if serve["tool_call_parser"]:
        args += ["--enable-auto-tool-choice", "--tool-call-parser", serve["tool_call_parser"]]
    if serve["chat_template"]:
        args += ["--chat-template", str(serve["chat_template"])]
    return args + [str(a) for a in serve["extra_args"]]


def stop_leftover(serve_dir: Path) -> None:
    """Stop a server an earlier, killed run left behind (its pid file names the process group)."""
    record_path = serve_dir / PID_FILE
    if not record_path.exists():
        return
    record = read_json(record_path)
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


class _Stop:
    """Set by SIGTERM/SIGINT/SIGHUP, or when the workflow that started this job has gone (its
    process is no longer our parent): a killed Snakemake must not leave a server behind."""
    requested = False
    parent = os.getppid()

    @classmethod
    def handler(cls, signum, frame) -> None:
        cls.requested = True

    @classmethod
    def now(cls) -> bool:
        if os.getppid() != cls.parent:
            log.warning("the workflow that started this serve job is gone; stopping")
            cls.requested = True
        return cls.requested


def run_service(build: str, model_dir: Path, serve: dict, prediction_path: Path, endpoint_path: Path,
                log_path: Path) -> int:
    serve_dir = endpoint_path.parent
    serve_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_json(endpoint_path, {"state": "starting", "build": build, "supervisor_pid": os.getpid(),
                                      "log": str(log_path)})
    stop_leftover(serve_dir)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, _Stop.handler)
    prediction = read_json(prediction_path)
    cpu = on_cpu()
    kind = None
    if cpu:  # the room left on the emulated card depends on how vLLM's CPU build holds weights here
        from moeshrink import memory
        from moeshrink.served_memory import for_cpu_kind

        facts = memory.cpu_facts()
        kind = memory.cpu_kind(facts, read_json(model_dir / "config.json")) if facts else None
        prediction = for_cpu_kind(prediction, kind)
    kv_cache_bytes = prediction["kv_cache_bytes"] if cpu else None
    if cpu and kv_cache_bytes <= 0:
        return _failed(endpoint_path, log_path, f"the emulated card has no room for a KV cache: "
                       f"{prediction['kv_cache_gib']:.3f} GiB (serve.memory: card_gib, reserve_gib)")
    server = VLLMServer(model_dir, log_path, args=server_args(serve, kv_cache_bytes), env=server_env(cpu),
                        served_name=build, startup_timeout_s=float(serve["startup_timeout_s"]))
    started = time.time()
    try:
        server.start(abort=_Stop.now)
    except ServerError as error:
        return _failed(endpoint_path, log_path, str(error).splitlines()[0])
    atomic_write_json(serve_dir / PID_FILE, {"pid": server.process.pid, "pgid": os.getpgid(server.process.pid),
                                             "model_dir": str(model_dir), "started": now_iso()})
    atomic_write_json(endpoint_path, {
        "state": "ready", "build": build, "base_url": server.base_url, "api_key": server.api_key,
        "served_model_name": build, "model_dir": str(model_dir), "log": str(log_path),
        "server_pid": server.process.pid, "supervisor_pid": os.getpid(), "command": [a if a != server.api_key else "<per-run key>" for a in server.command()],
        "args": server.args, "startup_seconds": round(time.time() - started, 1), "ready_at": now_iso(),
        "platform": "cpu" if cpu else "gpu", "kv_cache_bytes_requested": kv_cache_bytes, "cpu_kind": kind,
    })
    os.chmod(endpoint_path, 0o600)
    log.info("%s served at %s after %.0f s", build, server.base_url, time.time() - started)
    code = 0
    while not _Stop.now():
        if server.process.poll() is not None:
            log.error("the server of %s exited with code %s while serving", build, server.process.returncode)
            code = 1
            break
        time.sleep(1)
    server.stop(timeout_s=float(serve["stop_timeout_s"]))
    (serve_dir / PID_FILE).unlink(missing_ok=True)
    log.info("%s stopped", build)
    return code


def _failed(endpoint_path: Path, log_path: Path, message: str) -> int:
    tail = log_tail(log_path, 50)
    cause = likely_cause(tail)
    atomic_write_json(endpoint_path, {"state": "failed", "likely_cause": cause, "error": message, "log": str(log_path),
                                      "log_tail": tail})
    log.error("likely cause: %s\n%s\nlast 50 lines of %s:\n%s", cause, message, log_path, tail)
    return 1
