from pathlib import Path

from moeshrink import smk, stages


def measure() -> dict:
    with smk.server_lease(snakemake) as endpoint:
        return stages.serve_memory(snakemake.wildcards.build, Path(snakemake.input.manifest).parent,
                                   smk.serve_config(snakemake), Path(snakemake.input.prediction), endpoint,
                                   Path(snakemake.output.memory))


smk.run(snakemake, measure)
