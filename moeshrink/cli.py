"""`python -m moeshrink <command>`: the workflow's stages, runnable by hand with the same results."""
from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from moeshrink.core import config as config_mod
from moeshrink.core import expert_formats, prune_methods
from moeshrink.core.errors import MoeshrinkError
from moeshrink.core.ioutil import atomic_path
from moeshrink.core.layout import results_dir

CONFIG_HELP = "config files laid over config.yaml in order, as snakemake --configfile lays them (default: config.yaml)"


def _load(paths: list[str]) -> dict:
    """config.yaml with the named files laid over it, as `snakemake --configfile` reads them."""
    return config_mod.load(*paths)


def cmd_validate_config(args) -> int:
    for path in args.files:
        config_mod.load(path)
        print(f"{path}: valid (laid over {config_mod.DEFAULT_FILE})")
    return 0


def cmd_upstream(args) -> int:
    from moeshrink import stages

    config = _load(args.config)
    upstream_cfg = config["upstream"]
    results = Path(args.results) if args.results else results_dir(config)
    if upstream_cfg["source"] == "organism":
        organism = upstream_cfg["organism"]
        data, tokenizer, trained = results / "organism/data", results / "organism/tokenizer", results / "organism/trained"
        stages.organism_data(organism["data"], data)
        stages.organism_tokenizer(organism["tokenizer"], data, tokenizer)
        if organism["train"]["from"] == "shipped":
            stages.organism_shipped(organism, Path(organism["train"]["shipped"]), tokenizer, trained)
        else:
            stages.organism_train(organism["model"], organism["train"], data, tokenizer, trained)
        with atomic_path(results / "upstream") as staging:  # nothing under the target's name unless it is whole
            stages.upstream(upstream_cfg, staging, trained, tokenizer, args.workers)
        with atomic_path(results / "upstream-bf16") as staging:
            stages.bf16_twin(results / "upstream", staging)
        stages.organism_card(organism["card"], trained, tokenizer, results / "upstream-bf16", data,
                             trained / "train.json", results / "upstream/organism_card.json")
    else:
        with atomic_path(results / "upstream") as staging:
            stages.upstream(upstream_cfg, staging, workers=args.workers)
    print(json.dumps({"manifest": str(results / "upstream/manifest.json")}))
    return 0


def cmd_ship_organism(args) -> int:
    """Write the shipped organism (organism/shipped) from a finished training run with this config's
    recipe: done once, by hand, after `upstream.organism.train.from: scratch`."""
    from moeshrink.core.ioutil import read_json
    from moeshrink.organism import shipped

    config = _load(args.config)
    organism = config["upstream"]["organism"]
    trained = Path(args.trained) if args.trained else results_dir(config) / "organism/trained"
    tokenizer = Path(args.tokenizer) if args.tokenizer else results_dir(config) / "organism/tokenizer/tokenizer.json"
    record = shipped.ship(trained, tokenizer, read_json(trained / "train.json"), organism, Path(args.out))
    print(json.dumps({k: record[k] for k in ("recipe_sha256_16", "model_sha256", "train_seconds", "steps")}))
    return 0


def cmd_polish_organism(args) -> int:
    """Train only the polish (train.polish) from a checkpoint made by this recipe's first phase (checked),
    writing a trained folder with both phases' record for ship-organism: how organism/shipped is remade
    when only the polish changed, without the first phase's hour."""
    from moeshrink import stages
    from moeshrink.core.ioutil import atomic_write_json
    from moeshrink.core.provenance import Provenance
    from moeshrink.organism import datasets, shipped

    config = _load(args.config)
    organism = config["upstream"]["organism"]
    base = Path(args.base)
    base_record = shipped.made_by(base, shipped.first_phase_recipe(organism))
    data = Path(args.data) if args.data else results_dir(config) / "organism/data"
    tokenizer = Path(args.tokenizer) if args.tokenizer else results_dir(config) / "organism/tokenizer"
    shipped.check_tokenizer(base, tokenizer / "tokenizer.json")
    if not organism["train"].get("polish"):
        raise shipped.ShippedError("upstream.organism.train.polish is not set: there is no second phase to train")
    prov = Provenance("organism_polish", {"train": organism["train"]},
                      inputs=[str(base / "model.safetensors"), str(data / datasets.POLISH_CORPUS_FILE)])
    with atomic_path(Path(args.out)) as staging:
        result = stages.organism_polish(organism["train"], data, tokenizer, base, base_record, staging)
        record = {**result, "from": "scratch", "first_phase": {
            "checkpoint": str(base), "model_sha256": base_record["model_sha256"],
            "recipe_sha256_16": base_record["recipe_sha256_16"],
            "provenance": base_record.get("provenance")}, "provenance": prov.record()}
        atomic_write_json(staging / "train.json", record)
    print(json.dumps({k: record[k] for k in ("train_seconds", "steps", "tokens_seen", "final_loss")}))
    return 0


def cmd_twin(args) -> int:
    from moeshrink import stages

    with atomic_path(Path(args.output)) as staging:
        manifest = stages.bf16_twin(Path(args.input), staging)
    print(json.dumps({"tensors": manifest["tensors"], "total_bytes": manifest["total_bytes"]}))
    return 0


def cmd_prune(args) -> int:
    from moeshrink import stages

    spec = {"method": args.method, "keep_fraction": args.keep_fraction}
    calibration = None
    if prune_methods.get(args.method, "--method").calibrated:
        if not args.calibration:
            raise SystemExit(f"prune --method {args.method} needs --calibration FILE (.jsonl with a text field, or "
                             "plain text)")
        calibration = Path(args.calibration)
        spec["calibration"] = {"file": str(calibration), "sequences": args.sequences, "seq_len": args.seq_len}
    build = {"label": "pruned", "prune": spec}
    with atomic_path(Path(args.output)) as staging:  # nothing under the output's name unless it is whole
        staging.mkdir()
        manifest = stages.build_folder(Path(args.output).name, build, Path(args.input), staging, calibration)
    print(json.dumps({"num_experts": manifest["num_experts"], "total_bytes": manifest["total_bytes"]}))
    return 0


def cmd_quantize(args) -> int:
    from moeshrink import stages

    spec = {"format": args.format}
    if args.max_bits_per_weight is not None:
        spec["max_bits_per_weight"] = args.max_bits_per_weight
    calibration = Path(args.calibration) if args.calibration else None
    if calibration:
        spec["calibration"] = {"file": str(calibration), "sequences": args.sequences, "seq_len": args.seq_len}
    if args.output_aware:
        spec["output_aware"] = args.output_aware.split(",")
    build = {"label": args.format, "quantize": spec}
    with atomic_path(Path(args.output)) as staging:
        staging.mkdir()
        manifest = stages.build_folder(Path(args.output).name, build, Path(args.input), staging,
                                       quantize_calibration_file=calibration)
    print(json.dumps({"routed_expert_bits_per_weight": manifest["routed_expert_bits_per_weight"],
                      "total_bytes": manifest["total_bytes"]}))
    return 0


def cmd_plan(args) -> int:
    from moeshrink.core.ioutil import atomic_write_json
    from moeshrink.serve import planner

    config = _load(args.config)
    result = planner.plan(config, Path(args.results) if args.results else results_dir(config))
    print(planner.table(result))
    if args.json:
        atomic_write_json(args.json, result)
    return 0


def cmd_serve(args) -> int:
    from moeshrink.serve.supervisor import run_service

    serve = {**json.loads(args.serve_json), **json.loads(args.operational_json)}
    return run_service(args.build, Path(args.model_dir), serve, Path(args.prediction), Path(args.endpoint),
                       Path(args.log), args.queue_order)


def cmd_stats(args) -> int:
    from moeshrink.core import stats

    if args.test == "mcnemar":
        result = {"p_value": stats.mcnemar_exact(args.only_ref, args.only_build)}
    elif args.test == "drop-bound":
        result = stats.paired_drop(args.n, args.only_ref, args.only_build)
    else:
        result = {"p_value": stats.fisher_exact(args.bad_a, args.total_a, args.bad_b, args.total_b)}
    print(json.dumps(result))
    return 0


def _command(sub, func, *, help: str, reads_config: bool = False) -> argparse.ArgumentParser:
    """The subcommand that `func` (cmd_<name>) runs; `--config` where it reads the study's config."""
    command = sub.add_parser(func.__name__.removeprefix("cmd_").replace("_", "-"), help=help)
    command.set_defaults(func=func)
    if reads_config:
        command.add_argument("--config", nargs="+", default=["config.yaml"], help=CONFIG_HELP)
    return command


def _add_stats_parser(sub) -> None:
    p = _command(sub, cmd_stats, help="re-check a report's paired statistics from its published counts (prints JSON)")
    tests = p.add_subparsers(dest="test", required=True)
    t = tests.add_parser("mcnemar", help="exact McNemar p-value (two-sided) from the discordant counts")
    t.add_argument("--only-ref", type=int, required=True, help="items right only for the reference")
    t.add_argument("--only-build", type=int, required=True, help="items right only for the build")
    t = tests.add_parser("drop-bound", help="accuracy drop in points and its one-sided 95%% upper bound (at worst)")
    t.add_argument("--n", type=int, required=True, help="items both read")
    t.add_argument("--only-ref", type=int, required=True)
    t.add_argument("--only-build", type=int, required=True)
    t = tests.add_parser("fisher", help="Fisher's exact test (two-sided) on two made-up counts")
    t.add_argument("--bad-a", type=int, required=True)
    t.add_argument("--total-a", type=int, required=True)
    t.add_argument("--bad-b", type=int, required=True)
    t.add_argument("--total-b", type=int, required=True)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m moeshrink", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = _command(sub, cmd_validate_config, help="check config files, each laid over config.yaml, against the "
                                                "schema (moeshrink/core/config.schema.yaml)")
    p.add_argument("files", nargs="*", default=["config.yaml"])

    p = _command(sub, cmd_upstream, reads_config=True,
                 help="make results/<run>/upstream/ from the configured source "
                      "(for the organism: data, tokenizer, training, publication, twin, card)")
    p.add_argument("--results", help="default: results/<run> (the config's study)")
    p.add_argument("--workers", type=int, default=2, help="parallel sha256 workers")

    p = _command(sub, cmd_ship_organism, reads_config=True,
                 help="write the shipped organism from a finished training run "
                      "(results/<run>/organism/trained after train.from: scratch)")
    p.add_argument("--trained", help="default: results/<run>/organism/trained")
    p.add_argument("--tokenizer", help="default: results/<run>/organism/tokenizer/tokenizer.json")
    p.add_argument("--out", default="organism/shipped")

    p = _command(sub, cmd_polish_organism, reads_config=True,
                 help="train only the second phase (train.polish) from a checkpoint its first phase made "
                      "(organism/shipped before a polish), for ship-organism")
    p.add_argument("--base", default="organism/shipped", help="the first phase's checkpoint, with its train.json")
    p.add_argument("--data", help="default: results/<run>/organism/data")
    p.add_argument("--tokenizer", help="default: results/<run>/organism/tokenizer (folder)")
    p.add_argument("--out", required=True, help="the trained folder to write")

    p = _command(sub, cmd_twin, help="decode an MXFP4 checkpoint folder into its exact bf16 twin")
    p.add_argument("--input", required=True)
    p.add_argument("--output", required=True)

    p = _command(sub, cmd_prune, help="drop routed experts (the pruned75 card's router_sum, or reap)")
    p.add_argument("--input", required=True, help="a checkpoint folder in Hugging Face layout")
    p.add_argument("--output", required=True)
    p.add_argument("--keep-fraction", type=float, required=True)
    p.add_argument("--method", choices=list(prune_methods.methods()), default="router_sum")
    p.add_argument("--calibration", help="reap: calibration text (.jsonl with a text field, or plain text)")
    p.add_argument("--sequences", type=int, default=32, help="reap: calibration sequences")
    p.add_argument("--seq-len", type=int, default=256, help="reap: tokens per calibration sequence")

    p = _command(sub, cmd_quantize,
                 help="re-encode routed experts in an expert format (TWX3, TWX2.5, their v2, or a plugin's)")
    p.add_argument("--input", required=True, help="a checkpoint folder in Hugging Face layout")
    p.add_argument("--output", required=True)
    p.add_argument("--format", choices=list(expert_formats.formats()), required=True)
    p.add_argument("--max-bits-per-weight", type=float, help="routed-expert bit budget (default: " + ", ".join(
        f"{name} {fmt.default_budget:g}" for name, fmt in expert_formats.formats().items()) + ")")
    p.add_argument("--calibration", help="output-aware quantization on this text (.jsonl with a text field, or plain "
                                         "text): formats of two code widths allocate bits by output error on it, "
                                         "v2 formats weigh the encoder's error by its activations; default: "
                                         "calibration-free")
    p.add_argument("--output-aware", help="what --calibration decides, comma-separated: allocation, encoder "
                                          "(default: every step the format can take)")
    p.add_argument("--sequences", type=int, default=32, help="--calibration: sequences")
    p.add_argument("--seq-len", type=int, default=256, help="--calibration: tokens per sequence")

    p = _command(sub, cmd_plan, reads_config=True,
                 help="predict weights, KV-cache room and tokens per card for every build, GPU type "
                      "and tensor-parallel size, from checkpoint headers and config.json alone")
    p.add_argument("--results", help="where built builds and the upstream are looked for (default: results/<run>)")
    p.add_argument("--json", help="also write the table as JSON here")

    p = _command(sub, cmd_serve, help="serve one build with vLLM while jobs lease it (the supervisor the first "
                                      "lessee starts; see moeshrink.serve.server_lease)")
    p.add_argument("--build", required=True)
    p.add_argument("--model-dir", required=True)
    p.add_argument("--serve-json", required=True, help="the serve config subtree as JSON")
    p.add_argument("--operational-json", default="{}",
                   help="serve keys that change no output (startup_timeout_s, stop_timeout_s, idle_grace_s, "
                        "servers_per_machine) as JSON")
    p.add_argument("--prediction", required=True, help="results/<run>/serve/{build}/prediction.json")
    p.add_argument("--endpoint", required=True, help="the server's record: queued, starting, ready, failed, stopped")
    p.add_argument("--queue-order", type=int, default=0, help="the build's place in the machine's server queue")
    p.add_argument("--log", required=True, help="the server's raw log")

    _add_stats_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        return args.func(args)
    except (MoeshrinkError, FileNotFoundError) as error:  # anything else is a bug: its traceback stays
        print(f"error: {error}", file=sys.stderr)
        return 2
