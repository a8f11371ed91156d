from pathlib import Path

from moeshrink import smk, stages

smk.run(snakemake, lambda: stages.build_plan(snakemake.wildcards.build, snakemake.params.build,
                                             Path(snakemake.input.manifest).parent, Path(snakemake.output.plan)))
