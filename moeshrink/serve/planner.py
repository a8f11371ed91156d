"""`python -m moeshrink plan`: memory per card of every build of a config, for each GPU type and
tensor-parallel size, before any GPU is used.

Sizes come from safetensors headers and config.json only: a built build's own files when they
exist; otherwise the upstream's, changed as the build's spec would change them (experts dropped
by the keep fraction, routed experts re-encoded at the format's bits per weight), which is marked
`modelled` in the output. The upstream is results/<run>/upstream/ once the workflow made it, or for a
Hugging Face source the local cache (headers are enough: no weights need to be present).
"""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from moeshrink.compress import prune
from moeshrink.core import expert_formats
from moeshrink.core.arch import adapter_for
from moeshrink.core.errors import MoeshrinkError
from moeshrink.core.expert_formats import ExpertFormat, FormatError
from moeshrink.core.rule_params import build_params
from moeshrink.serve import memory
from moeshrink.serve.memory import GIB, Tensor


class PlanError(MoeshrinkError, ValueError):
    pass


# ----------------------------------------------------------------------------- where sizes come from
def hf_snapshot(hf: dict) -> Path:
    """The local snapshot of a pinned Hugging Face revision (config.json and safetensors headers)."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return Path(snapshot_download(hf["repo_id"], revision=hf["revision"], local_files_only=True,
                                      allow_patterns=["*.json", "*.safetensors"]))
    except (LocalEntryNotFoundError, FileNotFoundError) as exc:
        raise PlanError(f"upstream.hf: {hf['repo_id']}@{hf['revision']} is not in the local Hugging Face cache; "
                        "download its config.json and safetensors headers first (huggingface-cli download, or "
                        "run the upstream stage)") from exc


def _upstream_identity(source: str, subtree: dict) -> dict:
    """What makes an upstream this upstream: the hub repo at its revision, the local folder, or the
    organism's architecture and publication."""
    if source == "hf":
        return {"repo_id": subtree.get("repo_id"), "revision": subtree.get("revision")}
    if source == "path":
        return {"dir": subtree.get("dir")}
    return {"model": subtree.get("model"), "publish": subtree.get("publish")}


def made_for_this_upstream(config: dict, results: Path) -> tuple[bool, str]:
    """Whether results/<run>/upstream was made from the upstream this config names (another study's folder
    of the same name must never answer for it), and why not."""
    manifest_path = results / "upstream/manifest.json"
    if not manifest_path.exists():
        return False, f"{manifest_path} does not exist"
    made = json.loads(manifest_path.read_text()).get("provenance", {}).get("config", {})
    source = config["upstream"]["source"]
    ours = _upstream_identity(source, config["upstream"].get(source) or {})
    if made.get("source") != source or _upstream_identity(source, made.get(source) or {}) != ours:
        return False, (f"{manifest_path} was made from another upstream ({made.get('source')}: "
                       f"{_upstream_identity(made.get('source') or '', made.get(made.get('source')) or {})}, "
                       f"this config: {source}: {ours})")
    return True, ""


def made_for_this_build(build: str, spec: dict, config: dict, results: Path) -> bool:
    """Whether results/<run>/builds/{build} was made by this build spec from this config's upstream."""
    manifest_path = results / "builds" / build / "manifest.json"
    if not manifest_path.exists() or not made_for_this_upstream(config, results)[0]:
        return False
    made = json.loads(manifest_path.read_text()).get("provenance", {}).get("config", {}).get(build, {})
    return build_params({"builds": {build: made}}, build) == build_params({"builds": {build: spec}}, build)


def upstream_folder(config: dict, results: Path) -> Path:
    if (results / "upstream/config.json").exists() and made_for_this_upstream(config, results)[0]:
        return results / "upstream"
    upstream = config["upstream"]
    if upstream["source"] == "hf":
        return hf_snapshot(upstream["hf"])
    if upstream["source"] == "path":
        return Path(upstream["path"]["dir"])
    why = made_for_this_upstream(config, results)[1]
    raise PlanError(f"{results / 'upstream'}: the organism is made by the workflow ({why}); run "
                    f"`snakemake --cores all {results.as_posix()}/upstream/manifest.json` first")


def modelled_build(tensors: list[Tensor], config: dict, spec: dict, build: str) -> tuple[list[Tensor], dict]:
    """The upstream's tensors and config.json as the build spec changes them."""
    adapter = adapter_for(config)
    experts = adapter.num_experts(config)
    keep = experts
    if spec.get("prune"):
        keep = prune.kept_count(experts, spec["prune"]["keep_fraction"], adapter.top_k(config),
                                adapter.n_group(config), where=f"builds.{build}.prune.keep_fraction")
    layers = adapter.moe_layers(config)
    router_names = {name for layer in layers for name in adapter.router_tensors(layer).values()}
    bits, expert_format = None, None
    if spec.get("quantize"):
        try:
            expert_format = expert_formats.get(spec["quantize"]["format"], f"builds.{build}.quantize.format")
        except FormatError as error:
            raise PlanError(str(error)) from None
        bits = expert_format.mean_code_bits(spec["quantize"].get("max_bits_per_weight") or expert_format.default_budget)
    out: list[Tensor] = []
    for tensor in tensors:
        ref = adapter.parse_expert(tensor.name)
        if ref is not None:
            if ref.expert >= keep:
                continue
            if expert_format is not None:
                out += _encoded_tensors(tensor, expert_format, bits)
                continue
        elif adapter.is_fused_expert(tensor.name) or tensor.name in router_names:
            tensor = replace(tensor, shape=(keep, *tensor.shape[1:]))
            if expert_format is not None and tensor.name.endswith("_blocks"):  # gpt-oss MXFP4 [E, rows, K/32, 16]
                experts_kept, rows, blocks = tensor.shape[:3]
                tensor = replace(tensor, shape=(experts_kept, rows, int(blocks * 32 * bits / 8)))
        out.append(tensor)
    new_config = adapter.with_num_experts(config, keep)
    if expert_format is not None:
        new_config["quantization_config"] = {"quant_method": expert_format.quant_method,
                                             "expert_bits": {str(layer): dict.fromkeys(map(str, range(keep)), 0)
                                                             for layer in layers}}
    return out, new_config


def _encoded_tensors(tensor: Tensor, expert_format: ExpertFormat, bits: float) -> list[Tensor]:
    """The codes and scales replacing one expert weight (MXFP4 `weight` + `weight_scale`, or float)."""
    if tensor.name.endswith("weight_scale"):
        return []
    rows, width = tensor.shape
    inputs = width * 2 if tensor.dtype == "U8" else width
    stem = tensor.name.rsplit(".", 1)[0]
    return [Tensor(name, dtype, shape) for name, dtype, shape in expert_format.stored_tensors(stem, rows, inputs, bits)]


def build_sizes(build: str, spec: dict, config: dict, results: Path) -> tuple[list[Tensor], dict, str]:
    """A build's tensors and config.json, and where they came from."""
    folder = results / "builds" / build
    if made_for_this_build(build, spec, config, results):
        return memory.checkpoint_tensors(folder), json.loads((folder / "config.json").read_text()), "built"
    upstream = upstream_folder(config, results)
    tensors = memory.checkpoint_tensors(upstream)
    upstream_config = json.loads((upstream / "config.json").read_text())
    if not spec.get("prune") and not spec.get("quantize"):
        return tensors, upstream_config, "upstream"
    modelled, new_config = modelled_build(tensors, upstream_config, spec, build)
    return modelled, new_config, "modelled"


# ----------------------------------------------------------------------------------------- planning
def serving_settings(serve: dict) -> dict:
    return {"dtype": serve["dtype"], "cache_dtype": serve["kv_cache_dtype"], "block_size": serve["block_size"] or 16,
            "max_model_len": serve["max_model_len"], "utilisation": serve["gpu_memory_utilization"]}


def plan(config: dict, results: Path) -> dict:
    settings = serving_settings(config["serve"])
    gpus = config["plan"]["gpus"]
    rows = []
    for build, spec in config["builds"].items():
        tensors, build_config, origin = build_sizes(build, spec, config, results)
        build_config = memory.served_as(build_config, memory.serving_dtype(settings["dtype"], build_config, None))
        for gpu, card_gib in gpus.items():
            for tp in config["plan"]["tensor_parallel_sizes"]:
                refused = _refused(build_config, tp)
                if refused:
                    rows.append({"build": build, "sizes_from": origin, "gpu": gpu, "card_gib": card_gib,
                                 "tensor_parallel_size": tp, "refused": refused, "fits": False})
                    continue
                figures = memory.predict(tensors, build_config, card_gib * GIB, settings["utilisation"],
                                         config["plan"]["reserve_gib"] * GIB, tp, settings["cache_dtype"],
                                         settings["block_size"], settings["max_model_len"])
                rows.append({"build": build, "sizes_from": origin, "gpu": gpu, "card_gib": card_gib, **figures})
    return {"settings": {**settings, "reserve_gib": config["plan"]["reserve_gib"], "gpus": gpus}, "rows": rows}


def _refused(config: dict, tp: int) -> str | None:
    """Why vLLM would refuse this tensor-parallel size (attention heads must split evenly)."""
    heads = int(config.get("num_attention_heads") or 1)
    return f"num_attention_heads {heads} is not divisible by {tp}" if heads % tp else None


def table(result: dict) -> str:
    head = f"{'build':<12} {'gpu':<6} {'tp':>3} {'weights GiB':>12} {'room GiB':>10} {'tokens':>13}  sizes"
    lines = [head, "-" * len(head)]
    for row in result["rows"]:
        if row.get("refused"):
            lines.append(f"{row['build']:<12} {row['gpu']:<6} {row['tensor_parallel_size']:>3}  refused: {row['refused']}")
            continue
        tokens = f"{row['kv_cache_tokens']:,}" if row["fits"] else "does not fit"
        lines.append(f"{row['build']:<12} {row['gpu']:<6} {row['tensor_parallel_size']:>3} {row['weights_gib']:>12.4g} "
                     f"{row['kv_cache_gib']:>10.2f} {tokens:>13}  {row['sizes_from']}")
    return "\n".join(lines)
