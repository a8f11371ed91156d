from pathlib import Path

from moeshrink import smk
from moeshrink.compare import summary

builds = snakemake.params.builds
smk.run(snakemake, lambda: summary.run({b: Path(p) for b, p in zip(builds, snakemake.input.compares)},
                                       {b: Path(p) for b, p in zip(snakemake.params.served, snakemake.input.memory)},
                                       snakemake.params.reference, Path(snakemake.output.summary),
                                       snakemake.params.size_limits_gib))
