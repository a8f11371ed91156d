"""`python -m moeshrink <command>`: the workflow's stages, runnable by hand with the same results."""
from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from moeshrink import config as config_mod


def _load(path: str) -> dict:
    return config_mod.load(path)


def cmd_validate_config(args) -> int:
    for path in args.files:
        config_mod.load(path)
        print(f"{path}: valid")
    return 0


def cmd_upstream(args) -> int:
    from moeshrink import stages

    config = _load(args.config)
    upstream_cfg = config["upstream"]
    results = Path(args.results)
    if upstream_cfg["source"] == "organism":
        organism = upstream_cfg["organism"]
        data, tokenizer, trained = results / "organism/data", results / "organism/tokenizer", results / "organism/trained"
        stages.organism_data(organism["data"], data)
        stages.organism_tokenizer(organism["tokenizer"], data, tokenizer)
        stages.organism_train(organism["model"], organism["train"], data, tokenizer, trained)
        stages.upstream(upstream_cfg, results / "upstream", trained, tokenizer, args.workers)
        stages.bf16_twin(results / "upstream", results / "upstream-bf16")
        stages.organism_card(organism["card"], trained, tokenizer, results / "upstream-bf16", data,
                             trained / "train.json", results / "upstream/organism_card.json")
    else:
        stages.upstream(upstream_cfg, results / "upstream", workers=args.workers)
    print(json.dumps({"manifest": str(results / "upstream/manifest.json")}))
    return 0


def cmd_twin(args) -> int:
    from moeshrink import stages

    manifest = stages.bf16_twin(Path(args.input), Path(args.output))
    print(json.dumps({"tensors": manifest["tensors"], "total_bytes": manifest["total_bytes"]}))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m moeshrink", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("validate-config", help="check config files against schemas/config.schema.yaml")
    p.add_argument("files", nargs="*", default=["config.yaml"])
    p.set_defaults(func=cmd_validate_config)

    p = sub.add_parser("upstream", help="make results/upstream/ from the configured source "
                                        "(for the organism: data, tokenizer, training, publication, twin, card)")
    p.add_argument("--config", default="config.yaml")
    p.add_argument("--results", default="results")
    p.add_argument("--workers", type=int, default=2, help="parallel sha256 workers")
    p.set_defaults(func=cmd_upstream)

    p = sub.add_parser("twin", help="decode an MXFP4 checkpoint folder into its exact bf16 twin")
    p.add_argument("--input", required=True)
    p.add_argument("--output", required=True)
    p.set_defaults(func=cmd_twin)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        return args.func(args)
    except (config_mod.ConfigError, ValueError, FileNotFoundError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
