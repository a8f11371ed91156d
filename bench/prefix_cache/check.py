"""Does a cached prompt prefix change what a served build answers? One server with prefix caching kept on
(bench/prefix_cache/sitecustomize.py) and the workflow's flags; the same prompt (a 300-token prefix and a
20-token tail from the organism's corpus) asked three ways: first (nothing cached), again (the prefix read
from the cache), and with prompt log-probabilities (vLLM reads no cache for those). Prints, per way, whether
the 12 greedy tokens match the first answer and the largest difference of their top-5 log-probabilities.

    .venv/bin/python bench/prefix_cache/check.py --workdir <finished run> [--build pruned75]
"""
from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import numpy as np
import yaml
from transformers import AutoTokenizer

from moeshrink.organism import datasets
from moeshrink.serve.supervisor import server_args, server_env
from moeshrink.serve.vllm_server import VLLMServer

HERE = Path(__file__).resolve().parent


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, default=Path("."))
    parser.add_argument("--build", default="pruned75")
    args = parser.parse_args()
    work = args.workdir.resolve()
    serve = yaml.safe_load((work / "config.yaml").read_text())["serve"]
    model = work / "results/organism/builds" / args.build
    tokenizer = AutoTokenizer.from_pretrained(str(model))
    corpus = datasets.read_jsonl(work / "results/organism/organism/data" / datasets.CORPUS_FILE)
    prompt = (tokenizer(" ".join(d["text"] for d in corpus[10:40]))["input_ids"][:300]
              + tokenizer(corpus[40]["text"])["input_ids"][:20])
    env = {**server_env(cpu=True), "PYTHONPATH": str(HERE)}
    with tempfile.TemporaryDirectory() as tmp, VLLMServer(
            model, Path(tmp) / "server.log", served_name=args.build, env=env,
            args=server_args(serve, kv_cache_bytes=1 << 30)) as server:
        def ask(**extra) -> tuple[list[str], np.ndarray]:
            status, reply = server.post("/v1/completions", {"model": args.build, "prompt": prompt, "max_tokens": 12,
                                                            "temperature": 0, "logprobs": 5, **extra})
            assert status == 200, reply
            logprobs = reply["choices"][0]["logprobs"]
            return logprobs["tokens"], np.array([v for top in logprobs["top_logprobs"] for v in top.values()])

        first = ask()
        ways = {"again (prefix cached)": ask(), "with prompt log-probabilities (no cache read)": ask(prompt_logprobs=1)}
        hits = sum(float(line.rsplit(" ", 1)[1]) for line in server.get_text("/metrics").splitlines()
                   if line.startswith("vllm:prefix_cache_hits_total"))
        kept = "prefix caching kept on" in (Path(tmp) / "server.log").read_text()
    report = {"build": args.build, "caching_kept_on": kept, "prefix_cache_hits_tokens": hits,
              "ways": {name: {"same_tokens": tokens == first[0],
                              "max_abs_logprob_difference": float(np.abs(values - first[1]).max())
                              if len(values) == len(first[1]) else None}
                       for name, (tokens, values) in ways.items()}}
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
