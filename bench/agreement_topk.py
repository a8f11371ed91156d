"""How far under the exact KL the agreement's top-K estimate falls, per K: every build served with the
workflow's flags reads the whole vocabulary on the exact check's passages; the estimate is then computed
from the top K of those tables (plus the actual token, as the server returns them) for each K.

    .venv/bin/python bench/agreement_topk.py --workdir <finished run> --k 100 200 300 400 [--json out.json]

Needs a finished run of the embedded default (builds, the reference's agreement passages).
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import numpy as np

from moeshrink.core import config as config_mod
from moeshrink.core import rule_params
from moeshrink.core.ioutil import read_json
from moeshrink.core.machine import cpu_facts
from moeshrink.evals import agreement
from moeshrink.evals.client import RequestPool
from moeshrink.serve import memory
from moeshrink.serve.served_memory import for_cpu
from moeshrink.serve.supervisor import server_args, server_env
from moeshrink.serve.vllm_server import VLLMServer


def top_from_table(table: np.ndarray, actual: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """What the server returns at top-K: each position's K most likely tokens plus the actual next token,
    as reply_top would array them (descending, width K + 1)."""
    order = np.argsort(-table, axis=1, kind="stable")[:, :k]
    ids = np.full((len(table), k + 1), agreement.PAD_ID, dtype=np.int64)
    lp = np.full((len(table), k + 1), -np.inf)
    for row in range(len(table)):
        listed = list(order[row]) + ([int(actual[row])] if int(actual[row]) not in order[row] else [])
        listed.sort(key=lambda t: -table[row, t])
        ids[row, :len(listed)] = listed
        lp[row, :len(listed)] = table[row, listed]
    return ids, lp


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, default=Path("."))
    parser.add_argument("--k", type=int, nargs="+", default=[100, 200, 300, 400])
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    workdir = args.workdir.resolve()
    cfg = config_mod.load(workdir / "config.yaml", base=None)
    run_dir = workdir / "results" / cfg["run"]
    spec = rule_params.eval_params(cfg, "agreement")
    reference = agreement.load_reference(run_dir / "evals" / cfg["reference_build"] / "agreement_reference.npz")
    prompts = agreement.exact_prompts(list(zip(reference["passage_ids"], reference["token_ids"])), spec)
    actual = np.concatenate([np.array(ids[1:]) for _, ids in prompts])
    serve = {**rule_params.serve_params(cfg), **rule_params.operational(cfg)["serve"]}
    tables = {}
    for build in cfg["builds"]:
        build_dir = run_dir / "builds" / build
        config = read_json(build_dir / "config.json")
        dtype = memory.serving_dtype(serve["dtype"], config, cpu_facts())
        prediction = for_cpu(read_json(run_dir / "serve" / build / "prediction.json"),
                             memory.cpu_kind(cpu_facts(), memory.served_as(config, dtype)), dtype)
        with tempfile.TemporaryDirectory() as tmp, \
                VLLMServer(build_dir, Path(tmp) / "server.log", args=server_args(serve, prediction["kv_cache_bytes"], dtype),
                           env=server_env(True), served_name=build) as server:
            pool = RequestPool(server, 8, 1, 600, label=f"{build}/exact")
            tables[build] = agreement.read_full(pool, build, prompts, config["vocab_size"])
    reference_table = tables[cfg["reference_build"]]
    rows = []
    for build, table in tables.items():
        if build == cfg["reference_build"]:
            continue
        exact = agreement.compare(reference_table, table)["mean_kl"]
        row = {"build": build, "positions": len(table), "exact_mean_kl": exact}
        for k in args.k:
            ref_ids, ref_lp = top_from_table(reference_table, actual, k)
            ids, lp = top_from_table(table, actual, k)
            estimate = float(agreement.position_figures(ref_ids, ref_lp, ids, lp)[1].mean())
            row[f"under_exact_at_top{k}"] = (exact - estimate) / exact if exact > 0 else 0.0
        rows.append(row)
        print(json.dumps(row))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"rows": rows, "dtype": dtype, "k": args.k}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
