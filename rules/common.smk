# Input functions and wildcard constraints shared by every stage.

import json
import os
import re
import sys
from pathlib import Path

from moeshrink.evals import configured_evals, eval_builds as configured_eval_builds
from moeshrink.core import eval_kinds, expert_formats, prune_methods
from moeshrink.core.layout import report_file, results_dir
from moeshrink.organism import TRAINER_REVISION
from moeshrink.report.report_inputs import input_files as report_input_files
from moeshrink.compare import inputs as compare_input_files
from moeshrink.core.rule_params import (build_params, canonical, eval_params, operational, organism_card_params,
                                   organism_train_params, report_params, serve_params)

RUN = config["run"]
BUILD_IDS = list(config["builds"])
EVAL_IDS = configured_evals(config)
REFERENCE_BUILD = config["reference_build"]
UPSTREAM_SOURCE = config["upstream"]["source"]
ORGANISM = config["upstream"].get("organism", {})

CLUSTER = config["cluster"]
PYTHON = sys.executable
SERVE_OPERATIONAL_JSON = json.dumps(operational(config)["serve"])

ORGANISM_DATA = "results/{run}/organism/data"
ORGANISM_DATA_FILES = [
    "world.json", "corpus.jsonl", "corpus_polish.jsonl", "mc_test.jsonl", "mc_dev.jsonl", "arith_test.jsonl",
    "arith_train.jsonl",
    "passages_test.jsonl", "tools.json", "toolcalls_test.jsonl", "data.json",
]
ORGANISM_TOKENIZER = "results/{run}/organism/tokenizer"
ORGANISM_TRAINED = "results/{run}/organism/trained"
SHIPPED_FILES = ["model.safetensors", "config.json", "tokenizer.json", "train.json"]


def organism_recipe_params():
    """What the shipped checkpoint is checked against: the recipe it must have been trained with."""
    from moeshrink.organism.shipped import recipe

    return recipe(ORGANISM)


wildcard_constraints:
    run=re.escape(RUN),
    build="|".join(BUILD_IDS),
    eval="[a-z][a-z0-9_]*",


def scheduler_resources(partition_key):
    """Slurm partition and account for a job (ignored by the local executor): config's `cluster` keys,
    else MOESHRINK_SLURM_PARTITION / MOESHRINK_SLURM_GPU_PARTITION / MOESHRINK_SLURM_ACCOUNT, else none
    (the Slurm plugin then takes the cluster's default partition and guesses the account)."""
    cpu_partition = CLUSTER["partition"] or os.environ.get("MOESHRINK_SLURM_PARTITION")
    partition = cpu_partition
    if partition_key == "gpu_partition":
        partition = CLUSTER["gpu_partition"] or os.environ.get("MOESHRINK_SLURM_GPU_PARTITION") or cpu_partition
    account = CLUSTER["account"] or os.environ.get("MOESHRINK_SLURM_ACCOUNT")
    return {**({"slurm_partition": partition} if partition else {}), **({"slurm_account": account} if account else {})}


# every CPU-only job; and the jobs of a build's server group (its prediction, memory and evals: on a
# cluster one job on one node, so they ask for the same partition, and each names the server's GPUs
# as a string resource, which a group takes once instead of summing)
CPU_JOB = scheduler_resources("partition")
SERVER_NODE = {**scheduler_resources("gpu_partition"),
               **({"gres": f"gpu:{CLUSTER['server_gpus']}"} if CLUSTER["server_gpus"] else {})}


def stop_idle_servers():
    from moeshrink.serve.server_lease import stop_idle_servers as stop

    stop(Path("results/{run}/serve"), BUILD_IDS)


def server_queue_priority(wildcards):
    """A build's serve jobs run before the next build's (the reference first, then config order), so that
    each build's server starts once and serves all its jobs back to back."""
    from moeshrink.serve.server_lease import queue_order

    return len(BUILD_IDS) - queue_order(config, wildcards.build)


def before_every_build(wildcards):
    """What every build may need (an encoder table) runs before any build's serve jobs; so do the organism
    card (transformers, on one thread) and the bf16 twin it reads (a priority is not passed on to a job's
    inputs), so that the card runs beside the servers: a starting server leaves a core idle, a serving one
    spins on it."""
    return len(BUILD_IDS) + 1


def build_priority(wildcards):
    """A build's own jobs (compress, serve prediction) run before any build's serve jobs, the builds in queue
    order: then every build's serve jobs are ready once the reference's agreement has run, and Snakemake
    starts them one build after another, which the supervisors' handover relies on. Measured on a 2-core
    AVX2 EPYC: builds and predictions that waited behind the reference's evals made a later build's job
    ready before an earlier one's (one server started four times, main command 1,176 s), and builds run
    between the servers cost about 100 s (956 s against 843)."""
    return before_every_build(wildcards) + server_queue_priority(wildcards)


def upstream_params():
    """The part of the upstream config that decides what results/upstream/ holds (the organism's
    data, tokenizer and training reach it as input files instead)."""
    if UPSTREAM_SOURCE == "organism":
        return {"source": "organism", "organism": {"model": ORGANISM["model"], "publish": ORGANISM["publish"]}}
    return {"source": UPSTREAM_SOURCE, UPSTREAM_SOURCE: config["upstream"][UPSTREAM_SOURCE]}


def upstream_inputs(wildcards):
    if UPSTREAM_SOURCE == "organism":
        return {
            "model": f"{ORGANISM_TRAINED}/model.safetensors",
            "train": f"{ORGANISM_TRAINED}/train.json",
            "tokenizer": f"{ORGANISM_TOKENIZER}/tokenizer.json",
        }
    return {}


def report_inputs(wildcards):
    """What the report shows: every stage's result for every build."""
    return report_input_files(config)


def upstream_shards(wildcards):
    """The upstream's shard files, known once the upstream checkpoint has run."""
    manifest = checkpoints.upstream.get(run=wildcards.run).output.manifest
    with open(manifest) as f:
        return [shard["file"] for shard in json.load(f)["shards"]]


def build_shards(wildcards):
    return [f"results/{{run}}/builds/{wildcards.build}/{shard}" for shard in upstream_shards(wildcards)]


def build_calibration(wildcards):
    """The calibration texts a build's plan reads: a calibrated prune method's (reap) and output-aware bit
    allocation's, each its configured file or the organism corpus."""
    build = config["builds"][wildcards.build]
    texts = {}
    prune_spec = build.get("prune") or {}
    if prune_spec and prune_methods.get(prune_spec["method"], f"builds.{wildcards.build}.prune.method").calibrated:
        texts["calibration"] = prune_spec["calibration"]["file"] or f"{ORGANISM_DATA}/corpus.jsonl"
    quantize_text = quantize_calibration_text(wildcards)
    if quantize_text:
        texts["quantize_calibration"] = quantize_text["calibration"]
    return texts


def quantize_calibration_text(wildcards):
    """{"calibration": the text of a build's output-aware quantization}, its configured file or the organism
    corpus; {} without one."""
    calibration = (config["builds"][wildcards.build].get("quantize") or {}).get("calibration")
    return {"calibration": calibration["file"] or f"{ORGANISM_DATA}/corpus.jsonl"} if calibration else {}


def quantize_calibration_spec(wildcards):
    """A build's quantize calibration (file, sequences, seq_len): what its activation importance is made from."""
    return canonical(config["builds"][wildcards.build]["quantize"]["calibration"])


def build_importance(wildcards):
    """The activation importance a build's encoder weighs its error by (quantize.output_aware takes encoder)."""
    steps = expert_formats.calibrated_steps(config["builds"][wildcards.build].get("quantize"))
    return {"importance": f"results/{wildcards.run}/importance/{wildcards.build}.safetensors"} if "encoder" in steps else {}


def build_encoder_tables(wildcards):
    """The tables a build's format's encoder loads (TWX v2's), written once per run for every job that encodes."""
    spec = config["builds"][wildcards.build].get("quantize") or {}
    names = expert_formats.get(spec["format"], f"builds.{wildcards.build}.quantize.format").encoder_tables() if spec else []
    return {"encoder_tables": [f"results/{wildcards.run}/formats/{name}" for name in names]} if names else {}


def encoder_table_constants(wildcards):
    """The sha256 of the format constants a table is made from (TWX v2's codebooks): new constants, new tables."""
    return expert_formats.table_owner(wildcards.table, int(wildcards.bits)).constants_sha256()


def eval_builds(eval_id):
    return configured_eval_builds(config, eval_id)


def eval_set_inputs(eval_id):
    """The set files an eval reads (its registry entry says which; none for lm-eval's own tasks)."""
    return eval_kinds.get(eval_id).set_files(config["evals"][eval_id], ORGANISM_DATA)


def after_reference(wildcards):
    """Every other build is served after the reference's agreement has run (its passages are every other
    build's agreement input), so that each build's server starts once, for all its jobs. `ancient`: an
    order, not a dependency; a rerun of the reference reruns none of them."""
    if "agreement" not in EVAL_IDS or wildcards.build == REFERENCE_BUILD or getattr(wildcards, "eval", None) == "agreement":
        return {}
    return {"after_reference": ancient(f"results/{{run}}/evals/{REFERENCE_BUILD}/agreement_reference.npz")}


def eval_inputs(wildcards):
    return {"manifest": f"results/{{run}}/builds/{wildcards.build}/manifest.json",
            "prediction": f"results/{{run}}/serve/{wildcards.build}/prediction.json",
            **after_reference(wildcards), **eval_set_inputs(wildcards.eval)}


def compare_inputs(wildcards):
    """A build against the reference: both sides' eval JSONs, and the per-item records of the paired evals."""
    return compare_input_files.against_reference(config, wildcards.build)


def compare_pair_inputs(wildcards):
    return compare_input_files.pair(config, wildcards.a, wildcards.b)
