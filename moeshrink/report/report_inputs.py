"""The files report/<run>/r013.html is rendered from, for a config: the report rule's input function and the
report's completeness check both read this one list (light: no pandas, no Jinja at workflow start-up)."""
from __future__ import annotations

from moeshrink.core.layout import results_dir
from moeshrink.evals import configured_evals, eval_builds


def input_files(config: dict) -> dict[str, str]:
    """Every stage's result for every configured build, by the key the report reads it under."""
    builds = list(config["builds"])
    reference = config["reference_build"]
    eval_ids = configured_evals(config)
    results = results_dir(config).as_posix()
    inputs = {"upstream": f"{results}/upstream/manifest.json"}
    inputs.update({f"build_{build}": f"{results}/builds/{build}/manifest.json" for build in builds})
    inputs.update({f"memory_{build}": f"{results}/serve/{build}/memory.json" for build in builds})
    inputs.update({f"prediction_{build}": f"{results}/serve/{build}/prediction.json" for build in builds})
    inputs.update({f"eval_{build}_{eval_id}": f"{results}/evals/{build}/{eval_id}.json"
                   for eval_id in eval_ids for build in eval_builds(config, eval_id)})
    if eval_ids:
        inputs.update({f"compare_{build}": f"{results}/compare/{build}.json" for build in builds if build != reference})
        inputs["summary"] = f"{results}/compare/summary.json"
        inputs.update({f"pair_{a}_vs_{b}": f"{results}/compare/pairs/{a}_vs_{b}.json"
                       for a, b in config["compare"]["pairs"]})
    if config["upstream"]["source"] == "organism":
        inputs["card"] = f"{results}/upstream/organism_card.json"
        inputs["train"] = f"{results}/organism/trained/train.json"
    return inputs
