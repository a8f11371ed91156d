"""The serve stage's mechanics that need no model: flags from config, the endpoint handshake, and
stopping a server an earlier killed run left behind."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from moeshrink.endpoint import EndpointError, wait_for_endpoint
from moeshrink.ioutil import atomic_write_json
from moeshrink.serve import PID_FILE, server_args, server_env, stop_leftover

SERVE = {"tensor_parallel_size": 2, "kv_cache_dtype": "fp8", "gpu_memory_utilization": 0.85, "max_model_len": 4096,
         "max_logprobs": 20, "block_size": None, "tool_call_parser": "hermes", "chat_template": "templates/chat.jinja", "extra_args": ["--trust-remote-code"],
         "memory": {"card": "H200", "card_gib": 140.4, "reserve_gib": 10}}


def flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def test_flags_come_from_config():
    gpu = server_args(SERVE, kv_cache_bytes=None)
    assert flag(gpu, "--tensor-parallel-size") == "2" and flag(gpu, "--kv-cache-dtype") == "fp8"
    assert flag(gpu, "--gpu-memory-utilization") == "0.85" and flag(gpu, "--max-model-len") == "4096"
    assert flag(gpu, "--tool-call-parser") == "hermes" and "--enable-auto-tool-choice" in gpu
    assert flag(gpu, "--chat-template") == "templates/chat.jinja" and gpu[-1] == "--trust-remote-code"
    assert flag(gpu, "--load-format") == "moeshrink" and "--kv-cache-memory-bytes" not in gpu
    cpu = server_args({**SERVE, "tool_call_parser": "", "chat_template": None}, kv_cache_bytes=123456789)
    assert flag(cpu, "--kv-cache-memory-bytes") == "123456789" and "--gpu-memory-utilization" not in cpu
    assert "--tool-call-parser" not in cpu and "--chat-template" not in cpu
    # never a partly prefilled prompt on the CPU (vLLM's CPU generators cannot be rewound), on every ISA
    assert "--no-enable-chunked-prefill" in cpu and int(flag(cpu, "--max-num-batched-tokens")) >= 4096
    assert "--no-enable-chunked-prefill" not in gpu


def test_cpu_servers_turn_off_the_aot_compile_vllm_cannot_reload(monkeypatch):
    from vllm import envs

    assert server_env(cpu=False) == {}
    monkeypatch.delenv("VLLM_USE_AOT_COMPILE", raising=False)
    monkeypatch.delenv("VLLM_DISABLE_COMPILE_CACHE", raising=False)
    assert envs.use_aot_compile()  # vLLM's default with this torch: the path whose load fails on the CPU
    for key, value in server_env(cpu=True).items():
        monkeypatch.setenv(key, value)
    assert not envs.use_aot_compile()


def test_a_failed_start_reaches_the_consumer_with_its_cause(tmp_path):
    endpoint = tmp_path / "endpoint.json"
    atomic_write_json(endpoint, {"state": "failed", "likely_cause": "out of memory: the build does not fit",
                                 "error": "vLLM exited with code 1", "log": "server.log", "log_tail": "line 1\nline 2"})
    with pytest.raises(EndpointError, match=r"could not start. Likely cause: out of memory(.|\n)*line 2"):
        wait_for_endpoint(endpoint, timeout_s=5, poll_s=0.1)


def test_an_endpoint_left_by_a_dead_supervisor_is_not_taken(tmp_path):
    endpoint = tmp_path / "endpoint.json"
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    atomic_write_json(endpoint, {"state": "ready", "build": "b", "base_url": "http://127.0.0.1:9", "api_key": "k",
                                 "served_model_name": "b", "log": "server.log", "server_pid": dead.pid,
                                 "supervisor_pid": dead.pid})
    with pytest.raises(EndpointError, match="no server answered within 1 s"):
        wait_for_endpoint(endpoint, timeout_s=1, poll_s=0.1)  # within the grace: a new serve job may replace it
    with pytest.raises(EndpointError, match=r"the serve job \(pid \d+\) ended without a server"):
        wait_for_endpoint(endpoint, timeout_s=5, poll_s=0.1, grace_s=0.5)


def test_a_leftover_server_is_found_and_stopped(tmp_path):
    model_dir = str(tmp_path / "results/builds/twx3")
    # stands in for a server whose supervisor was SIGKILLed: its own process group, its model in argv
    leftover = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", "vllm.entrypoints.openai",
                                 model_dir], start_new_session=True)
    unrelated = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True)
    try:
        (tmp_path / PID_FILE).write_text(json.dumps({"pid": leftover.pid, "pgid": leftover.pid, "model_dir": model_dir}))
        stop_leftover(tmp_path)
        assert leftover.wait(timeout=30) == -signal.SIGTERM
        assert not (tmp_path / PID_FILE).exists()
        # a pid file whose process is something else (the pid was reused) stops nothing
        (tmp_path / PID_FILE).write_text(json.dumps({"pid": unrelated.pid, "pgid": unrelated.pid, "model_dir": model_dir}))
        stop_leftover(tmp_path)
        time.sleep(0.5)
        assert unrelated.poll() is None
    finally:
        for process in (leftover, unrelated):
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()


def test_an_endpoint_that_disappears_fails_the_consumer_within_seconds(tmp_path):
    """Snakemake removes a service's output when it ends the build's group (another job of it failed):
    a consumer still waiting must fail at once, not after serve.startup_timeout_s."""
    endpoint = tmp_path / "pruned75" / "endpoint.json"
    endpoint.parent.mkdir()
    atomic_write_json(endpoint, {"state": "starting", "supervisor_pid": os.getpid(), "log": "server.log"})
    remover = subprocess.Popen([sys.executable, "-c", f"import os, time; time.sleep(1); os.unlink({str(endpoint)!r})"])
    started = time.time()
    with pytest.raises(EndpointError, match=r"build 'pruned75': .* disappeared while waiting for the server"):
        wait_for_endpoint(endpoint, timeout_s=1800, poll_s=0.1)
    remover.wait()
    assert time.time() - started < 10


def test_an_endpoint_no_serve_job_writes_fails_the_consumer(tmp_path):
    endpoint = tmp_path / "twx3" / "endpoint.json"
    with pytest.raises(EndpointError, match=r"build 'twx3': no serve job wrote .* within 1 s"):
        wait_for_endpoint(endpoint, timeout_s=1800, poll_s=0.1, appear_s=1)
