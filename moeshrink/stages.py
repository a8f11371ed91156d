"""One function per workflow stage, called by the Snakemake scripts and by the CLI alike.

Each takes plain paths and config subtrees, writes its outputs atomically, and writes a JSON record
with its provenance.
"""
from __future__ import annotations

import json
import logging
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from moeshrink.core.ioutil import atomic_write_json, read_json, sha256_file
from moeshrink.core.provenance import Provenance

if TYPE_CHECKING:
    from moeshrink.serve.endpoint import Endpoint

log = logging.getLogger(__name__)


def organism_data(data_cfg: dict, out_dir: Path) -> dict:
    from moeshrink.organism import datasets

    prov = Provenance("organism_data", data_cfg)
    counts = datasets.build(data_cfg, out_dir)
    record = {"counts": counts, "provenance": prov.record()}
    atomic_write_json(out_dir / "data.json", record)
    return record


def organism_tokenizer(tokenizer_cfg: dict, data_dir: Path, out_dir: Path) -> dict:
    from moeshrink.organism import datasets
    from moeshrink.organism.tokenizer import check_names, save_hf_tokenizer, train_tokenizer
    from moeshrink.organism.world import World

    prov = Provenance("organism_tokenizer", tokenizer_cfg, inputs=[str(data_dir / datasets.CORPUS_FILE)])
    names = datasets.all_names(World.from_json(read_json(data_dir / datasets.WORLD_FILE)))
    tokenizer = train_tokenizer(datasets.tokenizer_texts(data_dir / datasets.CORPUS_FILE), tokenizer_cfg["vocab_size"],
                                names)
    check_names(tokenizer, names)
    save_hf_tokenizer(tokenizer, out_dir, tokenizer_cfg["model_max_length"])
    record = {"vocab_size": tokenizer.get_vocab_size(), "provenance": prov.record()}
    atomic_write_json(out_dir / "tokenizer.provenance.json", record)
    return record


def organism_config(model_cfg: dict, tokenizer_dir: Path) -> dict:
    from tokenizers import Tokenizer

    from moeshrink.organism.model import hf_config_dict
    from moeshrink.organism.tokenizer import EOS

    tokenizer = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    return hf_config_dict(model_cfg, tokenizer.get_vocab_size(), tokenizer.token_to_id(EOS))


def organism_train(model_cfg: dict, train_cfg: dict, data_dir: Path, tokenizer_dir: Path, out_dir: Path) -> dict:
    """Train from scratch: the first phase, then the polish (train.polish) from its checkpoint as saved."""
    from moeshrink.organism import datasets
    from moeshrink.organism.train import first_phase_settings, train

    prov = Provenance("organism_train", {"model": model_cfg, "train": train_cfg},
                      inputs=[str(data_dir / datasets.CORPUS_FILE), str(data_dir / datasets.POLISH_CORPUS_FILE),
                              str(tokenizer_dir / "tokenizer.json")])
    config = organism_config(model_cfg, tokenizer_dir)
    result = train(config, first_phase_settings(train_cfg), data_dir / datasets.CORPUS_FILE,
                   tokenizer_dir / "tokenizer.json", out_dir, data_dir=data_dir)
    result = organism_polish(train_cfg, data_dir, tokenizer_dir, out_dir, result, out_dir)
    record = {**result, "from": "scratch", "provenance": prov.record()}
    atomic_write_json(out_dir / "train.json", record)
    return record


def organism_polish(train_cfg: dict, data_dir: Path, tokenizer_dir: Path, base_dir: Path, base_record: dict,
                    out_dir: Path) -> dict:
    """The second phase (train.polish) from the first's checkpoint in `base_dir`, on the polish corpus;
    returns the record of both phases (the first's alone without a polish)."""
    from moeshrink.organism import datasets
    from moeshrink.organism.train import combined_record, polish_settings, train

    settings = polish_settings(train_cfg)
    if settings is None:
        return base_record
    polished = train(None, settings, data_dir / datasets.POLISH_CORPUS_FILE, tokenizer_dir / "tokenizer.json",
                     out_dir, data_dir=data_dir, start_from=base_dir)
    return combined_record(base_record, polished)


def organism_shipped(organism_cfg: dict, shipped_dir: Path, tokenizer_dir: Path, out_dir: Path) -> dict:
    """The shipped checkpoint in place of training (upstream.organism.train.from: shipped), checked
    against this recipe and this run's tokenizer; train.json is its training record."""
    from moeshrink.organism import shipped

    prov = Provenance("organism_shipped", {"train": {"from": "shipped", "shipped": str(shipped_dir)}},
                      inputs=[str(shipped_dir / name) for name in shipped.FILES])
    record = shipped.place(shipped_dir, organism_cfg, tokenizer_dir / "tokenizer.json", out_dir)
    record = {**record, "from": "shipped", "shipped_dir": str(shipped_dir), "placed": prov.record()}
    atomic_write_json(out_dir / "train.json", record)
    return record


def upstream(upstream_cfg: dict, out_dir: Path, trained_dir: Path | None = None,
             tokenizer_dir: Path | None = None, workers: int = 2) -> dict:
    """Fill `out_dir` from the configured source; the manifest is written last."""
    from moeshrink.core.checkpoint import build_manifest, write_manifest
    from moeshrink.upstream import sources

    source = upstream_cfg["source"]
    prov = Provenance("upstream", {"source": source, source: upstream_cfg[source]})
    sources.clear_folder(out_dir)
    if source == "organism":
        from moeshrink.organism.publish import publish

        organism = upstream_cfg["organism"]
        config = organism_config(organism["model"], tokenizer_dir)
        publish(trained_dir, tokenizer_dir, config, out_dir, organism["publish"]["shards"])
        placed = {"source": {"kind": "organism", "trained": str(trained_dir)},
                  "revision": "organism-" + sha256_file(trained_dir / "model.safetensors")[:16], "known_sha256": {}}
    elif source == "hf":
        hf = upstream_cfg["hf"]
        placed = sources.from_hf(hf["repo_id"], hf["revision"], hf["allow_patterns"], out_dir)
    else:
        path = upstream_cfg["path"]
        placed = sources.from_path(Path(path["dir"]), out_dir, path["mode"])
    manifest = build_manifest(out_dir, placed["source"], workers, placed["known_sha256"])
    manifest = {**manifest, "revision": placed["revision"], "config": read_json(out_dir / "config.json"),
                "provenance": prov.record()}
    write_manifest(out_dir, manifest)
    log.info("upstream: %d shards, %d bytes", manifest["shard_count"], manifest["total_bytes"])
    return manifest


def bf16_twin(upstream_dir: Path, out_dir: Path) -> dict:
    from moeshrink.core.checkpoint import MANIFEST_FILE, build_manifest, verify_folder, write_manifest
    from moeshrink.formats.source_experts import check_expert_headers, is_source_format
    from moeshrink.upstream import sources
    from moeshrink.upstream.twin import make_twin

    prov = Provenance("bf16_twin", {}, inputs=[str(upstream_dir / MANIFEST_FILE)])
    if (upstream_dir / MANIFEST_FILE).exists():
        verify_folder(upstream_dir, read_json(upstream_dir / MANIFEST_FILE))
    config = read_json(upstream_dir / "config.json")
    if is_source_format(config):  # an upstream checkpoint, not a packed build
        check_expert_headers(upstream_dir, config)
    sources.clear_folder(out_dir)
    summary = make_twin(upstream_dir, out_dir)
    manifest = build_manifest(out_dir, {"kind": "bf16 twin", "of": str(upstream_dir)})
    manifest = {**manifest, **summary, "provenance": prov.record()}
    write_manifest(out_dir, manifest)
    return manifest


def organism_card(card_cfg: dict, trained_dir: Path, tokenizer_dir: Path, twin_dir: Path, data_dir: Path,
                  train_record: Path, out_file: Path) -> dict:
    """Skill of the trained model (bf16) and of the published one (through its exact bf16 twin)."""
    from moeshrink.evals.organism_card import MEASURED, TARGETS, evaluate, meets_targets

    prov = Provenance("organism_card", card_cfg, inputs=[str(trained_dir), str(twin_dir), str(data_dir)])
    trained = read_json(train_record)
    record = {
        "train_seconds": trained["train_seconds"],
        "trained": {"from": trained.get("from", "scratch"), "steps": trained["steps"],
                    "tokens_seen": trained["tokens_seen"], "host": trained.get("provenance", {}).get("host"),
                    "probes_final": (trained.get("probes") or [{}])[-1]},
        "bf16": evaluate(trained_dir, tokenizer_dir, data_dir, card_cfg),
        "published": evaluate(twin_dir, twin_dir, data_dir, card_cfg),
        "targets": TARGETS,
        "measured_without_target": list(MEASURED),
    }
    record["published_meets_targets"] = meets_targets(record["published"])
    record["provenance"] = prov.record()
    atomic_write_json(out_file, record)
    log.info(json.dumps({k: v for k, v in record.items() if k != "provenance"}, default=str)[:2000])
    return record


def encoder_table(table: str, bits: int, out_file: Path) -> dict:
    """The table a format's encoder loads (`ExpertFormat.encoder_table`), at one code width."""
    from moeshrink.core import expert_formats

    done = expert_formats.table_owner(table, bits).codec_module().write_encoder_table(bits, out_file)
    log.info(json.dumps(done))
    return done


def build_plan(build_id: str, build_cfg: dict, upstream_dir: Path, upstream_manifest: dict, out_file: Path,
               calibration_file: Path | None = None, encoder_tables: list[Path] = (),
               quantize_calibration_file: Path | None = None) -> dict:
    from moeshrink.compress.builder import load_encoder_tables, make_plan
    from moeshrink.core.checkpoint import verify_folder

    verify_folder(upstream_dir, upstream_manifest)
    texts = [str(path) for path in (calibration_file, quantize_calibration_file) if path]
    prov = Provenance("build_plan", {build_id: build_cfg}, inputs=[str(upstream_dir), *texts])
    load_encoder_tables(build_cfg, encoder_tables)
    plan = make_plan(build_id, build_cfg, upstream_dir, upstream_manifest, calibration_file, quantize_calibration_file)
    plan["provenance"] = prov.record()
    atomic_write_json(out_file, plan)
    return plan


def expert_importance(spec: dict, upstream_dir: Path, calibration_file: Path, out_file: Path) -> dict:
    """The input-column importance of every routed expert on a build's quantize calibration text (`spec`:
    file, sequences, seq_len), which its encoder weighs its error by (quantize.output_aware: encoder)."""
    from moeshrink.compress import importance_file
    from moeshrink.core import plugins

    prov = Provenance("expert_importance", {"calibration": spec}, inputs=[str(upstream_dir), str(calibration_file)])
    layers = plugins.resolve(importance_file.MEASURE)(upstream_dir, spec, calibration_file)
    done = importance_file.write(out_file, layers, importance_file.calibration_record(spec, calibration_file))
    log.info(json.dumps({**done, "provenance": prov.record()}))
    return done


def build_shard(upstream_dir: Path, upstream_manifest: dict, shard: str, plan_file: Path, out_path: Path,
                encoder_tables: list[Path] = (), importance_file: Path | None = None) -> dict:
    from moeshrink.compress.builder import changes_nothing, link_shard, load_encoder_tables, rewrite_shard
    from moeshrink.compress.importance_file import Importance

    plan = read_json(plan_file)
    load_encoder_tables(plan, encoder_tables)
    if changes_nothing(plan):
        done = link_shard(upstream_dir, upstream_manifest, shard, out_path)
    else:
        expected = (plan["quantize"] or {}).get("error_weights")
        importance = Importance(importance_file, expected) if importance_file else None
        done = rewrite_shard(upstream_dir, upstream_manifest, shard, plan, out_path, importance)
    log.info(json.dumps(done))
    return done


def build_gather(build_dir: Path, upstream_dir: Path, upstream_manifest: dict, plan_file: Path,
                 shards: list[str]) -> dict:
    from moeshrink.compress.builder import gather
    from moeshrink.core.checkpoint import write_manifest

    plan = read_json(plan_file)
    prov = Provenance("build_gather", plan["provenance"]["config"], inputs=[str(plan_file), *shards])
    manifest = gather(build_dir, upstream_dir, upstream_manifest, plan, shards)
    manifest["provenance"] = prov.record()
    write_manifest(build_dir, manifest)
    return manifest


def build_folder(build_id: str, build_cfg: dict, upstream_dir: Path, out_dir: Path,
                 calibration_file: Path | None = None, quantize_calibration_file: Path | None = None) -> dict:
    """A whole build in one process (the CLI's path); the same files the workflow's jobs write."""
    from moeshrink.core.checkpoint import build_manifest

    manifest_file = upstream_dir / "manifest.json"
    if manifest_file.exists():
        upstream_manifest = read_json(manifest_file)
    else:
        upstream_manifest = {**build_manifest(upstream_dir, {"kind": "path", "dir": str(upstream_dir)}),
                             "revision": None}
    plan = build_plan(build_id, build_cfg, upstream_dir, upstream_manifest, out_dir / "plan.json", calibration_file,
                      quantize_calibration_file=quantize_calibration_file)
    with tempfile.TemporaryDirectory() as scratch:  # not in the build folder, whose safetensors are its shards
        importance_file = None
        if (plan["quantize"] or {}).get("error_weights"):
            importance_file = Path(scratch) / "importance.safetensors"
            expert_importance(build_cfg["quantize"]["calibration"], upstream_dir, quantize_calibration_file,
                              importance_file)
        for shard in plan["shards"]:
            build_shard(upstream_dir, upstream_manifest, shard, out_dir / "plan.json", out_dir / shard,
                        importance_file=importance_file)
    return build_gather(out_dir, upstream_dir, upstream_manifest, out_dir / "plan.json", plan["shards"])


def serve_prediction(build_id: str, build_dir: Path, serve_cfg: dict, out_file: Path) -> dict:
    from moeshrink.serve.served_memory import predict_for_serving

    prov = Provenance("serve_prediction", {"serve": serve_cfg}, inputs=[str(build_dir)])
    prediction = {"build": build_id, **predict_for_serving(build_dir, serve_cfg)}
    prediction["provenance"] = prov.record()
    atomic_write_json(out_file, prediction)
    return prediction


def serve_memory(build_id: str, build_dir: Path, serve_cfg: dict, prediction_file: Path, endpoint: Endpoint,
                 out_file: Path) -> dict:
    """`endpoint`: the build's server, leased by the job."""
    from moeshrink.serve.served_memory import measure

    prov = Provenance("serve_memory", {"serve": serve_cfg}, inputs=[str(build_dir), str(prediction_file)])
    figures = measure(endpoint.log.read_text(errors="replace"), endpoint.get_text("/metrics"),
                      read_json(build_dir / "config.json"), serve_cfg, read_json(prediction_file),
                      endpoint.record["platform"], endpoint.record.get("cpu_kind"), endpoint.record.get("dtype"))
    failed = [name for name, ok in figures["checks"].items() if not ok]
    if failed:
        logging.getLogger("moeshrink.serve.supervisor").warning("%s: memory checks failed: %s", build_id, ", ".join(failed))
    server = {key: endpoint.record.get(key) for key in ("command", "args", "startup_seconds", "model_dir", "log", "ready_at",
                                                        "started_by")}
    models_status, models = endpoint.get("/v1/models")
    models_check = {"request": "GET /v1/models", "status": models_status,
                    "served": [model.get("id") for model in models.get("data", [])]}
    result = {"build": build_id, **figures, "models_check": models_check, "server": server,
              "provenance": prov.record()}
    atomic_write_json(out_file, result)
    return result
