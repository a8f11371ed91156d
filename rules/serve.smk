# Stage 3: a build's vLLM server is shared by reference (moeshrink/serve/server_lease.py). The memory job
# and every eval lease it: the first starts it, later ones attach, and it stops once none has held it
# for serve.idle_grace_s; so a rerun of one eval starts the server only if none is up. No job owns the
# server, so none reruns because another did. Locally the machine's server slots
# (serve.servers_per_machine) decide how many servers run at once, the builds queue for them in config
# order (the reference first), and `priority:` makes Snakemake run one build's jobs before the next's.
# On a cluster a build's jobs form one group: one node, the server's GPUs.


rule serve_prediction:
    input:
        manifest="results/{run}/builds/{build}/manifest.json",
    output:
        prediction="results/{run}/serve/{build}/prediction.json",
    params:
        serve=serve_params(config),
    log:
        "logs/{run}/serve/{build}/prediction.log",
    group:
        "serve_{build}"
    priority: build_priority
    # on a cluster this job opens the build's group on its node: it carries the server's CPUs
    # (profiles/slurm sets them) and GPUs
    resources:
        **SERVER_NODE,
        mem_mb=2000,
        runtime=10,
    conda:
        "../envs/serve.yaml"
    script:
        "../scripts/serve_prediction.py"


rule serve_memory:
    input:
        unpack(after_reference),
        manifest="results/{run}/builds/{build}/manifest.json",
        prediction="results/{run}/serve/{build}/prediction.json",
    output:
        memory="results/{run}/serve/{build}/memory.json",
    params:
        serve=serve_params(config),
    log:
        "logs/{run}/serve/{build}/memory.log",
    group:
        "serve_{build}"
    priority: server_queue_priority
    # one core on one machine, so that Snakemake runs as many at once as it has cores, the highest
    # priority first (one build's jobs, then the next's); none in a cluster group (profiles/slurm)
    threads: 1
    # it carries the server's memory on a cluster node (it runs beside the evals there; the server
    # lives while they do)
    resources:
        **SERVER_NODE,
        mem_mb=lambda wildcards, input: 4000 + 2 * input.size_mb,
        runtime=lambda wildcards: 10 + int(config["serve"]["startup_timeout_s"]) // 60,
    conda:
        "../envs/serve.yaml"
    script:
        "../scripts/serve_memory.py"
