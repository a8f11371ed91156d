"""What each rule's `params:` hold: only the config keys that change that rule's output, in a canonical
form (dict keys sorted at every level), so that Snakemake's params trigger reruns exactly what a
change affects. Display keys (a build's label, the title) reach only the report; operational keys
(timeouts, retries, concurrency, threads, the cluster) reach no params at all: the jobs read them from
the config through `operational`. Reordering config.yaml changes no params."""
from typing import Any

from moeshrink.core import expert_formats

OPERATIONAL_SERVE_KEYS = ("startup_timeout_s", "stop_timeout_s", "idle_grace_s", "servers_per_machine")
THREADS = "threads"  # of the organism's training and card: jobs take it from their rule's `threads:`
# what a build is called, which sweep made it and which evals it runs: not how its checkpoint is made
NOT_MADE_BY_KEYS = ("label", "sweep", "evals")
# which builds an eval runs on decides which jobs exist, not what one job writes
EVAL_SCHEDULING_KEYS = ("builds",)


def canonical(value: Any) -> Any:
    """The same data with every dict's keys in sorted order (Snakemake compares params by repr)."""
    if isinstance(value, dict):
        return {key: canonical(value[key]) for key in sorted(value)}
    if isinstance(value, list):
        return [canonical(item) for item in value]
    return value


def _without(mapping: dict, keys: tuple[str, ...]) -> dict:
    return {key: value for key, value in mapping.items() if key not in keys}


def serve_params(config: dict) -> dict:
    """The serve settings that change what a server computes or holds (not how long it may take)."""
    return canonical(_without(config["serve"], OPERATIONAL_SERVE_KEYS))


def build_params(config: dict, build_id: str) -> dict:
    """How a build is made: its prune and quantize specs, never its label; what its quantize calibration
    decides as a sorted list, whether the config lists it (in any order) or leaves it to the format."""
    build = _without(config["builds"][build_id], NOT_MADE_BY_KEYS)
    quantize = build.get("quantize")
    if quantize and quantize.get("calibration") is not None:
        build["quantize"] = {**quantize, "output_aware": sorted(expert_formats.calibrated_steps(quantize))}
    return canonical(build)


def eval_params(config: dict, eval_id: str) -> dict:
    return canonical(_without(config["evals"][eval_id], EVAL_SCHEDULING_KEYS))


def report_params(config: dict) -> dict:
    """The study as the page shows it: everything but the operational keys. The builds keep their
    configured order, which is the order of the page's rows."""
    study = _without(config, ("cluster",))
    study["serve"] = _without(config["serve"], OPERATIONAL_SERVE_KEYS)
    study["evals"] = _without(config["evals"], ("client",))
    organism = config["upstream"].get("organism")
    if organism:
        study["upstream"] = {**config["upstream"], "organism": {
            **organism, **{part: _without(organism[part], (THREADS,)) for part in ("train", "card") if part in organism}}}
    study = canonical(study)
    study["builds"] = {build_id: canonical(spec) for build_id, spec in config["builds"].items()}
    return study


def organism_train_params(config: dict) -> dict:
    """What training computes with (not which path publishes it, where a shipped checkpoint lies, or how
    many threads run it)."""
    return canonical(_without(config["upstream"]["organism"]["train"], ("from", "shipped", THREADS)))


def organism_card_params(config: dict) -> dict:
    return canonical(_without(config["upstream"]["organism"]["card"], (THREADS,)))


def operational(config: dict) -> dict:
    """What a job needs to run but what never changes its output: read from the config, not params."""
    return {"serve": {key: config["serve"][key] for key in OPERATIONAL_SERVE_KEYS},  # schema defaults fill them
            "client": config["evals"]["client"]}
