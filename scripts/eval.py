from pathlib import Path

from moeshrink import smk
from moeshrink.evals.run import EvalJob, run

SPECIAL_INPUTS = {"manifest", "prediction", "reference", "after_reference"}

reference = snakemake.output.get("reference") or snakemake.input.get("reference")
job = EvalJob(
    build=snakemake.wildcards.build, eval_id=snakemake.wildcards.eval, cfg=snakemake.params.spec,
    client=smk.client_config(snakemake), serve=smk.serve_config(snakemake),
    build_dir=Path(snakemake.input.manifest).parent, server=smk.server_lease(snakemake),
    out_json=Path(snakemake.output.result), records=Path(snakemake.output.records),
    inputs={name: Path(path) for name, path in snakemake.input.items() if name not in SPECIAL_INPUTS},
    reference_file=Path(reference) if reference else None,
    reference_build=snakemake.params.get("reference_build"))
try:  # the eval leases the build's server when it first needs it (after checking its set)
    smk.run(snakemake, lambda: run(job))
finally:
    job.server.release()
