from pathlib import Path

from moeshrink import smk, stages

smk.run(snakemake, lambda: stages.build_shard(Path(snakemake.input.manifest).parent, snakemake.wildcards.shard,
                                              Path(snakemake.input.plan), Path(snakemake.output.shard)))
