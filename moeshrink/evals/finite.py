"""Non-finite values from a build's server: recognised, located in the item, and reported by name.

vLLM cannot encode NaN or infinity in a JSON reply: a request whose log-probabilities hold one is
answered with HTTP 400 and Python's "Out of range float values are not JSON compliant" (moeshrink's
prompt log-probabilities endpoint refuses such a reply in the same way, with its own message). Every eval
asks for log-probabilities (prompt log-probabilities, or those of the generated tokens), so a
non-finite value in the forward pass always reaches it as that reply and never passes silently
into an answer. The position is then found by asking again for less: prompt log-probabilities are
causal, so the shortest failing prompt prefix names the prompt position; otherwise the fewest
generated tokens that fail name the generated token.
"""
from __future__ import annotations

from collections.abc import Callable

from moeshrink.evals import EvalError
from moeshrink_kernels.vllm import logprobs_wire as wire

SERVER_MESSAGES = ("Out of range float values are not JSON compliant", wire.NONFINITE_MESSAGE)
METHOD = ("every request asks for log-probabilities; a reply the server refuses because one is NaN or infinite "
          "(HTTP 400: vLLM's 'Out of range float values are not JSON compliant', or moeshrink's prompt "
          "log-probabilities endpoint's own refusal) marks the item non-finite, "
          "and the position is found by asking again for shorter prompt prefixes or fewer generated tokens")
LOCATED_ITEMS_MAX = 5
CHAT_LOGPROBS = {"logprobs": True}  # chat requests ask for their tokens' log-probabilities for this check

Send = Callable[[dict], tuple[int, object]]


class NonFiniteReply(EvalError):
    """One item's reply held a non-finite value."""

    def __init__(self, item_id: str, path: str, body: dict):
        super().__init__(f"item {item_id!r}: the server's reply to {path} held a non-finite value")
        self.item_id, self.path, self.body = item_id, path, body


class NonFiniteError(EvalError):
    pass


def is_nonfinite_reply(status: int, reply: object) -> bool:
    return status == 400 and any(message in str(reply) for message in SERVER_MESSAGES)


def _fails(send: Send, body: dict) -> bool:
    status, reply = send(body)
    return is_nonfinite_reply(status, reply)


def _shortest_failing(count: int, fails: Callable[[int], bool]) -> int | None:
    """The smallest n in 1..count with fails(n), assuming failing is monotone in n; None if fails(count)
    does not hold (the value did not come back)."""
    if count < 1 or not fails(count):
        return None
    low, high = 1, count
    while low < high:
        middle = (low + high) // 2
        if fails(middle):
            high = middle
        else:
            low = middle + 1
    return low


def _prompt_prefix(body: dict) -> tuple[list[int], Callable[[int], dict]] | None:
    """A token-id prompt whose log-probabilities the request asks for, and the request for its first n
    tokens' top-1 alone: /v1/completions (`prompt`) or vLLM's token-in/token-out endpoint (`token_ids`)."""
    if "token_ids" in body:
        sampling = body.get("sampling_params") or {}
        if sampling.get("prompt_logprobs") is None:
            return None
        prompt = body["token_ids"]
        return prompt, lambda n: {**body, "token_ids": prompt[:n],
                                  "sampling_params": {**sampling, "max_tokens": 1, "temperature": 0, "prompt_logprobs": 1}}
    prompt = body.get("prompt")
    token_prompt = isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt)
    if not token_prompt or (body.get("prompt_logprobs") is None and not body.get("echo")):
        return None
    base = {"model": body.get("model"), "max_tokens": 1, "temperature": 0, "prompt_logprobs": 1}
    return prompt, lambda n: {**base, "prompt": prompt[:n]}


def locate(send: Send, body: dict) -> str:
    """Where in the item the first non-finite value is, in words."""
    if prefix := _prompt_prefix(body):
        prompt, first = prefix
        length = _shortest_failing(len(prompt), lambda n: _fails(send, first(n)))
        if length is not None:
            return f"prompt position {length - 1} (token id {prompt[length - 1]})"
        if "token_ids" in body:
            return "position not found (only the whole request fails)" if _fails(send, body) else \
                "not reproduced when asked again: the server is not deterministic for this item"
    max_tokens = int(body.get("max_tokens") or 0)
    generated = {**body, **(CHAT_LOGPROBS if "messages" in body else {"logprobs": 1})}
    if not (body.get("echo") or body.get("prompt_logprobs") is not None):
        count = _shortest_failing(max_tokens, lambda n: _fails(send, {**generated, "max_tokens": n}))
        if count is not None:
            return f"generated token {count - 1}"
    if _fails(send, body):
        return "position not found (only the whole request fails)"
    return "not reproduced when asked again: the server is not deterministic for this item"


def report(label: str, failures: list[NonFiniteReply], total: int, send: Send) -> NonFiniteError:
    """The error for an eval whose items got non-finite values: count, then each item and position."""
    located = [f"{f.item_id} at {locate(send, f.body)}" for f in failures[:LOCATED_ITEMS_MAX]]
    more = f"; and {len(failures) - LOCATED_ITEMS_MAX} more" if len(failures) > LOCATED_ITEMS_MAX else ""
    return NonFiniteError(f"{label}: {len(failures)} of {total} item(s) got non-finite log-probabilities from the "
                          f"server: {'; '.join(located)}{more}. The build computes NaN or infinity for them.")


def record(nonfinite_items: int = 0) -> dict:
    """What a finished eval says about its check."""
    return {"nonfinite_items": nonfinite_items, "method": METHOD}
