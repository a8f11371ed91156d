from pathlib import Path

from moeshrink import smk
from moeshrink.report import render

smk.run(snakemake, lambda: render.render({k: Path(v) for k, v in snakemake.input.items()}, snakemake.params.config,
                                         Path(snakemake.output.html)))
