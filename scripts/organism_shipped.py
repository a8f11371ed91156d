from pathlib import Path

from moeshrink import smk, stages

smk.run(snakemake, lambda: stages.organism_shipped(
    snakemake.params.organism, Path(snakemake.input.shipped[0]).parent, Path(snakemake.input.tokenizer).parent,
    Path(snakemake.output.model).parent))
