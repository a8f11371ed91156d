from pathlib import Path

from moeshrink import smk, stages

smk.run(snakemake, lambda: stages.organism_tokenizer(
    snakemake.params.tokenizer, Path(snakemake.input.corpus).parent, Path(snakemake.output.tokenizer).parent))
