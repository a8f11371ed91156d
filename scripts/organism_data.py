from pathlib import Path

from moeshrink import smk, stages

smk.run(snakemake, lambda: stages.organism_data(snakemake.params.data, Path(snakemake.output[0]).parent))
