# Stage 3: one vLLM server per build per run. `serve` is a Snakemake service job: Snakemake runs
# it together with the jobs that consume its endpoint (one group per build) and terminates it
# (SIGTERM) once they have all finished; it stops its server's whole process group. Evals of one
# build share its server; builds never share one.


rule serve_prediction:
    input:
        manifest="results/builds/{build}/manifest.json",
    output:
        prediction="results/serve/{build}/prediction.json",
    params:
        serve=serve_params(config),
    log:
        "logs/serve/{build}/prediction.log",
    resources:
        **CPU_JOB,
        mem_mb=2000,
        runtime=10,
    script:
        "../scripts/serve_prediction.py"


rule serve:
    input:
        manifest="results/builds/{build}/manifest.json",
        prediction="results/serve/{build}/prediction.json",
    output:
        endpoint=service("results/serve/{build}/endpoint.json"),
    params:
        serve=lambda wildcards: json.dumps(serve_params(config)),
    log:
        "results/serve/{build}/server.log",
    # one server at a time on a machine: vLLM's CPU build pins its engine to the same cores in every
    # server it starts (a GPU server takes the node's cards); its evals ride along with 0 threads.
    # On a cluster each server job has a node of its own; profiles/slurm sets its CPUs.
    threads: machine_cores()
    resources:
        **SERVICE_JOB,
        mem_mb=lambda wildcards, input: 4000 + 2 * input.size_mb,
        runtime=lambda wildcards: 60 + int(config["serve"]["startup_timeout_s"]) // 60,
        gpu=CLUSTER["server_gpus"],
    shell:
        # The endpoint must exist within Snakemake's latency wait: say `starting` before Python loads.
        # exec: the supervisor itself (same pid) receives Snakemake's SIGTERM.
        "printf '{{\"state\": \"starting\", \"supervisor_pid\": %d}}' $$ > {output.endpoint} && "
        # (the interpreter and the timeouts are no params: they change nothing the server computes)
        "exec {PYTHON} -m moeshrink serve --build {wildcards.build} --model-dir results/builds/{wildcards.build} "
        "--serve-json {params.serve:q} --operational-json {SERVE_OPERATIONAL_JSON:q} "
        "--prediction {input.prediction} --endpoint {output.endpoint} --log {log}"


rule serve_memory:
    input:
        manifest="results/builds/{build}/manifest.json",
        prediction="results/serve/{build}/prediction.json",
        endpoint="results/serve/{build}/endpoint.json",
    output:
        memory="results/serve/{build}/memory.json",
    params:
        serve=serve_params(config),
    log:
        "logs/serve/{build}/memory.log",
    # runs beside its server (same service group) and only waits on HTTP: it takes no core of its own,
    # so a group fits in one core's worth of scheduling (--cores 1, dry runs)
    threads: 0
    resources:
        **SERVICE_JOB,
        mem_mb=1000,
        runtime=lambda wildcards: 10 + int(config["serve"]["startup_timeout_s"]) // 60,
    script:
        "../scripts/serve_memory.py"
