from pathlib import Path

from moeshrink import smk, stages

smk.run(snakemake, lambda: stages.serve_prediction(
    snakemake.wildcards.build, Path(snakemake.input.manifest).parent, smk.serve_config(snakemake),
    Path(snakemake.output.prediction)))
