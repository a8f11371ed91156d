"""bench/stage_budget.py reads a Snakemake log into per-stage wall times: jobs that overlap count once."""
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

import stage_budget  # noqa: E402

LOG = """\
[Fri Dec  4 10:00:00 2026]
localrule organism_data:
    jobid: 4
[Fri Dec  4 10:00:10 2026]
Finished jobid: 4 (Rule: organism_data)
[Fri Dec  4 10:01:00 2026]
localrule serve_memory:
    jobid: 12
    wildcards: build=twx3
[Fri Dec  4 10:01:30 2026]
localrule eval:
    jobid: 13
    wildcards: build=twx3, eval=mmlu
[Fri Dec  4 10:03:00 2026]
Finished jobid: 13 (Rule: eval)
[Fri Dec  4 10:03:05 2026]
Finished jobid: 12 (Rule: serve_memory)
[Fri Dec  4 10:04:00 2026]
localrule report:
    jobid: 1
"""


def test_overlapping_jobs_count_once_and_unfinished_jobs_not_at_all(tmp_path):
    log = tmp_path / "run.snakemake.log"
    log.write_text(LOG)
    jobs = stage_budget.jobs_of(log)
    assert sorted((j["rule"], j["build"]) for j in jobs) == [("eval", "twx3"), ("organism_data", None),
                                                             ("serve_memory", "twx3")]
    table = stage_budget.budget_table(jobs, install_s=100.0)
    seconds = {row["stage"]: row["seconds"] for row in table["stages"]}
    assert seconds["organism data + tokenizer + training"] == 10
    assert seconds["serve + memory + evals, all builds"] == 125  # 10:01:00 to 10:03:05, not 125 + 90
    assert table["stages"][3]["per_build_s"] == {"twx3": 125}
    assert seconds["compare + report"] == 0  # the report never finished
    assert table["run_s"] == 185 and table["main_command_s"] == 285 and table["run_within"]


def test_the_script_names_a_workdir_without_a_log(tmp_path):
    result = subprocess.run([sys.executable, str(ROOT / "bench/stage_budget.py"), "--workdir", str(tmp_path)],
                            capture_output=True, text=True)
    assert result.returncode == 2 and "no Snakemake log" in result.stderr
