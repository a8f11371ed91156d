from pathlib import Path

from moeshrink import smk, stages
from moeshrink.core.ioutil import read_json

calibration = snakemake.input.get("calibration")
smk.run(snakemake, lambda: stages.build_plan(
    snakemake.wildcards.build, snakemake.params.build, Path(snakemake.input.manifest).parent,
    read_json(snakemake.input.manifest), Path(snakemake.output.plan), Path(calibration) if calibration else None))
