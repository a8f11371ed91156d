"""toolcalls: every case's trials, run `runs` times at each effort (vLLM hands `reasoning_effort` to
the chat template); the server's tool parser turns the reply into calls. A call is right when the
tool names, the number of calls and the arguments (validated against the tool's JSON schema) are."""
from __future__ import annotations

from collections import Counter

from moeshrink.core.stats import rate_with_ci
from moeshrink.evals import EvalError, finite
from moeshrink.evals.client import RequestPool
from moeshrink.evals.scoring import calls_have_right_shape, served_tool_calls


def request_seed(base: int, effort_index: int, trial: int) -> int:
    """vLLM gives the i-th of a request's `n` samples the seed + i."""
    return base + 1_000_000 * effort_index + 1_000 * trial


def run(pool: RequestPool, model: str, trials: list[dict], tools: list[dict], cfg: dict) -> tuple[dict, list[dict]]:
    """The runs of a trial are the `n` samples of one request: the server reads the prompt once and
    parses every sample's calls on its own (the CPU build cannot cache prompt prefixes under MLA)."""
    records: list[dict] = []
    metrics: dict = {"by_effort": {}}
    calls_per_effort = {}
    for effort_index, effort in enumerate(cfg["efforts"]):
        requests = [(f"{effort}/{trial['id']}", {
            "model": model, "messages": trial["messages"], "tools": tools, "tool_choice": "auto",
            "reasoning_effort": effort, "temperature": cfg["temperature"], "top_p": cfg["top_p"],
            "max_tokens": cfg["max_tokens"], "n": cfg["runs"], "seed": request_seed(cfg["seed"], effort_index, index),
            **finite.CHAT_LOGPROBS})
            for index, trial in enumerate(trials)]
        replies = pool.map("/v1/chat/completions", requests)
        right_by_case: Counter = Counter()
        total_by_case: Counter = Counter()
        for trial, reply in zip(trials, replies):
            choices = sorted(reply["choices"], key=lambda c: c["index"])
            if len(choices) != cfg["runs"]:
                raise EvalError(f"{effort}/{trial['id']}: the server returned {len(choices)} samples, not {cfg['runs']}")
            for run_index, choice in enumerate(choices):
                message = choice["message"]
                calls, malformed = served_tool_calls(message)
                right = calls_have_right_shape(calls, trial["expected_calls"], tools)
                total_by_case[trial["case"]] += 1
                right_by_case[trial["case"]] += right
                records.append({"id": trial["id"], "case": trial["case"], "effort": effort, "run": run_index,
                                "right": right, "calls": calls, "malformed": malformed,
                                "expected_calls": trial["expected_calls"], "content": message.get("content"),
                                "finish_reason": choice.get("finish_reason")})
        calls_per_effort[effort] = sum(total_by_case.values())
        metrics["by_effort"][effort] = {
            "right": rate_with_ci(sum(right_by_case.values()), calls_per_effort[effort]),
            "by_case": {case: rate_with_ci(right_by_case[case], total) for case, total in total_by_case.items()},
            "malformed": sum(1 for r in records if r["effort"] == effort and r["malformed"]),
        }
    return {**metrics, "calls_per_effort": calls_per_effort}, records
