from pathlib import Path

from moeshrink import smk, stages

smk.run(snakemake, lambda: stages.expert_importance(
    snakemake.params.calibration, Path(snakemake.input.manifest).parent, Path(snakemake.input.calibration),
    Path(snakemake.output.importance)))
