# Stage 4: the five evals. Each job leases its build's server (rules/serve.smk) and takes one core
# (its client's work; the server runs beside it outside Snakemake's count), so Snakemake runs as many
# at once as the machine has cores, the highest priority first: one build's jobs, then the next's. The
# reference reads the agreement passages first; its stored top-K is the input of every other build's
# agreement.

GENERIC_EVALS = [e for e in EVAL_IDS if e != "agreement"]
OTHER_BUILDS = [b for b in BUILD_IDS if b != REFERENCE_BUILD]
NO_MATCH = "(?!)"


def eval_spec(wildcards):
    return eval_params(config, wildcards.eval)


rule eval:
    input:
        unpack(eval_inputs),
    output:
        result="results/{run}/evals/{build}/{eval}.json",
        records="results/{run}/evals/{build}/{eval}.jsonl",
    wildcard_constraints:
        eval="|".join(GENERIC_EVALS) or NO_MATCH,
    params:
        spec=eval_spec,
        serve=serve_params(config),
    log:
        "logs/{run}/evals/{build}/{eval}.log",
    benchmark:
        "benchmarks/{run}/evals/{build}/{eval}.tsv"
    group:
        "serve_{build}"
    priority: server_queue_priority
    # one core on one machine, so that Snakemake runs as many at once as it has cores, the highest
    # priority first (one build's jobs, then the next's); none in a cluster group (profiles/slurm)
    threads: 1
    resources:
        **SERVER_NODE,
        mem_mb=4000,
        runtime=lambda wildcards: 120 + int(config["serve"]["startup_timeout_s"]) // 60,
    conda:
        "../envs/serve.yaml"
    script:
        "../scripts/eval.py"


use rule eval as eval_agreement_reference with:
    output:
        result="results/{run}/evals/{build}/{eval}.json",
        records="results/{run}/evals/{build}/{eval}.jsonl",
        reference="results/{run}/evals/{build}/{eval}_reference.npz",
    wildcard_constraints:
        build=REFERENCE_BUILD if "agreement" in EVAL_IDS else NO_MATCH,
        eval="agreement",


use rule eval as eval_agreement with:
    input:
        unpack(eval_inputs),
        reference=f"results/{{run}}/evals/{REFERENCE_BUILD}/agreement_reference.npz",
    wildcard_constraints:
        build="|".join(OTHER_BUILDS) if "agreement" in EVAL_IDS and OTHER_BUILDS else NO_MATCH,
        eval="agreement",
    params:
        reference_build=REFERENCE_BUILD,
