# moeshrink: smaller builds of a published MoE, served with vLLM, evaluated side by side.
# `snakemake --cores all report/r013.html` on the embedded default (config.yaml);
# `snakemake --cores all report/r013.html --configfile presets/kimi-k3.1-pro.yaml` for a real model
# (a preset is laid over config.yaml and names only what differs; --replace-workflow-config makes a
# config file of your own replace it; --configfile takes several files, so name targets before it).
# Each study (config key `run`) has its own results/<run>/, logs/<run>/, benchmarks/<run>/ and
# report/<run>/r013.html; report/r013.html is a copy of the configured study's report.

import os

from snakemake.exceptions import WorkflowError

from moeshrink.core.config import ConfigError, validate

configfile: "config.yaml"

CONFIG_LAYERS = [*([] if workflow.config_settings.replace_workflow_config else ["config.yaml"]),
                 *map(str, workflow.overwrite_configfiles or [])]
try:
    validate(config, source=" + ".join(CONFIG_LAYERS))
except ConfigError as error:
    raise WorkflowError(str(error))

# each stage's environment (envs/, `snakemake --sdm conda`) installs moeshrink from this source
os.environ["MOESHRINK_SOURCE"] = workflow.basedir


include: "rules/common.smk"
include: "rules/upstream.smk"
include: "rules/compress.smk"
include: "rules/serve.smk"
include: "rules/evals.smk"
include: "rules/compare.smk"
include: "rules/report.smk"


rule all:
    default_target: True
    input:
        "report/r013.html",


# The builds' servers outlive their last job by serve.idle_grace_s (jobs back to back reuse them); once
# the workflow ends there is no next job, so its idle servers stop now.
onsuccess:
    stop_idle_servers()


onerror:
    stop_idle_servers()
