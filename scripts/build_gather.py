from pathlib import Path

from moeshrink import smk, stages
from moeshrink.core.ioutil import read_json

smk.run(snakemake, lambda: stages.build_gather(
    Path(snakemake.output.manifest).parent, Path(snakemake.input.upstream).parent, read_json(snakemake.input.upstream),
    Path(snakemake.input.plan), [Path(s).name for s in snakemake.input.shards]))
