from pathlib import Path

from moeshrink import smk, stages

smk.run(snakemake, lambda: stages.bf16_twin(Path(snakemake.input.manifest).parent,
                                            Path(snakemake.output.manifest).parent))
