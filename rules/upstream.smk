# Stage 1: the upstream model in results/upstream/ (config, tokenizer, shards, index, manifest).
# On the embedded default it is the model organism: data -> tokenizer -> training -> publication
# in MXFP4, plus its exact bf16 twin and its card.


if "data" in ORGANISM:
    # the fictional world: the organism's training corpus and held-out sets, and on every source the
    # facts and tool-call eval sets

    rule organism_data:
        output:
            expand(f"{ORGANISM_DATA}/{{name}}", name=ORGANISM_DATA_FILES, allow_missing=True),
        params:
            data=canonical(ORGANISM["data"]),
        log:
            "logs/{run}/upstream/organism_data.log",
        benchmark:
            "benchmarks/{run}/upstream/organism_data.tsv"
        resources:
            **CPU_JOB,
            mem_mb=4000,
            runtime=20,
        conda:
            "../envs/upstream.yaml"
        script:
            "../scripts/organism_data.py"


if UPSTREAM_SOURCE == "organism":

    rule organism_tokenizer:
        input:
            corpus=f"{ORGANISM_DATA}/corpus.jsonl",
            world=f"{ORGANISM_DATA}/world.json",
        output:
            tokenizer=f"{ORGANISM_TOKENIZER}/tokenizer.json",
            tokenizer_config=f"{ORGANISM_TOKENIZER}/tokenizer_config.json",
            record=f"{ORGANISM_TOKENIZER}/tokenizer.provenance.json",
        params:
            tokenizer=canonical(ORGANISM["tokenizer"]),
        log:
            "logs/{run}/upstream/organism_tokenizer.log",
        benchmark:
            "benchmarks/{run}/upstream/organism_tokenizer.tsv"
        resources:
            **CPU_JOB,
            mem_mb=4000,
            runtime=20,
        conda:
            "../envs/upstream.yaml"
        script:
            "../scripts/organism_tokenizer.py"


    if ORGANISM["train"]["from"] == "scratch":

        rule organism_train:
            input:
                corpus=f"{ORGANISM_DATA}/corpus.jsonl",
                polish_corpus=f"{ORGANISM_DATA}/corpus_polish.jsonl",
                world=f"{ORGANISM_DATA}/world.json",
                tokenizer=f"{ORGANISM_TOKENIZER}/tokenizer.json",
            output:
                model=f"{ORGANISM_TRAINED}/model.safetensors",
                config=f"{ORGANISM_TRAINED}/config.json",
                record=f"{ORGANISM_TRAINED}/train.json",
            params:
                model=canonical(ORGANISM["model"]),
                train=organism_train_params(config),
                trainer=TRAINER_REVISION,
            threads: ORGANISM["train"]["threads"]
            log:
                "logs/{run}/upstream/organism_train.log",
            benchmark:
                "benchmarks/{run}/upstream/organism_train.tsv"
            resources:
                **CPU_JOB,
                mem_mb=8000,
                runtime=180,
            conda:
                "../envs/upstream.yaml"
            script:
                "../scripts/organism_train.py"

    else:

        # the checkpoint shipped in the repository, trained once with this recipe on the long budget
        rule organism_shipped:
            input:
                shipped=expand(f"{ORGANISM['train']['shipped']}/{{name}}", name=SHIPPED_FILES),
                tokenizer=f"{ORGANISM_TOKENIZER}/tokenizer.json",
            output:
                model=f"{ORGANISM_TRAINED}/model.safetensors",
                config=f"{ORGANISM_TRAINED}/config.json",
                record=f"{ORGANISM_TRAINED}/train.json",
            params:
                organism=canonical(organism_recipe_params()),
            log:
                "logs/{run}/upstream/organism_shipped.log",
            resources:
                **CPU_JOB,
                mem_mb=2000,
                runtime=10,
            conda:
                "../envs/upstream.yaml"
            script:
                "../scripts/organism_shipped.py"

    rule organism_card:
        input:
            model=f"{ORGANISM_TRAINED}/model.safetensors",
            train=f"{ORGANISM_TRAINED}/train.json",
            tokenizer=f"{ORGANISM_TOKENIZER}/tokenizer.json",
            twin="results/{run}/upstream-bf16/manifest.json",
            data=expand(f"{ORGANISM_DATA}/{{name}}", name=ORGANISM_DATA_FILES, allow_missing=True),
        output:
            card="results/{run}/upstream/organism_card.json",
        params:
            card=organism_card_params(config),
        threads: ORGANISM["card"]["threads"]
        priority: before_every_build
        log:
            "logs/{run}/upstream/organism_card.log",
        benchmark:
            "benchmarks/{run}/upstream/organism_card.tsv"
        resources:
            **CPU_JOB,
            mem_mb=8000,
            runtime=60,
        conda:
            "../envs/serve.yaml"
        script:
            "../scripts/organism_card.py"


checkpoint upstream:
    input:
        unpack(upstream_inputs),
    output:
        manifest="results/{run}/upstream/manifest.json",
    params:
        upstream=canonical(upstream_params()),
    threads: 4
    log:
        "logs/{run}/upstream/upstream.log",
    benchmark:
        "benchmarks/{run}/upstream/upstream.tsv"
    resources:
        **CPU_JOB,
        mem_mb=8000,
        runtime=240,
    conda:
        "../envs/upstream.yaml"
    script:
        "../scripts/upstream.py"


rule upstream_bf16_twin:
    input:
        manifest="results/{run}/upstream/manifest.json",
    output:
        manifest="results/{run}/upstream-bf16/manifest.json",
    log:
        "logs/{run}/upstream/upstream_bf16_twin.log",
    benchmark:
        "benchmarks/{run}/upstream/upstream_bf16_twin.tsv"
    priority: before_every_build
    resources:
        **CPU_JOB,
        mem_mb=8000,
        runtime=120,
    conda:
        "../envs/upstream.yaml"
    script:
        "../scripts/upstream_bf16_twin.py"

