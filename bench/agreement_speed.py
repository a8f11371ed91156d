"""Speed of the agreement eval against vLLM's own throughput on the same prompts, in one run.

    python bench/agreement_speed.py --workdir <finished run> [--build original --passages 300
        --concurrency 16] --json bench/results/agreement_speed.json

Needs a finished run in --workdir (results/organism/builds/<build>, results/organism/organism/data/corpus.jsonl, and the
config there). Measures prompt positions per second (a) of the eval's own path: the served build
read through `RequestPool` with the configured top-K prompt log-probabilities (HTTP, JSON, parsing
into arrays included), and (b) of vLLM's offline engine (`vllm.LLM`) scoring the same token ids with
the same top-K in one batch: vLLM's own throughput. Prints the ratio a/b (target >= 0.8).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from moeshrink.core import config as config_mod
from moeshrink.core.ioutil import atomic_write_json
from moeshrink.core.provenance import Provenance
from moeshrink.evals import agreement
from moeshrink.evals.client import RequestPool
from moeshrink.serve.supervisor import server_args, server_env
from moeshrink.serve.vllm_server import VLLMServer
from moeshrink_kernels.vllm import LOAD_FORMAT

KV_CACHE_BYTES = 1 << 30


def served_positions_per_s(build_dir: Path, token_ids: list[list[int]], top_k: int, concurrency: int,
                           serve: dict, log: Path) -> tuple[float, float]:
    args = server_args(serve, KV_CACHE_BYTES)
    with VLLMServer(build_dir, log, args=args, env=server_env(cpu=True), served_name="bench",
                    startup_timeout_s=1800) as server:
        pool = RequestPool(server, concurrency, retries=2, timeout_s=600)
        pool.map(agreement.ENDPOINT, [("warm-up", agreement.request("bench", token_ids[0], top_k))])
        started = time.perf_counter()
        agreement.read_top(pool, "bench", [(str(i), ids) for i, ids in enumerate(token_ids)], top_k, top_k + 1)
        seconds = time.perf_counter() - started
    return sum(len(t) - 1 for t in token_ids) / seconds, seconds


def offline_positions_per_s(build_dir: Path, token_ids: list[list[int]], top_k: int, serve: dict) -> tuple[float, float]:
    import os

    # the engine in this process: the plugin's config classes are made at registration and cannot be pickled
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=str(build_dir), max_model_len=serve["max_model_len"], max_logprobs=max(top_k, 20),
              load_format=LOAD_FORMAT, kv_cache_memory_bytes=KV_CACHE_BYTES)
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=top_k)
    llm.generate([TokensPrompt(prompt_token_ids=token_ids[0])], params, use_tqdm=False)
    started = time.perf_counter()
    llm.generate([TokensPrompt(prompt_token_ids=ids) for ids in token_ids], params, use_tqdm=False)
    seconds = time.perf_counter() - started
    return sum(len(t) - 1 for t in token_ids) / seconds, seconds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", type=Path, default=Path("."))
    parser.add_argument("--build", default="original")
    parser.add_argument("--passages", type=int)
    parser.add_argument("--concurrency", type=int)
    parser.add_argument("--log", type=Path, default=Path("logs/bench/agreement_speed.log"))
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    config = config_mod.load(args.workdir / "config.yaml")
    spec = config["evals"]["agreement"]
    passages = args.passages or spec["passages"]
    concurrency = args.concurrency or config["evals"]["client"]["concurrency"]
    prov = Provenance("bench_agreement_speed", {"agreement": spec, "passages": passages, "concurrency": concurrency})
    build_dir = args.workdir / "results/organism/builds" / args.build
    texts = [json.loads(line) for line in open(args.workdir / "results/organism/organism/data/corpus.jsonl")]
    token_ids = agreement.tokenize(build_dir, agreement.pick_passages(texts, passages, "the corpus"), spec["max_tokens"])
    served, served_s = served_positions_per_s(build_dir, token_ids, spec["top_k"], concurrency, config["serve"], args.log)
    offline, offline_s = offline_positions_per_s(build_dir, token_ids, spec["top_k"], config["serve"])
    ratio = served / offline
    result = {"build": args.build, "passages": passages, "positions": sum(len(t) - 1 for t in token_ids),
              "top_k": spec["top_k"], "concurrency": concurrency,
              "eval_positions_per_s": served, "eval_seconds": served_s,
              "vllm_offline_positions_per_s": offline, "vllm_offline_seconds": offline_s,
              "ratio": ratio, "target": 0.8, "provenance": prov.record()}
    print(f"agreement eval {served:,.0f} positions/s vs vLLM offline {offline:,.0f} positions/s: {ratio:.2f}x "
          f"(target >= 0.8)")
    if args.json:
        atomic_write_json(args.json, result)
    return 0 if ratio >= 0.8 else 1


if __name__ == "__main__":
    sys.exit(main())
