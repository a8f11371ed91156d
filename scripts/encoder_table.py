from pathlib import Path

from moeshrink import smk, stages

smk.run(snakemake, lambda: stages.encoder_table(snakemake.wildcards.table, int(snakemake.wildcards.bits),
                                                Path(snakemake.output.table)))
