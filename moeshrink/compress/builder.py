"""Make a build from the upstream checkpoint: plan (which experts, which bits), then rewrite each
shard on its own, then gather the folder (index, config, tokenizer, manifest).

Tensors that are not routed experts keep their upstream bytes. Routed experts are dropped (pruning:
with their router rows and correction-bias entries, the rest renumbered) and/or re-encoded in an
expert format of the registry (`moeshrink.core.expert_formats`), decoded exactly from their upstream
encoding first (MXFP4 never goes through bf16).
"""
from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from moeshrink.compress import importance_file, prune
from moeshrink.core import expert_formats, plugins, prune_methods
from moeshrink.core.arch import CLASSES, Adapter, ExpertTensor, adapter_for, check_has_moe
from moeshrink.core.checkpoint import (
    INDEX_FILE,
    SCALE_COMPANION,
    build_manifest,
    index_of,
    is_weight_companion,
    read_header,
    remember_verified,
    verify_shard,
)
from moeshrink.core.errors import MoeshrinkError
from moeshrink.core.expert_formats import ExpertFormat, FormatError
from moeshrink.core.ioutil import atomic_path, atomic_write_json, read_json, sha256_file
from moeshrink.core.prune_methods import PruneMethodError
from moeshrink.core.shardio import StoredTensor, data_start, save_shard, stored_tensor
from moeshrink.formats import mxfp4
from moeshrink.formats.source_experts import check_expert_headers, read_expert_weight, source_format

log = logging.getLogger(__name__)
TOKENIZER_AND_CONFIG_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                              "chat_template.jinja", "generation_config.json", "tokenizer.model", "vocab.json",
                              "merges.txt", "tiktoken.model")


class BuildError(MoeshrinkError, ValueError):
    pass


# the calibration forward, named as the prune methods name their scorers (it builds transformers' modules)
OUTPUT_ERRORS = "moeshrink.compress.calibrated_bits:output_errors"


def load_encoder_tables(build: dict, tables: list[Path]) -> None:
    """Give the encoder of the build's format (a plan or a build's config: its `quantize.format`) the tables
    the run wrote for it."""
    if tables:
        fmt = expert_formats.get((build.get("quantize") or {})["format"], "quantize.format")
        for table in tables:
            fmt.codec_module().load_encoder_table(table)
            log.info("encoder table %s loaded", table)


# ------------------------------------------------------------------------------------- planning
def expert_weights(upstream: Path, adapter: Adapter, fmt: str, wanted=lambda ref: True
                   ) -> Iterator[tuple[ExpertTensor, torch.Tensor]]:
    """Each routed-expert weight that `wanted` accepts, as exact float32, one shard open at a time."""
    by_shard: dict[str, list[str]] = {}
    for name, shard in index_of(upstream)["weight_map"].items():
        ref = adapter.parse_expert(name)
        if ref and ref.suffix == "weight" and wanted(ref):
            by_shard.setdefault(shard, []).append(name)
    for shard, names in sorted(by_shard.items()):
        with safe_open(str(upstream / shard), "pt") as f:
            for name in names:
                yield adapter.parse_expert(name), read_expert_weight(f, name, fmt, upstream / shard)


def expert_norms(upstream: Path, adapter: Adapter, fmt: str, kept: dict[int, list[int]]) -> dict[int, dict[int, float]]:
    """Squared Frobenius norm of each kept expert (all its projections), read shard by shard."""
    norms: dict[int, dict[int, float]] = {layer: {e: 0.0 for e in experts} for layer, experts in kept.items()}
    for ref, weight in expert_weights(upstream, adapter, fmt,
                                      lambda ref: ref.layer in kept and ref.expert in norms[ref.layer]):
        norms[ref.layer][ref.expert] += float(weight.pow(2).sum())
    return norms


def allocate_bits(gains: dict[int, dict[int, float]], max_bits: float, fmt: ExpertFormat) -> dict[int, dict[int, int]]:
    """A format of two or more code widths (TWX2.5): the widest codes for the experts whose error would
    fall most from the narrowest code to the widest (`gains`, per layer and expert), the narrowest for
    the rest, so that the average stays within `max_bits`. All experts of a layer have equal size."""
    narrow, wide = fmt.code_bits[0], fmt.code_bits[-1]
    experts = [(layer, e) for layer in gains for e in gains[layer]]
    step = fmt.bits_per_weight(wide) - fmt.bits_per_weight(narrow)
    budget = int((max_bits - fmt.bits_per_weight(narrow)) / step * len(experts) + 1e-9)
    ranked = sorted(experts, key=lambda le: (-gains[le[0]][le[1]], le))
    widened = set(ranked[:budget])
    return {layer: {e: wide if (layer, e) in widened else narrow for e in gains[layer]} for layer in gains}


def weight_error_gains(norms: dict[int, dict[int, float]], fmt: ExpertFormat
                       ) -> tuple[dict[int, dict[int, float]], dict]:
    """The calibration-free estimate of each expert's gain from the widest code: its squared norm
    (`expert_norms`) times the format's relative-error gap on a fixed sample. Returns (gains, how they
    were made)."""
    gap = relative_error(fmt, fmt.code_bits[0]) - relative_error(fmt, fmt.code_bits[-1])
    gains = {layer: {e: norm * gap for e, norm in experts.items()} for layer, experts in norms.items()}
    return gains, {"rule": "squared norm x (relative error at the narrowest code - at the widest)",
                   "relative_error_gap": gap, "squared_norms": _str_keys(norms)}


def output_error_gains(upstream: Path, fmt: ExpertFormat, spec: dict, calibration_file: Path,
                       kept: dict[int, list[int]]) -> tuple[dict[int, dict[int, float]], dict]:
    """Each expert's measured output error at the narrowest code minus at the widest, on calibration
    text (`calibrated_bits`). Returns (gains, how they were made)."""
    measured = plugins.resolve(OUTPUT_ERRORS)(upstream, fmt, spec, calibration_file)
    gains = {layer: {e: measured[layer]["squared_error"][e][0] - measured[layer]["squared_error"][e][-1]
                     for e in experts} for layer, experts in kept.items()}
    return gains, {"rule": "output error on calibration text: sum over an expert's routed tokens of "
                           "|gate x (output with the narrowest code - exact output)|^2 / |residual stream|^2, "
                           "minus the same at the widest code",
                   "calibration": {**spec, "sha256": sha256_file(calibration_file)},
                   "code_bits": list(fmt.code_bits), "output_squared_error": _str_keys(measured)}


def make_plan(build_id: str, build_cfg: dict, upstream: Path, upstream_manifest: dict,
              calibration_file: Path | None = None, quantize_calibration_file: Path | None = None) -> dict:
    """Which experts a build keeps and which code width each takes. `calibration_file`: the text a
    calibrated prune method reads; `quantize_calibration_file`: the text output-aware bit allocation
    reads (builds.<id>.quantize.calibration)."""
    config = read_json(upstream / "config.json")
    adapter = adapter_for(config)
    check_has_moe(config, adapter)
    check_expert_headers(upstream, config)
    layers = adapter.moe_layers(config)
    num_experts, top_k, n_group = adapter.num_experts(config), adapter.top_k(config), adapter.n_group(config)
    fmt = source_format(config)
    kept = {layer: list(range(num_experts)) for layer in layers}
    plan: dict = {"build": build_id, "architecture": adapter.name, "source_format": fmt,
                  "upstream_revision": upstream_manifest.get("revision"),
                  "num_experts": num_experts, "top_k": top_k, "n_group": n_group, "moe_layers": layers,
                  "prune": None, "quantize": None}
    if "prune" in build_cfg:
        spec = build_cfg["prune"]
        keep = prune.kept_count(num_experts, spec["keep_fraction"], top_k, n_group,
                                where=f"builds.{build_id}.prune.keep_fraction")
        try:
            method = prune_methods.get(spec["method"], f"builds.{build_id}.prune.method")
        except PruneMethodError as error:
            raise BuildError(str(error)) from None
        all_scores = plugins.resolve(method.scorer)(upstream, spec, calibration_file, f"builds.{build_id}.prune")
        layer_plans = {}
        for layer in layers:
            scores = all_scores[layer]
            kept[layer] = prune.choose_experts(scores, keep, n_group)
            layer_plans[str(layer)] = {"kept": kept[layer], "scores": [round(float(s), 6) for s in scores]}
        plan["prune"] = {**spec, "keep": keep, "layers": layer_plans}
        if calibration_file is not None and method.calibrated:
            plan["prune"]["calibration_sha256"] = sha256_file(calibration_file)
    if "quantize" in build_cfg:
        spec = build_cfg["quantize"]
        try:
            expert_format = expert_formats.get(spec["format"], f"builds.{build_id}.quantize.format")
        except FormatError as error:
            raise BuildError(str(error)) from None
        max_bits = spec.get("max_bits_per_weight") or expert_format.default_budget
        problem = expert_format.budget_problem(max_bits, f"builds.{build_id}.quantize.max_bits_per_weight")
        if problem:
            raise BuildError(problem)
        unfit = expert_formats.output_aware_problems(spec, f"builds.{build_id}.quantize")
        if unfit:
            raise BuildError(unfit[0])
        steps = expert_formats.calibrated_steps(spec)
        if steps and quantize_calibration_file is None:
            raise BuildError(f"builds.{build_id}.quantize.calibration: no calibration file was given")
        plan["quantize"] = {**spec, "max_bits_per_weight": max_bits}
        if "encoder" in steps:
            plan["quantize"]["error_weights"] = importance_file.calibration_record(spec["calibration"],
                                                                                   quantize_calibration_file)
        # expert_bits is keyed by the build's (compacted) expert index
        if len(expert_format.code_bits) == 1:
            bits = {layer: {new: expert_format.code_bits[0] for new in range(len(kept[layer]))} for layer in layers}
            plan["quantize"]["expert_bits"] = _str_keys(bits)
        else:
            if "allocation" in steps:
                gains, sensitivity = output_error_gains(upstream, expert_format, spec["calibration"],
                                                        quantize_calibration_file, kept)
            else:
                gains, sensitivity = weight_error_gains(expert_norms(upstream, adapter, fmt, kept), expert_format)
            by_original = allocate_bits(gains, max_bits, expert_format)
            bits = {layer: {new: by_original[layer][old] for new, old in enumerate(kept[layer])} for layer in layers}
            plan["quantize"].update(expert_bits=_str_keys(bits), sensitivity=sensitivity)
    plan["num_experts_after"] = len(next(iter(kept.values())))
    plan["shards"] = sorted(set(index_of(upstream)["weight_map"].values()))
    return plan


def relative_error(fmt: ExpertFormat, bits: int, samples: int = 256) -> float:
    """A format's relative squared error at one code width on MXFP4-published Gaussian rows (a fixed,
    seeded sample)."""
    generator = torch.Generator().manual_seed(0)
    weight = mxfp4.quantize_values(torch.randn(samples, 256, generator=generator))
    codec = fmt.codec_module()
    codes, scales = codec.encode(weight, bits, name=f"{fmt.name} sample")
    decoded = codec.decode(codes, scales, torch.float32, name=f"{fmt.name} sample")
    return float((decoded - weight).pow(2).sum() / weight.pow(2).sum())


def _str_keys(nested: dict) -> dict:
    return {str(k): (_str_keys(v) if isinstance(v, dict) else v) for k, v in nested.items()}


# --------------------------------------------------------------------------------- shard rewrite
def rewrite_shard(upstream: Path, upstream_manifest: dict, shard: str, plan: dict, out_path: Path,
                  importance: importance_file.Importance | None = None) -> dict:
    """Rewrite one upstream shard for the build; returns what was done to it. `importance`: the input
    columns' importance the encoder weighs its error by, where the plan says so (`error_weights`)."""
    if (plan["quantize"] or {}).get("error_weights") and importance is None:
        raise BuildError(f"build {plan['build']}: its plan weighs the encoder's error by calibration activations, "
                         "but no importance file was given")
    verify_shard(upstream, upstream_manifest, shard)
    config = read_json(upstream / "config.json")
    adapter = adapter_for(config)
    fmt = plan["source_format"]
    kept = {int(k): v["kept"] for k, v in (plan["prune"] or {}).get("layers", {}).items()}
    renumber = {layer: {old: new for new, old in enumerate(experts)} for layer, experts in kept.items()}
    bits = {int(layer): {int(e): b for e, b in experts.items()}
            for layer, experts in ((plan["quantize"] or {}).get("expert_bits") or {}).items()}
    expert_format = expert_formats.get(plan["quantize"]["format"], "plan.quantize.format") if bits else None
    out: dict[str, torch.Tensor | StoredTensor] = {}
    counts = {"copied": 0, "dropped": 0, "sliced": 0, "quantized": 0}
    source = upstream / shard
    header, start = read_header(source), data_start(source)

    def copy_unchanged(name: str, target: str) -> None:
        """The tensor's bytes, and its MXFP4 `_scale` companion's, as they are upstream."""
        out[target] = stored_tensor(source, header, name, start)
        if name + SCALE_COMPANION in header:
            out[target + SCALE_COMPANION] = stored_tensor(source, header, name + SCALE_COMPANION, start)
        counts["copied"] += 1

    with safe_open(str(source), "pt") as f:
        names = set(f.keys())
        for name in sorted(names):
            if is_weight_companion(name, names):
                continue
            ref = adapter.parse_expert(name)
            router_layer = adapter.router_layer(name)
            if ref is not None and ref.layer in renumber and ref.expert not in renumber[ref.layer]:
                counts["dropped"] += 1
                continue
            if ref is not None:
                new_index = renumber.get(ref.layer, {}).get(ref.expert, ref.expert)
                target = adapter.expert_name(type(ref)(ref.layer, new_index, ref.projection, ref.suffix))
                expert_bits = bits.get(ref.layer, {}).get(new_index)
                if expert_bits and ref.suffix == "weight":
                    weighted = {"importance": importance.for_weight(ref.layer, ref.expert, ref.projection)} \
                        if importance else {}
                    encoded = expert_format.codec_module().encode(read_expert_weight(f, name, fmt, source), expert_bits,
                                                                  name=name, **weighted)
                    base = target[: -len(".weight")]
                    out[f"{base}.{expert_format.codes_suffix}"], out[f"{base}.{expert_format.scales_suffix}"] = encoded
                    counts["quantized"] += 1
                else:
                    copy_unchanged(name, target)
            elif router_layer is not None and router_layer in kept:
                out[name] = f.get_tensor(name)[torch.tensor(kept[router_layer])].contiguous()
                counts["sliced"] += 1
            elif adapter.is_fused_expert(name) and adapter.fused_layer(name) in kept:
                if bits:
                    raise BuildError(f"{name}: {expert_format.name} re-encoding of fused expert tensors is not "
                                     "supported yet")
                out[name] = f.get_tensor(name)[torch.tensor(kept[adapter.fused_layer(name)])].contiguous()
                counts["sliced"] += 1
            else:
                copy_unchanged(name, name)
    with atomic_path(out_path) as tmp:
        digest = save_shard(out, tmp, {"format": "pt", "moeshrink_build": plan["build"]})
    remember_verified(out_path.parent, out_path.name, digest)
    return {"shard": shard, **counts, "tensors": len(out)}


def link_shard(upstream: Path, upstream_manifest: dict, shard: str, out_path: Path) -> dict:
    """A build that changes nothing (the original) refers to the upstream bytes."""
    verify_shard(upstream, upstream_manifest, shard)
    if out_path.exists() or out_path.is_symlink():
        out_path.unlink()
    os.symlink((upstream / shard).resolve(), out_path)
    return {"shard": shard, "linked": True}


# ------------------------------------------------------------------------------------------ gather
def build_config(config: dict, plan: dict) -> dict:
    adapter = adapter_for(config)
    new = adapter.with_num_experts(config, plan["num_experts_after"])
    if plan["quantize"]:
        new["quantization_config"] = quantization_config(plan)
    return new


def quantization_config(plan: dict) -> dict:
    expert_format = expert_formats.get(plan["quantize"]["format"], "plan.quantize.format")
    return expert_format.codec_module().quantization_config(expert_format, plan["quantize"]["expert_bits"],
                                                            plan["source_format"])


def changes_nothing(plan: dict) -> bool:
    return not plan["prune"] and not plan["quantize"]


def gather(build_dir: Path, upstream: Path, upstream_manifest: dict, plan: dict, shard_files: list[str]) -> dict:
    """Index, config.json, tokenizer files and the manifest of a build folder whose shards exist."""
    config = read_json(upstream / "config.json")
    adapter = adapter_for(config)
    weight_map: dict[str, str] = {}
    bytes_by_class = {c: 0 for c in CLASSES}
    for shard in shard_files:
        header = read_header(build_dir / shard)
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            weight_map[name] = shard
            size = entry["data_offsets"][1] - entry["data_offsets"][0]
            bytes_by_class[adapter.tensor_class(expert_formats.logical_name(name))] += size
    total = sum(bytes_by_class.values())
    atomic_write_json(build_dir / INDEX_FILE, {"metadata": {"total_size": total}, "weight_map": weight_map})
    new_config = build_config(config, plan)
    atomic_write_json(build_dir / "config.json", new_config)
    for name in TOKENIZER_AND_CONFIG_FILES:
        if (upstream / name).exists():
            with atomic_path(build_dir / name) as tmp:
                shutil.copyfile(upstream / name, tmp)
    expert_weights = adapter.expert_weight_count(new_config)
    # linked shards are the upstream's own bytes, whose digests the upstream manifest already holds
    known = {s["file"]: s["sha256"] for s in upstream_manifest["shards"]} if changes_nothing(plan) else {}
    manifest = build_manifest(build_dir, {"kind": "build", "build": plan["build"], "upstream": str(upstream)},
                              known_sha256=known)
    manifest.update({
        "bytes_by_class": bytes_by_class,
        "routed_expert_weights": expert_weights,
        "routed_expert_bits_per_weight": 8 * bytes_by_class["routed_experts"] / expert_weights if expert_weights else None,
        "num_experts": plan["num_experts_after"],
        "done": {"prune": plan["prune"] and {k: v for k, v in plan["prune"].items() if k != "layers"},
                 "quantize": plan["quantize"] and {k: v for k, v in plan["quantize"].items()
                                                   if k not in ("expert_bits", "sensitivity")}},
    })
    return manifest
