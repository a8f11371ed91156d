from pathlib import Path

from moeshrink import smk
from moeshrink.compare import paired

wildcards = snakemake.wildcards
pair = "a" in wildcards.keys()
a_id = wildcards.a if pair else snakemake.params.reference
b_id = wildcards.b if pair else wildcards.build
smk.run(snakemake, lambda: paired.run({key: Path(path) for key, path in snakemake.input.items()}, a_id, b_id,
                                       getattr(snakemake.params, "judging", {}), Path(snakemake.output.result),
                                       against_reference=not pair))
