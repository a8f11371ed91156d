from pathlib import Path

from moeshrink import report, smk

smk.run(snakemake, lambda: report.render({k: Path(v) for k, v in snakemake.input.items()}, snakemake.params.config,
                                         Path(snakemake.output.html)))
