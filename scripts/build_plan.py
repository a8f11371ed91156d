from pathlib import Path

from moeshrink import smk, stages
from moeshrink.core.ioutil import read_json


def optional_path(key: str) -> Path | None:
    value = snakemake.input.get(key)
    return Path(value) if value else None


smk.run(snakemake, lambda: stages.build_plan(
    snakemake.wildcards.build, snakemake.params.build, Path(snakemake.input.manifest).parent,
    read_json(snakemake.input.manifest), Path(snakemake.output.plan), optional_path("calibration"),
    [Path(table) for table in snakemake.input.get("encoder_tables", [])], optional_path("quantize_calibration")))
