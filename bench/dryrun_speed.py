"""How long a no-op rerun takes to decide that nothing is stale, against Snakemake's own fixed cost.

    python bench/dryrun_speed.py --workdir <finished run> [--repeats 3] --json bench/results/dryrun_speed.json

Times `snakemake -n report/r013.html` in a finished run (every build, eval, comparison and the
report up to date: the DAG, checkpoint re-evaluation, metadata and mtime checks of every file), and,
as the baseline in the same run, the same dry run of a one-rule workflow (interpreter start, imports,
parsing). Prints both, their ratio, and the no-op time against its target (<= 5 s).
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from moeshrink.core.ioutil import atomic_write_json
from moeshrink.core.provenance import Provenance

TARGET_S = 5.0


def dry_run_seconds(workdir: Path, target: str, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        result = subprocess.run([sys.executable, "-m", "snakemake", "-n", target], cwd=workdir, capture_output=True,
                                text=True, timeout=600)
        times.append(time.perf_counter() - started)
        if result.returncode:
            raise SystemExit(f"dry run failed in {workdir}:\n{result.stderr[-2000:]}")
        if target == "report/r013.html" and "Nothing to be done" not in result.stdout + result.stderr:
            raise SystemExit(f"{workdir} is not up to date: a dry run schedules jobs")
    return statistics.median(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", type=Path, required=True, help="a finished run of the workflow")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    prov = Provenance("bench_dryrun_speed", {"repeats": args.repeats, "workdir": str(args.workdir)})
    noop = dry_run_seconds(args.workdir, "report/r013.html", args.repeats)
    with tempfile.TemporaryDirectory() as scratch:
        Path(scratch, "Snakefile").write_text('rule a:\n    output: "a.txt"\n    shell: "touch {output}"\n')
        Path(scratch, "a.txt").write_text("")
        baseline = dry_run_seconds(Path(scratch), "a.txt", args.repeats)
    figures = {"noop_dry_run_s": round(noop, 2), "one_rule_dry_run_s": round(baseline, 2),
               "ratio": round(noop / baseline, 2), "target_s": TARGET_S, "met": noop <= TARGET_S}
    print(f"no-op dry run of the finished workflow: {noop:.2f} s (target <= {TARGET_S:g} s: "
          f"{'met' if figures['met'] else 'NOT met'}); a one-rule workflow: {baseline:.2f} s; ratio {noop / baseline:.2f}x")
    if args.json:
        atomic_write_json(args.json, {"figures": figures, "provenance": prov.record()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
