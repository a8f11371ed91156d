"""The vLLM plugin end to end: each packed build (original in MXFP4, twx3, twx2_5) served through
the plugin against its bf16 twin served plainly (unquantized), on the same prompts.

    python bench/plugin_agreement.py --workdir . [--prompts 11 --length 500] --json bench/results/plugin_agreement.json

Needs a finished run of the workflow in --workdir (results/organism/upstream, results/organism/upstream-bf16,
results/organism/builds/*); makes the twx builds' twins under --twins. Prints, per build: greedy next-token
agreement and mean KL(twin || packed) over every prompt position (whole-vocabulary prompt
log-probabilities), and the weight bytes vLLM holds (the plugin's `--load-format moeshrink` line)
against the original's, beside the checkpoint size ratio. Targets: agreement >= 99.5% over
>= 5,000 positions, mean KL <= 1e-3, weight ratio within 5% of the checkpoint ratio.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

import numpy as np

from moeshrink.core.ioutil import atomic_write_json, read_json
from moeshrink.core.provenance import Provenance
from moeshrink.evals import next_token
from moeshrink.serve.supervisor import on_cpu, server_env
from moeshrink.serve.vllm_server import VLLMServer
from moeshrink.upstream.twin import make_twin
from moeshrink_kernels import WEIGHTS_LINE
from moeshrink_kernels.vllm import LOAD_FORMAT


def corpus_prompts(workdir: Path, count: int, length: int) -> list[list[int]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(workdir / "results/organism/upstream"))
    stream: list[int] = []
    with open(workdir / "results/organism/organism/data/corpus.jsonl") as f:
        for line in f:
            stream += tokenizer(json.loads(line)["text"], add_special_tokens=False)["input_ids"]
            stream.append(tokenizer.eos_token_id)
            if len(stream) > count * length:
                break
    return [stream[i * length:(i + 1) * length] for i in range(count)]


def serve(folder: Path, log: Path, prompts: list[list[int]], vocab: int) -> tuple[np.ndarray, dict | None]:
    args = ["--max-model-len", "2048", "--dtype", "bfloat16", "--max-logprobs", "-1", "--load-format", LOAD_FORMAT]
    # the workflow's own server environment: on a CPU, a compile cache that later starts reuse
    env = {"VLLM_CPU_KVCACHE_SPACE": "1", **server_env(on_cpu())}
    with VLLMServer(folder, log, args=args, env=env, served_name="m") as server:
        table = np.concatenate([next_token.prompt_logprobs(server, "m", p, vocab) for p in prompts])
    match = re.search(re.escape(WEIGHTS_LINE) + r" (\{.*\})", log.read_text())
    return table, json.loads(match[1]) if match else None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", type=Path, default=Path("."))
    parser.add_argument("--twins", type=Path, default=Path("results/organism/bench-twins"))
    parser.add_argument("--builds", default="original,twx3,twx2_5")
    parser.add_argument("--prompts", type=int, default=11)
    parser.add_argument("--length", type=int, default=500)
    parser.add_argument("--logs", type=Path, default=Path("logs/bench"))
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    prov = Provenance("bench_plugin_agreement", {k: str(v) for k, v in vars(args).items()})
    work = args.workdir
    vocab = read_json(work / "results/organism/upstream/config.json")["vocab_size"]
    prompts = corpus_prompts(work, args.prompts, args.length)
    args.logs.mkdir(parents=True, exist_ok=True)
    results: dict = {}
    for build in args.builds.split(","):
        packed_dir = work / f"results/organism/builds/{build}"
        twin_dir = work / "results/organism/upstream-bf16" if build == "original" else args.twins / build
        if not (twin_dir / "config.json").exists():
            make_twin(packed_dir, twin_dir)
        start = time.perf_counter()
        twin, twin_weights = serve(twin_dir, args.logs / f"{build}-twin.log", prompts, vocab)
        packed, packed_weights = serve(packed_dir, args.logs / f"{build}.log", prompts, vocab)
        results[build] = {**next_token.compare(twin, packed), "weights": packed_weights, "twin_weights": twin_weights,
                          "checkpoint_bytes": read_json(packed_dir / "manifest.json")["total_bytes"],
                          "seconds": time.perf_counter() - start}
        print(build, json.dumps({k: v for k, v in results[build].items() if k != "seconds"}), flush=True)
    ok = True
    if "original" in results and results["original"]["weights"]:
        base = results["original"]
        for build, figures in results.items():
            weight_ratio = figures["weights"]["weight_bytes"] / base["weights"]["weight_bytes"]
            checkpoint_ratio = figures["checkpoint_bytes"] / base["checkpoint_bytes"]
            figures["weight_ratio"], figures["checkpoint_ratio"] = weight_ratio, checkpoint_ratio
            print(f"{build}: greedy agreement {figures['greedy_agreement']:.4f} over {figures['positions']} positions, "
                  f"mean KL {figures['mean_kl']:.2e}; weights held {weight_ratio:.3f} of the original's against a "
                  f"checkpoint ratio of {checkpoint_ratio:.3f} ({weight_ratio / checkpoint_ratio - 1:+.1%})")
            ok &= (figures["greedy_agreement"] >= 0.995 and figures["mean_kl"] <= 1e-3
                   and abs(weight_ratio / checkpoint_ratio - 1) <= 0.05)
    if args.json:
        atomic_write_json(args.json, {**results, "provenance": prov.record()})
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
