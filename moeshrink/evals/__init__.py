"""The evaluations, each against a build's running vLLM server (see rules/evals.smk): the five built-in
ones (`kinds.py`) and any a plugin registers (`moeshrink.core.eval_kinds`)."""
from moeshrink.core import eval_kinds
from moeshrink.core.errors import MoeshrinkError


class EvalError(MoeshrinkError, RuntimeError):
    pass


def configured_evals(config: dict) -> list[str]:
    """The evals config asks for, in the report's order."""
    return [eval_id for eval_id in eval_kinds.kinds() if eval_id in config["evals"]]


def eval_builds(config: dict, eval_id: str) -> list[str]:
    """The builds an eval runs for: every build, except where config narrows it (gsm8k.builds, a build's or
    a sweep point's `evals`)."""
    named = config["evals"][eval_id].get("builds") or list(config["builds"])
    return [b for b in named if config["builds"][b].get("evals") is None or eval_id in config["builds"][b]["evals"]]
