"""The serve stage's mechanics that need no model: flags from config, and
stopping a server an earlier killed run left behind."""
import json
import os
import signal
import subprocess
import sys
import time

from moeshrink.serve.server_lease import PID_FILE, stop_leftover
from moeshrink.serve.supervisor import server_args, server_env

SERVE = {"tensor_parallel_size": 2, "kv_cache_dtype": "fp8", "gpu_memory_utilization": 0.85, "max_model_len": 4096,
         "max_logprobs": 20, "block_size": None, "tool_call_parser": "hermes", "chat_template": "templates/chat.jinja",
         "extra_args": ["--trust-remote-code"],
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
    assert "--dtype" not in gpu and flag(server_args(SERVE, None, "float32"), "--dtype") == "float32"


def test_cpu_servers_turn_off_the_aot_compile_vllm_cannot_reload(monkeypatch):
    from vllm import envs

    assert server_env(cpu=False) == {}
    monkeypatch.delenv("VLLM_USE_AOT_COMPILE", raising=False)
    monkeypatch.delenv("VLLM_DISABLE_COMPILE_CACHE", raising=False)
    assert envs.use_aot_compile()  # vLLM's default with this torch: the path whose load fails on the CPU
    for key, value in server_env(cpu=True).items():
        monkeypatch.setenv(key, value)
    assert not envs.use_aot_compile()


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
