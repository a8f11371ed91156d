"""How replies are scored, shared by the served evals and the organism card (which runs the model
in-process) so that both score the same way."""
from __future__ import annotations

import json
import re

import jsonschema

GSM8K_ANSWER = re.compile(r"#### (\-?[0-9\.\,]+)")
FACT_OUTCOMES = ("supported", "made_up", "unparseable")


def gsm8k_answer(text: str) -> str | None:
    match = GSM8K_ANSWER.search(text)
    return match.group(1).replace(",", "").rstrip(".") if match else None


def calls_have_right_shape(calls: list[dict] | None, expected: list[dict], tools: list[dict]) -> bool:
    """Right tool names in order, right count, arguments valid against each tool's JSON schema.
    `calls` is None when the reply held a call that could not be parsed."""
    if calls is None or len(calls) != len(expected):
        return False
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    for call, want in zip(calls, expected):
        if call["name"] != want["name"] or not isinstance(call["arguments"], dict):
            return False
        try:
            jsonschema.validate(call["arguments"], schemas[call["name"]])
        except jsonschema.ValidationError:
            return False
    return True


CALL_MARKUP = "<tool_call>"  # the hermes convention's opening of a call


def holds_call_markup(text: str) -> bool:
    return CALL_MARKUP in text


def served_tool_calls(message: dict) -> tuple[list[dict] | None, str | None]:
    """The calls vLLM's tool parser returned in a chat message, arguments decoded; (None, why) when
    the reply is malformed: arguments that are not JSON, or call markup the parser could not read."""
    calls = []
    for call in message.get("tool_calls") or []:
        function = call.get("function") or {}
        try:
            arguments = json.loads(function.get("arguments") or "null")
        except json.JSONDecodeError as error:
            return None, f"arguments of {function.get('name')!r} are not JSON: {error}"
        calls.append({"name": function.get("name"), "arguments": arguments})
    if not calls and holds_call_markup(message.get("content") or ""):
        return None, "the reply holds call markup the tool parser could not read"
    return calls, None


def normalise_fact(line: str) -> tuple[str, ...] | None:
    parts = [" ".join(p.strip().lower().split()) for p in line.split("|")]
    return tuple(parts) if len(parts) == 3 and all(parts) else None


def fact_outcomes(reply: str, gold_lines: list[str]) -> list[tuple[str, str]]:
    """(line, outcome) for every non-empty line of the reply after any thought: `supported` when it
    is one of the passage's facts after normalisation, `made_up` when it is a fact the passage does
    not state, `unparseable` when it is not a fact line at all."""
    body = reply.split("</think>")[-1]
    gold = {normalise_fact(g) for g in gold_lines}
    outcomes = []
    for line in body.strip().splitlines():
        if not line.strip():
            continue
        fact = normalise_fact(line)
        outcomes.append((line, "unparseable" if fact is None else "supported" if fact in gold else "made_up"))
    return outcomes


def score_fact_lines(reply: str, gold_lines: list[str]) -> dict:
    counts = dict.fromkeys(FACT_OUTCOMES, 0)
    for _, outcome in fact_outcomes(reply, gold_lines):
        counts[outcome] += 1
    return counts
