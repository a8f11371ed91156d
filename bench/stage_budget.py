"""Wall time per stage and per build of a finished run, against the time budget (issue 18).

Reads Snakemake's own log of the run (`.snakemake/log/*.snakemake.log`, the newest unless named):
every job's start and end as Snakemake printed them (1 s resolution). A stage's wall time is the
union of its jobs' intervals, so jobs that ran side by side count once; the whole run is its first
start to its last end.

    .venv/bin/python bench/stage_budget.py --workdir . [--log FILE] [--install-s 140] [--json out.json]
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import re
import sys
from pathlib import Path

STAGES = {  # stage: (rules, budget in seconds on 2 cores)
    "organism data + tokenizer + training": (
        ("organism_data", "organism_tokenizer", "organism_train", "organism_shipped", "upstream"), 630),
    "organism card": (("upstream_bf16_twin", "organism_card"), 90),
    "builds (all shards, all builds)": (("build_plan", "build_shard", "build_gather"), 60),
    "serve + memory + evals, all builds": (
        ("serve_prediction", "serve_memory", "eval", "eval_agreement", "eval_agreement_reference"), 660),
    "compare + report": (("compare", "compare_pair", "compare_summary", "report", "report_latest"), 30),
}
RUN_BUDGET_S = 15 * 60  # the main command on 2 cores, install not counted (issue 35: on an AVX2-only CPU)

_STAMP = re.compile(r"^\[(\w{3} \w{3} +\d+ \d\d:\d\d:\d\d \d{4})\]$")
_RULE = re.compile(r"^\s*(?:local)?(?:rule|checkpoint) (\w+):$")
_JOBID = re.compile(r"^\s*jobid: (\d+)$")
_WILDCARDS = re.compile(r"^\s*wildcards: (.*)$")
_FINISHED = re.compile(r"^Finished jobid: (\d+) \(Rule: (\w+)\)")


def jobs_of(log: Path) -> list[dict]:
    """[{rule, build, start, end}] for every job the log shows finished."""
    stamp = None
    started: dict[int, dict] = {}
    pending: dict | None = None
    finished = []
    for line in log.read_text().splitlines():
        if match := _STAMP.match(line):
            stamp = dt.datetime.strptime(match[1], "%a %b %d %H:%M:%S %Y")
        elif match := _RULE.match(line):
            pending = {"rule": match[1], "build": None, "start": stamp}
        elif (match := _JOBID.match(line)) and pending is not None:
            started[int(match[1])] = pending
        elif (match := _WILDCARDS.match(line)) and pending is not None:
            wildcards = dict(item.split("=", 1) for item in match[1].split(", "))
            pending["build"] = wildcards.get("build")
        elif match := _FINISHED.match(line):
            job = started.get(int(match[1]))
            if job is not None and job["start"] is not None:
                finished.append({**job, "end": stamp})
    return finished


def union_seconds(intervals: list[tuple[dt.datetime, dt.datetime]]) -> float:
    total, reach = 0.0, None
    for start, end in sorted(intervals):
        if reach is None or start > reach:
            total += (end - start).total_seconds()
            reach = end
        elif end > reach:
            total += (end - reach).total_seconds()
            reach = end
    return total


def budget_table(jobs: list[dict], install_s: float | None) -> dict:
    stages = []
    for stage, (rules, budget) in STAGES.items():
        mine = [j for j in jobs if j["rule"] in rules]
        seconds = union_seconds([(j["start"], j["end"]) for j in mine])
        per_build = {}
        for build in sorted({j["build"] for j in mine if j["build"]}):
            per_build[build] = union_seconds([(j["start"], j["end"]) for j in mine if j["build"] == build])
        stages.append({"stage": stage, "jobs": len(mine), "seconds": seconds, "budget_s": budget,
                       "within": seconds <= budget, "per_build_s": per_build})
    run_s = (max(j["end"] for j in jobs) - min(j["start"] for j in jobs)).total_seconds() if jobs else 0.0
    main_s = run_s + (install_s or 0.0)
    return {"stages": stages, "run_s": run_s, "run_budget_s": RUN_BUDGET_S, "run_within": run_s <= RUN_BUDGET_S,
            "install_s": install_s, "main_command_s": main_s}


def serving_facts(workdir: Path, builds: list[str]) -> dict:
    """What each build's server computed on (its memory.json: the dtype served, vLLM's CPU kind, the CPU
    facts torch reported, the host's ISA flags), for the builds the run served."""
    served = {}
    for memory_json in sorted(workdir.glob("results/*/serve/*/memory.json")):
        if memory_json.parent.name not in builds:
            continue
        memory = json.loads(memory_json.read_text())
        cpu = memory.get("cpu") or {}
        host = memory.get("provenance", {}).get("host", {})
        served[memory_json.parent.name] = {
            "serving_dtype": memory.get("serving_dtype"), "cpu_kind": cpu.get("kind"), "cpu_facts": cpu.get("facts"),
            "processor": host.get("processor"), "isa": host.get("isa"), "run": memory_json.parent.parent.parent.name}
    return served


def print_table(table: dict, log: Path) -> None:
    print(f"from {log}")
    for build, facts in table.get("serving", {}).items():
        torch_facts = facts["cpu_facts"] or {}
        print(f"  {build}: served in {facts['serving_dtype']} on {facts['processor']} (ISA {' '.join(facts['isa'] or [])}; "
              f"torch reports {', '.join(k for k, v in torch_facts.items() if v is True) or 'none'}; vLLM CPU kind "
              f"{facts['cpu_kind']})")
    print(f"{'stage':42} {'jobs':>4} {'wall s':>8} {'budget s':>8} {'ratio':>6}")
    for row in table["stages"]:
        ratio = row["seconds"] / row["budget_s"]
        print(f"{row['stage']:42} {row['jobs']:>4} {row['seconds']:>8.0f} {row['budget_s']:>8} {ratio:>6.2f}"
              f"{'' if row['within'] else '  over budget'}")
        for build, seconds in row["per_build_s"].items():
            if row["stage"].startswith("serve"):
                print(f"  {build:40} {'':>4} {seconds:>8.0f}")
    print(f"{'run (first job start to last job end)':42} {'':>4} {table['run_s']:>8.0f} {table['run_budget_s']:>8} "
          f"{table['run_s'] / table['run_budget_s']:>6.2f}{'' if table['run_within'] else '  over budget'}")
    if table["install_s"] is not None:
        print(f"{'main command from clean (install + run)':42} {'':>4} {table['main_command_s']:>8.0f}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, default=Path("."))
    parser.add_argument("--log", type=Path, help="a Snakemake log (default: the workdir's newest)")
    parser.add_argument("--install-s", type=float, help="seconds ./install.sh took, for the main command's total")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    log = args.log or max((args.workdir / ".snakemake/log").glob("*.snakemake.log"), default=None)
    if log is None:
        print(f"no Snakemake log under {args.workdir}/.snakemake/log: run the workflow first", file=sys.stderr)
        return 2
    jobs = jobs_of(log)
    if not jobs:
        print(f"{log}: no finished job found", file=sys.stderr)
        return 2
    table = budget_table(jobs, args.install_s)
    table["serving"] = serving_facts(args.workdir, sorted({j["build"] for j in jobs if j["build"]}))
    print_table(table, log)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"log": str(log), **table}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
