"""Where a served build's eval time goes: each eval's own code against one vLLM server started with the
workflow's flags (plus any given here), timed per eval, with the server's processes sampled by py-spy.

    .venv/bin/python bench/serve_profile.py --workdir <finished run> --build twx3 [--evals gsm8k,mmlu]
        [--env VAR=VALUE ...] [--arg=--flag ...] [--py-spy PATH] [--json out.json]

Needs a finished run of the embedded default (the builds, the eval sets, the reference's agreement top-K).
Outputs go to a temporary folder; nothing of the run is touched. With --py-spy, each eval's window is
sampled in the API server, the engine core and the worker (raw stacks beside the JSON, and a summary of
where their time went). Run it under bench/avx2/env.sh to time an AVX2-only CPU on a newer one.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from moeshrink.core import config as config_mod
from moeshrink.core import eval_kinds, rule_params
from moeshrink.core.ioutil import read_json
from moeshrink.core.machine import cpu_facts, cpu_isa, cpu_model
from moeshrink.evals.run import EvalJob, run
from moeshrink.serve.endpoint import Endpoint
from moeshrink.serve.supervisor import on_cpu, server_args, server_env
from moeshrink.serve.vllm_server import VLLMServer

# Where a sampled stack's time goes, the first matching frame from the leaf up (file:function fragments)
PHASES = (
    ("expert op (decode + MoE kernel)", ("experts.py", "ops.py:_twx_op", "ops.py:_mxfp4_op")),
    ("attention", ("mla_attention.py", "amx_mla.py", "cpu_mla", "cpu_attn.py")),
    ("sampling + logprobs", ("sampler.py", "sample_tokens", "gather_logprobs", "compute_logprobs")),
    ("compiled forward (rest)", ("_model_forward", "CompiledFxGraph")),
    ("input preparation", ("_prepare_inputs", "_update_states", "prepare_inputs")),
    ("scheduling", ("scheduler.py", "kv_cache_manager", "kv_cache_coordinator")),
    ("waiting for the other process (spin)", ("shm_broadcast.py", "sched_yield")),
    ("detokenize / output processing", ("detokenizer", "output_processor", "logprobs.py", "tokenizers")),
    ("HTTP + JSON (front end)", ("encoder.py", "decoder.py", "responses.py", "main.py:BaseModel", "httptools", "h11",
                                 "uvicorn", "starlette", "fastapi", "api_router", "serving.py", "protocol.py",
                                 "prompt_logprobs.py")),
    ("event loop and threads (idle or switching)", ("runners.py", "selectors.py", "threading.py", "queue.py",
                                                    "base_events.py", "socket.py")),
)


class _Lease:
    def __init__(self, endpoint: Endpoint):
        self.endpoint = endpoint

    def acquire(self) -> Endpoint:
        return self.endpoint

    def release(self) -> None:
        pass


def children(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def server_processes(root: int) -> dict[str, int]:
    """{api_server, engine_core, worker}: the server's process tree by name."""
    named, todo = {"api_server": root}, [root]
    while todo:
        for child in children(todo.pop()):
            todo.append(child)
            name = Path(f"/proc/{child}/comm").read_text().strip()
            if "EngineCor" in name:
                named["engine_core"] = child
            elif "Worker" in name:
                named["worker"] = child
    return named


def frame_name(frame: str) -> str:
    """py-spy's `function (path/file.py:line)` as `file.py:function`."""
    function, _, where = frame.partition(" (")
    return f"{where.rsplit('/', 1)[-1].split(':')[0]}:{function}"


def phase_of(frames: list[str]) -> str:
    """The phase of the frame nearest the leaf that names one."""
    for frame in reversed(frames):
        for phase, needles in PHASES:
            if any(needle in frame for needle in needles):
                return phase
    return "other"


def summarize(raw: Path) -> dict:
    counts: collections.Counter = collections.Counter()
    for line in raw.read_text().splitlines():
        if line.strip():
            stack, samples = line.rsplit(" ", 1)
            counts[phase_of([frame_name(f) for f in stack.split(";")])] += int(samples)
    total = sum(counts.values()) or 1
    return {"samples": total, "share": {phase: round(n / total, 3) for phase, n in counts.most_common()}}


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def resummarize(folder: Path) -> None:
    """The phases of an earlier run's raw stacks (its output folder), as this version classifies them."""
    for raw in sorted(folder.glob("*.txt")):
        print(raw.name, json.dumps(summarize(raw)))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, default=Path("."))
    parser.add_argument("--config", type=Path, nargs="*", default=[])
    parser.add_argument("--build", default="twx3")
    parser.add_argument("--evals", default="gsm8k,mmlu,facts,toolcalls,agreement")
    parser.add_argument("--env", action="append", default=[], help="VAR=VALUE for the server")
    parser.add_argument("--arg", action="append", default=[], help="an extra vLLM flag (repeat)")
    parser.add_argument("--client", action="append", default=[], help="evals.client KEY=VALUE")
    parser.add_argument("--py-spy", dest="py_spy", help="py-spy binary: sample the server's processes")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--resummarize", type=Path, help="only classify the raw stacks of an earlier run's folder")
    args = parser.parse_args()
    if args.resummarize:
        resummarize(args.resummarize)
        return 0
    os.chdir(args.workdir)
    cfg = config_mod.load(*args.config)
    run_dir = Path("results") / cfg["run"]
    build_dir = run_dir / "builds" / args.build
    serve = {**rule_params.serve_params(cfg), **rule_params.operational(cfg)["serve"]}
    client = dict(rule_params.operational(cfg)["client"])
    for item in args.client:
        key, value = item.split("=", 1)
        client[key] = type(client[key])(value)
    prediction = read_json(run_dir / "serve" / args.build / "prediction.json")
    cpu = on_cpu()
    dtype = None
    if cpu:
        from moeshrink.serve import memory
        from moeshrink.serve.served_memory import for_cpu

        build_config = read_json(build_dir / "config.json")
        dtype = memory.serving_dtype(serve["dtype"], build_config, cpu_facts())
        prediction = for_cpu(prediction, memory.cpu_kind(cpu_facts(), memory.served_as(build_config, dtype)), dtype)
    env = {**server_env(cpu), **dict(e.split("=", 1) for e in args.env)}
    out = Path(tempfile.mkdtemp(prefix="serve-profile-"))
    server = VLLMServer(build_dir, out / "server.log", args=server_args(serve, prediction.get("kv_cache_bytes") if cpu
                                                                        else None, dtype) + args.arg,
                        env=env, served_name=args.build, startup_timeout_s=1800)
    started = time.time()
    server.start()
    startup_s = time.time() - started
    endpoint = Endpoint({"base_url": server.base_url, "api_key": server.api_key, "build": args.build,
                         "served_model_name": args.build, "log": str(server.log_path), "server_pid": server.process.pid})
    procs = server_processes(server.process.pid)
    data = str(run_dir / "organism" / "data")
    reference = cfg["reference_build"]
    rows = []
    try:
        for eval_id in args.evals.split(","):
            spec = rule_params.eval_params(cfg, eval_id)
            inputs = {k: Path(v.replace("{run}", cfg["run"]))
                      for k, v in eval_kinds.get(eval_id).set_files(cfg["evals"][eval_id], data).items()}
            is_reference = eval_id == "agreement" and args.build == reference
            ref_file = (out / "agreement_reference.npz" if is_reference else
                        run_dir / "evals" / reference / "agreement_reference.npz") if eval_id == "agreement" else None
            job = EvalJob(build=args.build, eval_id=eval_id, cfg=spec, client=client, serve=serve, build_dir=build_dir,
                          server=_Lease(endpoint), out_json=out / f"{eval_id}.json", records=out / f"{eval_id}.jsonl",
                          inputs=inputs, reference_file=ref_file,
                          reference_build=None if is_reference or eval_id != "agreement" else reference)
            spies = []
            if args.py_spy:
                for role, pid in procs.items():
                    raw = out / f"{eval_id}.{role}.txt"
                    spies.append((role, raw, subprocess.Popen(
                        [args.py_spy, "record", "-p", str(pid), "-r", "50", "-f", "raw", "-o", str(raw),
                         "--nonblocking", "-d", "3600"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)))
            cpu_before = {role: cpu_seconds(pid) for role, pid in procs.items()}
            t0 = time.time()
            result = run(job)
            seconds = time.time() - t0
            cpu_used = {role: round(cpu_seconds(pid) - cpu_before[role], 1) for role, pid in procs.items()}
            for _, _, spy in spies:
                spy.send_signal(signal.SIGINT)
            profile = {}
            for role, raw, spy in spies:
                spy.wait(timeout=60)
                if raw.exists():
                    profile[role] = summarize(raw)
            row = {"eval": eval_id, "seconds": round(seconds, 1), "items": result.get("items"),
                   "server_cpu_s": cpu_used, "profile": profile}
            rows.append(row)
            print(json.dumps(row), flush=True)
    finally:
        server.stop()
    facts = cpu_facts()
    summary = {"build": args.build, "startup_s": round(startup_s, 1), "dtype": dtype, "env": env, "extra_args": args.arg,
               "client": client, "cpu_model": cpu_model(), "cpu_isa_flags": cpu_isa(),
               "cpu_facts": facts.as_dict() if facts else None, "rows": rows, "outputs": str(out),
               "total_eval_s": round(sum(r["seconds"] for r in rows), 1)}
    print(json.dumps({k: v for k, v in summary.items() if k != "rows"}))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(summary, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
