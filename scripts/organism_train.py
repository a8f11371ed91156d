from pathlib import Path

from moeshrink import smk, stages

smk.run(snakemake, lambda: stages.organism_train(
    snakemake.params.model, {**snakemake.params.train, "threads": snakemake.threads}, Path(snakemake.input.corpus).parent,
    Path(snakemake.input.tokenizer).parent, Path(snakemake.output.model).parent))
