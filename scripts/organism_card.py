from pathlib import Path

from moeshrink import smk, stages

smk.run(snakemake, lambda: stages.organism_card(
    {**snakemake.params.card,
     "threads": snakemake.threads}, Path(snakemake.input.model).parent, Path(snakemake.input.tokenizer).parent,
    Path(snakemake.input.twin).parent, Path(snakemake.input.data[0]).parent, Path(snakemake.input.train),
    Path(snakemake.output.card)))
