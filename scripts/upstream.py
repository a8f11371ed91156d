from pathlib import Path

from moeshrink import smk, stages

trained = Path(snakemake.input.model).parent if "model" in snakemake.input.keys() else None
tokenizer = Path(snakemake.input.tokenizer).parent if "tokenizer" in snakemake.input.keys() else None
smk.run(snakemake, lambda: stages.upstream(
    snakemake.params.upstream, Path(snakemake.output.manifest).parent, trained, tokenizer, snakemake.threads))
