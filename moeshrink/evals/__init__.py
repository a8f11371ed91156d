"""The five evaluations, each against a build's running vLLM server (see rules/evals.smk)."""
from moeshrink.core.errors import MoeshrinkError

EVALS = ("mmlu", "gsm8k", "facts", "toolcalls", "agreement")


class EvalError(MoeshrinkError, RuntimeError):
    pass


def configured_evals(config: dict) -> list[str]:
    """The evals config asks for, in the report's order."""
    return [eval_id for eval_id in EVALS if eval_id in config["evals"]]


def eval_builds(config: dict, eval_id: str) -> list[str]:
    """The builds an eval runs for: every build, except where config narrows it (gsm8k.builds)."""
    return config["evals"][eval_id].get("builds") or list(config["builds"])
