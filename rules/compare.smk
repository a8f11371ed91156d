# Stage 5: paired statistics. Each build against the reference (results/compare/{build}.json, pass or
# fail against the pass mark config fixes before the run), and the pairs config names against each
# other (results/compare/pairs/{a}_vs_{b}.json). Cheap: no server, only the eval files.


rule compare:
    input:
        unpack(compare_inputs),
    output:
        result="results/{run}/compare/{build}.json",
    wildcard_constraints:
        build="|".join(OTHER_BUILDS) or NO_MATCH,
    params:
        judging=canonical({key: config["compare"][key] for key in ("pass_mark_points", "pass_on")}),
        reference=REFERENCE_BUILD,
    log:
        "logs/{run}/compare/{build}.log",
    resources:
        **CPU_JOB,
        mem_mb=2000,
        runtime=10,
    conda:
        "../envs/compare.yaml"
    script:
        "../scripts/compare.py"


rule compare_pair:
    input:
        unpack(compare_pair_inputs),
    output:
        result="results/{run}/compare/pairs/{a}_vs_{b}.json",
    wildcard_constraints:
        a="|".join(BUILD_IDS),
        b="|".join(BUILD_IDS),
    log:
        "logs/{run}/compare/pairs/{a}_vs_{b}.log",
    resources:
        **CPU_JOB,
        mem_mb=2000,
        runtime=10,
    conda:
        "../envs/compare.yaml"
    script:
        "../scripts/compare.py"


# Which build, from the comparisons and each build's size and cache room (results/compare/summary.json),
# and the size-fidelity frontier: the report shows it. The builds' order is a param: it breaks ties.
rule compare_summary:
    input:
        compares=expand("results/{{run}}/compare/{build}.json", build=OTHER_BUILDS),
        memory=expand("results/{{run}}/serve/{build}/memory.json", build=BUILD_IDS),
    output:
        summary="results/{run}/compare/summary.json",
    params:
        reference=REFERENCE_BUILD,
        builds=OTHER_BUILDS,
        served=BUILD_IDS,
        size_limits_gib=config["compare"]["size_limits_gib"],
    log:
        "logs/{run}/compare/summary.log",
    resources:
        **CPU_JOB,
        mem_mb=2000,
        runtime=10,
    conda:
        "../envs/compare.yaml"
    script:
        "../scripts/compare_summary.py"
