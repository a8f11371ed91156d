from pathlib import Path

from moeshrink import smk, stages

smk.run(snakemake, lambda: stages.build_gather(Path(snakemake.output.manifest).parent,
                                               Path(snakemake.input.upstream).parent, Path(snakemake.input.plan),
                                               [Path(s).name for s in snakemake.input.shards]))
