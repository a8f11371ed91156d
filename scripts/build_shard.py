from pathlib import Path

from moeshrink import smk, stages
from moeshrink.core.ioutil import read_json

smk.run(snakemake, lambda: stages.build_shard(
    Path(snakemake.input.manifest).parent, read_json(snakemake.input.manifest), snakemake.wildcards.shard,
    Path(snakemake.input.plan), Path(snakemake.output.shard),
    [Path(table) for table in snakemake.input.get("encoder_tables", [])],
    Path(snakemake.input.importance) if snakemake.input.get("importance") else None))
