"""Config validation: JSON Schema plus the cross-field rules a schema cannot say, with errors that
name the key's path (`builds.twx2_5.quantize.format: ...`)."""
from __future__ import annotations

import copy
import re
from importlib import resources
from pathlib import Path

import yaml

from moeshrink.core import eval_kinds, expert_formats, prune_methods, sweeps
from moeshrink.core.errors import MoeshrinkError

SCHEMA_FILE = "config.schema.yaml"  # package data of moeshrink.core: every key, its type, default and meaning
COMMIT_HASH = re.compile(r"^[0-9a-f]{40}$")


class ConfigError(MoeshrinkError, ValueError):
    """Every problem found, one per line, each starting with the key path it concerns."""

    def __init__(self, problems: list[str], source: str = "config"):
        self.problems = problems
        super().__init__(f"{source} is invalid:\n" + "\n".join(f"  - {p}" for p in problems))


def load_schema() -> dict:
    """The schema, with the config section of every registered eval it does not list (a plugin's)."""
    schema = yaml.safe_load(resources.files("moeshrink.core").joinpath(SCHEMA_FILE).read_text())
    eval_sections = schema["properties"]["evals"]["properties"]
    for eval_id, kind in eval_kinds.kinds().items():
        if eval_id not in eval_sections:
            eval_sections[eval_id] = kind.schema or {"type": "object"}
    return schema


def _key_path(parts) -> str:
    return ".".join(str(p) for p in parts) or "(top level)"


def _describe(error) -> list[str]:
    path = list(error.absolute_path)
    if error.validator == "additionalProperties" and isinstance(error.instance, dict):
        allowed = sorted(error.schema.get("properties", {}))
        unknown = [k for k in error.instance if k not in allowed] if allowed else []
        hint = f" (allowed: {', '.join(allowed)})" if allowed else ""
        return [f"{_key_path(path + [k])}: unknown key{hint}" for k in unknown] or [f"{_key_path(path)}: {error.message}"]
    if error.validator == "required":
        missing = re.findall(r"'([^']+)' is a required property", error.message)
        return [f"{_key_path(path + missing)}: missing (required)"]
    if "propertyNames" in error.schema_path and path[-1:] == ["grid"]:
        return [f"{_key_path(path)}: key {error.instance!r} is not a build key as a dotted path "
                "(e.g. quantize.max_bits_per_weight, prune.keep_fraction)"]
    if "propertyNames" in error.schema_path:
        return [f"{_key_path(path)}: key {error.instance!r} is not a plain identifier (lowercase letters, digits, _)"]
    if error.validator == "oneOf" and error.context:
        return [f"{_key_path(path)}: {error.instance!r} is not valid: " +
                " or ".join(sorted({c.message for c in error.context}))]
    return [f"{_key_path(path)}: {error.message}"]


def schema_problems(config: dict, schema: dict, prefix: str = "") -> list[str]:
    """Every schema violation, each naming its key path (under `prefix`, where `config` is a part of one)."""
    from jsonschema import Draft202012Validator

    validator = Draft202012Validator(schema)
    problems: list[str] = []
    for error in sorted(validator.iter_errors(config), key=lambda e: [str(p) for p in e.absolute_path]):
        problems += [f"{prefix}.{problem}" if prefix else problem for problem in _describe(error)]
    return problems


def sweep_point_problems(config: dict, schema: dict) -> list[str]:
    """Each sweep point checked as a build (schema first), each problem naming the sweep and the point."""
    build_schema = {"$defs": schema["$defs"], **schema["properties"]["builds"]["additionalProperties"]}
    problems: list[str] = []
    for build_id, build in config["builds"].items():
        if sweeps.SWEEP_KEY in build:
            where = sweeps.where(build[sweeps.SWEEP_KEY], build_id)
            found = schema_problems(build, build_schema, where)
            problems += found or build_problems(config, where, build)
    return problems


ORGANISM_PARTS = ("data", "tokenizer", "model", "train", "publish", "card")


def semantic_problems(config: dict) -> list[str]:
    problems: list[str] = []
    builds = config["builds"]
    if config["reference_build"] not in builds:
        problems.append(f"reference_build: {config['reference_build']!r} is not a build "
                        f"(builds: {', '.join(builds)})")
    if "summary" in builds:
        problems.append("builds.summary: the name is taken by results/<run>/compare/summary.json; rename the build")
    for index, pair in enumerate(config["compare"]["pairs"]):
        for build_id in pair:
            if build_id not in builds:
                problems.append(f"compare.pairs[{index}]: {build_id!r} is not a build (builds: {', '.join(builds)})")
        if pair[0] == pair[1]:
            problems.append(f"compare.pairs[{index}]: a build compared with itself ({pair[0]!r})")
    for build_id, build in builds.items():
        for step in ("prune", "quantize"):
            if step in build and build_id == config["reference_build"]:
                problems.append(f"builds.{build_id}.{step}: the reference build must be the upstream as published")
        if build_id == config["reference_build"] and build.get("evals") is not None:
            problems.append(f"builds.{build_id}.evals: the reference runs every eval (every build is compared with it)")
        unknown = [e for e in build.get("evals") or [] if e not in config["evals"] or e == "client"]
        if unknown and sweeps.SWEEP_KEY not in build:
            problems.append(f"builds.{build_id}.evals: {', '.join(map(repr, unknown))} not configured under evals")
        if sweeps.SWEEP_KEY not in build:  # a sweep's points were checked as its points
            problems += build_problems(config, f"builds.{build_id}", build)
        elif build[sweeps.SWEEP_KEY] not in (config.get("sweeps") or {}):
            problems.append(f"builds.{build_id}.sweep: set by the expansion of sweeps, not by hand "
                            f"({build[sweeps.SWEEP_KEY]!r} is not a sweep)")
    gsm8k = config["evals"].get("gsm8k")
    if gsm8k:
        for build_id in gsm8k["builds"] or []:
            if build_id not in builds:
                problems.append(f"evals.gsm8k.builds: {build_id!r} is not a build (builds: {', '.join(builds)})")
    upstream = config["upstream"]
    source = upstream["source"]
    problems += organism_problems(upstream.get("organism"))
    if source not in upstream:
        return problems + [f"upstream.{source}: missing (required when upstream.source is {source})"]
    if source == "hf":
        hf = upstream["hf"]
        if not hf["repo_id"]:
            problems.append("upstream.hf.repo_id: required when upstream.source is hf")
        if not hf["revision"] or not COMMIT_HASH.match(hf["revision"]):
            problems.append(f"upstream.hf.revision: must pin a 40-hex-digit commit hash, got {hf['revision']!r}")
    if source == "path" and not upstream["path"]["dir"]:
        problems.append("upstream.path.dir: required when upstream.source is path")
    for eval_id in ("mmlu", "gsm8k"):
        spec = config["evals"].get(eval_id)
        if spec and spec["dataset"] == "organism" and source != "organism":
            problems.append(f"evals.{eval_id}.dataset: 'organism' needs upstream.source organism; "
                            "use lm_eval for a real model")
    agreement = config["evals"].get("agreement")
    cap = config["serve"]["max_logprobs"]
    if agreement and cap != -1 and agreement["top_k"] > cap:
        problems.append(f"evals.agreement.top_k: {agreement['top_k']} is more than the server returns "
                        f"(serve.max_logprobs {cap})")
    if agreement and agreement["exact_check_passages"] and cap != -1:
        problems.append("evals.agreement.exact_check_passages: needs whole-vocabulary log-probabilities "
                        f"(serve.max_logprobs -1, not {cap})")
    organism = upstream.get("organism") or {}
    needs_world = [e for e in ("facts", "toolcalls") if e in config["evals"]]
    if (config["evals"].get("agreement") or {}).get("file", "") is None:
        needs_world.append("agreement")
    if needs_world and "data" not in organism:
        problems.append(f"upstream.organism.data: the {', '.join(needs_world)} eval sets come from the organism's "
                        "world generator; give its data section (or an agreement file)")
    if source != "organism":
        return problems
    missing = [key for key in ORGANISM_PARTS if key not in organism]
    if missing:
        return problems + [f"upstream.organism.{key}: required when upstream.source is organism" for key in missing]
    model = upstream["organism"]["model"]
    if model["n_routed_experts"] % model["n_group"]:
        problems.append(f"upstream.organism.model.n_group: {model['n_group']} does not divide "
                        f"n_routed_experts {model['n_routed_experts']}")
    if model["topk_group"] > model["n_group"]:
        problems.append("upstream.organism.model.topk_group: must not exceed n_group")
    if model["num_experts_per_tok"] > model["n_routed_experts"]:
        problems.append("upstream.organism.model.num_experts_per_tok: must not exceed n_routed_experts")
    if model["first_k_dense_replace"] >= model["num_hidden_layers"]:
        problems.append("upstream.organism.model.first_k_dense_replace: leaves no MoE layer")
    for key in ("hidden_size", "moe_intermediate_size"):
        if model[key] % 32:
            problems.append(f"upstream.organism.model.{key}: MXFP4 needs a multiple of 32, got {model[key]}")
    return problems


def _registered(get, name: str, where: str):
    """A registry's entry for `name`, or None and the problem naming the key and the known names."""
    try:
        return get(name, where), []
    except MoeshrinkError as error:
        return None, [str(error)]


def organism_problems(organism: dict | None) -> list[str]:
    """A second training phase needs documents of its own."""
    if not organism or "train" not in organism or not organism["train"].get("polish"):
        return []
    counts = organism["data"].get("polish_corpus") or {}
    if not any(counts.get(kind) for kind in ("drill", "bio", "city", "cloze", "mc", "mc_open", "mc_bind", "arith",
                                               "facts", "toolcalls")):
        return ["upstream.organism.data.polish_corpus: names no documents, but upstream.organism.train.polish "
                "trains on them"]
    return []


def build_problems(config: dict, where: str, build: dict) -> list[str]:
    """What is wrong with how one build is made; `where` names it (builds.twx3, or a sweep's point)."""
    source = config["upstream"]["source"]
    model = (config["upstream"].get("organism") or {}).get("model") if source == "organism" else None
    return [*prune_problems(where, build.get("prune"), source, model),
            *quantize_problems(where, build.get("quantize"), source)]


def prune_problems(where: str, prune_spec: dict | None, source: str, model: dict | None = None) -> list[str]:
    """A build's prune method must be registered; calibration text is given to the methods that read it; the
    keep fraction keeps a count of experts a layer can route to (checked here where the model is known
    before its checkpoint: the organism's)."""
    if not prune_spec:
        return []
    method, unknown = _registered(prune_methods.get, prune_spec["method"], f"{where}.prune.method")
    if method is None:
        return unknown
    problems = []
    if model and all(key in model for key in ("n_routed_experts", "num_experts_per_tok", "n_group")):
        try:
            prune_methods.kept_count(model["n_routed_experts"], prune_spec["keep_fraction"],
                                     model["num_experts_per_tok"], model["n_group"], where=f"{where}.prune.keep_fraction")
        except prune_methods.PruneConfigError as error:
            problems.append(str(error))
    calibration = prune_spec.get("calibration")
    if not method.calibrated:
        return problems + ([f"{where}.prune.calibration: method {method.name} reads no calibration text"]
                           if calibration is not None else [])
    if calibration is None:
        return problems + [f"{where}.prune.calibration: required for method {method.name} (file, sequences, seq_len)"]
    if calibration["file"] is None and source != "organism":
        return problems + [f"{where}.prune.calibration.file: required unless upstream.source is organism (whose "
                           "corpus is the default)"]
    return problems


def quantize_problems(where: str, quantize_spec: dict | None, source: str) -> list[str]:
    """A build's expert format must be registered, its bit budget one the format can keep, and calibration
    text given only to a format in which it decides something (`ExpertFormat.output_aware_steps`)."""
    if not quantize_spec:
        return []
    expert_format, unknown = _registered(expert_formats.get, quantize_spec["format"], f"{where}.quantize.format")
    if expert_format is None:  # an unknown format: the rest cannot be checked
        return unknown
    budget = quantize_spec.get("max_bits_per_weight")
    problem = budget is not None and expert_format.budget_problem(
        budget, f"{where}.quantize.max_bits_per_weight")
    problems = [problem] if problem else []
    problems += expert_formats.output_aware_problems(quantize_spec, f"{where}.quantize")
    calibration = quantize_spec.get("calibration")
    if calibration is not None and calibration["file"] is None and source != "organism":
        problems.append(f"{where}.quantize.calibration.file: required unless upstream.source is organism "
                        "(whose corpus is the default)")
    return problems


def fill_defaults(config: dict, schema: dict) -> None:
    """Set every key the config leaves out that the schema gives a `default:`, in place, wherever its
    parent mapping is present (the schema is the one place a default lives)."""
    def walk(instance, node: dict) -> None:
        if not isinstance(instance, dict) or not isinstance(node, dict):
            return
        if str(node.get("$ref", "")).startswith("#/"):  # a local definition: its defaults count too
            target = schema
            for part in node["$ref"][2:].split("/"):
                target = target[part]
            walk(instance, target)
        for name, sub in node.get("properties", {}).items():
            if isinstance(sub, dict) and "default" in sub and name not in instance:
                instance[name] = copy.deepcopy(sub["default"])
            if name in instance:
                walk(instance[name], sub)
        if isinstance(node.get("additionalProperties"), dict):
            for name, value in instance.items():
                if name not in node.get("properties", {}):
                    walk(value, node["additionalProperties"])

    walk(config, schema)


def validate(config: dict, source: str = "config", schema: dict | None = None) -> dict:
    """Fill the schema's defaults into `config` (in place) and return it if valid; raise ConfigError
    listing every problem otherwise."""
    schema = schema or load_schema()
    problems = schema_problems(config, schema)
    if not problems:
        fill_defaults(config, schema)
        problems = sweeps.expand(config) + sweep_point_problems(config, schema)
    if not problems:
        problems = semantic_problems(config)
    if problems:
        raise ConfigError(problems, source)
    return config


DEFAULT_FILE = Path("config.yaml")  # the embedded default, which a preset is laid over


def merge(config: dict, overrides: dict) -> dict:
    """`overrides` laid over `config` (in place) as Snakemake lays a --configfile over the workflow's
    config: nested mappings merged key by key, any other value (a list, a number, null) replaced."""
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(config.get(key), dict):
            merge(config[key], value)
        else:
            config[key] = value
    return config


def read_layers(*paths: Path | str) -> dict:
    """The YAML files laid over each other in order, not yet validated."""
    config: dict = {}
    for path in paths:
        try:
            with open(path) as f:
                layer = yaml.safe_load(f)
        except FileNotFoundError:
            raise ConfigError(["(file): not found"], str(path)) from None
        if not isinstance(layer, dict):
            raise ConfigError(["(top level): the file is not a YAML mapping"], str(path))
        merge(config, layer)
    return config


def load(*paths: Path | str, base: Path | str | None = DEFAULT_FILE) -> dict:
    """The study's config as `snakemake --configfile PATH...` reads it: `base` (config.yaml, the embedded
    default) with each file laid over it in turn, validated, the schema's defaults filled in. With
    base None, the files alone (as with --replace-workflow-config)."""
    layers = [p for p in [base, *paths] if p is not None]
    unique = [p for i, p in enumerate(layers) if Path(p).resolve() not in {Path(q).resolve() for q in layers[:i]}]
    return validate(read_layers(*unique), " + ".join(map(str, unique)))
