"""The five evaluations, each against a build's running vLLM server (see rules/evals.smk)."""

EVALS = ("mmlu", "gsm8k", "facts", "toolcalls", "agreement")


class EvalError(RuntimeError):
    pass
