# Stage 2: each build from the upstream: a plan (which experts, which bits), one job per upstream
# shard (in parallel, each independent), then a gather job (index, config, tokenizer, manifest). A build
# whose encoder weighs its error by calibration activations has their importance measured first.
# Builds are made in the order their servers queue (the reference first), so that the reference is
# served first and every other build's agreement has its passages when that build is served.


rule encoder_table:
    output:
        table="results/{run}/formats/{table}-{bits}bit.safetensors",
    wildcard_constraints:
        table=r"[a-z0-9_]+",
        bits=r"\d+",
    params:
        constants=encoder_table_constants,
    log:
        "logs/{run}/formats/{table}-{bits}bit.log",
    benchmark:
        "benchmarks/{run}/formats/{table}-{bits}bit.tsv"
    priority: before_every_build
    resources:
        **CPU_JOB,
        mem_mb=4000,
        runtime=60,
    conda:
        "../envs/compress.yaml"
    script:
        "../scripts/encoder_table.py"


rule expert_importance:
    input:
        unpack(quantize_calibration_text),
        manifest="results/{run}/upstream/manifest.json",
    output:
        importance="results/{run}/importance/{build}.safetensors",
    params:
        calibration=quantize_calibration_spec,
    log:
        "logs/{run}/importance/{build}.log",
    benchmark:
        "benchmarks/{run}/importance/{build}.tsv"
    priority: build_priority
    resources:
        **CPU_JOB,
        mem_mb=8000,
        runtime=120,
    conda:
        "../envs/compress.yaml"
    script:
        "../scripts/expert_importance.py"


rule build_plan:
    input:
        unpack(build_calibration),
        unpack(build_encoder_tables),
        manifest="results/{run}/upstream/manifest.json",
    output:
        plan="results/{run}/builds/{build}/plan.json",
    params:
        build=lambda wildcards: build_params(config, wildcards.build),
    log:
        "logs/{run}/builds/{build}/plan.log",
    benchmark:
        "benchmarks/{run}/builds/{build}/plan.tsv"
    priority: build_priority
    resources:
        **CPU_JOB,
        mem_mb=8000,
        runtime=120,
    conda:
        "../envs/compress.yaml"
    script:
        "../scripts/build_plan.py"


rule build_shard:
    input:
        unpack(build_encoder_tables),
        unpack(build_importance),
        manifest="results/{run}/upstream/manifest.json",
        plan="results/{run}/builds/{build}/plan.json",
    output:
        shard="results/{run}/builds/{build}/{shard}",
    wildcard_constraints:
        shard=r"[^/]+\.safetensors",
    log:
        "logs/{run}/builds/{build}/{shard}.log",
    benchmark:
        "benchmarks/{run}/builds/{build}/{shard}.tsv"
    priority: build_priority
    resources:
        **CPU_JOB,
        mem_mb=lambda wildcards, attempt: 8000 * attempt,
        runtime=240,
    conda:
        "../envs/compress.yaml"
    script:
        "../scripts/build_shard.py"


rule build_gather:
    input:
        upstream="results/{run}/upstream/manifest.json",
        plan="results/{run}/builds/{build}/plan.json",
        shards=build_shards,
    output:
        manifest="results/{run}/builds/{build}/manifest.json",
    log:
        "logs/{run}/builds/{build}/gather.log",
    benchmark:
        "benchmarks/{run}/builds/{build}/gather.tsv"
    priority: build_priority
    resources:
        **CPU_JOB,
        mem_mb=4000,
        runtime=120,
    conda:
        "../envs/compress.yaml"
    script:
        "../scripts/build_gather.py"
