from pathlib import Path

from moeshrink import smk, stages

smk.run(snakemake, lambda: stages.serve_memory(
    snakemake.wildcards.build, Path(snakemake.input.manifest).parent, snakemake.params.serve,
    Path(snakemake.input.prediction), Path(snakemake.input.endpoint), Path(snakemake.output.memory)))
