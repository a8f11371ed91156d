"""Where a study's files live. Each config names its study (`run`, default `organism`); everything the
workflow makes for it is under results/<run>/, logs/<run>/, benchmarks/<run>/ and report/<run>/, so two
studies in one folder never read or overwrite each other's files. The rules spell the same layout as
literal paths with a `{run}` wildcard that can only match the config's run."""
from __future__ import annotations

from pathlib import Path


def results_dir(config: dict) -> Path:
    return Path("results") / config["run"]


def report_file(config: dict) -> Path:
    return Path("report") / config["run"] / "r013.html"



def benchmarks_dir(config: dict) -> Path:
    return Path("benchmarks") / config["run"]
