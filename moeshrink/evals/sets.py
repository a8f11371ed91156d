"""The eval sets, checked against their schemas before any request is sent: a bad item fails the
eval naming the file, the line and what is wrong."""
from __future__ import annotations

from pathlib import Path

import jsonschema

from moeshrink.core.ioutil import jsonl_lines, read_json
from moeshrink.evals import EvalError

_STR = {"type": "string", "minLength": 1}
_MESSAGES = {"type": "array", "minItems": 1, "items": {
    "type": "object", "required": ["role", "content"],
    "properties": {"role": {"enum": ["system", "user", "assistant", "tool"]}, "content": {"type": "string"}}}}
SCHEMAS: dict[str, dict] = {
    "mmlu": {"type": "object", "required": ["question", "subject", "choices", "answer"], "properties": {
        "question": _STR, "subject": _STR,
        "choices": {"type": "array", "minItems": 4, "maxItems": 4, "items": {"type": "string"}},
        "answer": {"type": "integer", "minimum": 0, "maximum": 3}}},
    "gsm8k": {"type": "object", "required": ["question", "answer"], "properties": {
        "question": _STR, "answer": {"type": "string", "pattern": "#### -?[0-9.,]+"}}},
    "facts": {"type": "object", "required": ["id", "passage", "fact_lines"], "properties": {
        "id": _STR, "passage": _STR, "fact_lines": {"type": "array", "minItems": 1, "items": _STR}}},
    "toolcalls": {"type": "object", "required": ["id", "case", "messages", "expected_calls"], "properties": {
        "id": _STR, "case": _STR, "messages": _MESSAGES,
        "expected_calls": {"type": "array", "items": {
            "type": "object", "required": ["name", "arguments"],
            "properties": {"name": _STR, "arguments": {"type": "object"}}}}}},
    "tools": {"type": "array", "minItems": 1, "items": {
        "type": "object", "required": ["type", "function"], "properties": {
            "type": {"const": "function"},
            "function": {"type": "object", "required": ["name", "parameters"],
                         "properties": {"name": _STR, "parameters": {"type": "object"}}}}}},
    "text": {"type": "object", "required": ["text"], "properties": {"text": {"type": "string"}}},
}


def read_set(path: Path, kind: str) -> list[dict]:
    """Every line of a JSONL eval set, each valid against SCHEMAS[kind]."""
    items = []
    for number, item in jsonl_lines(path):
        check(item, kind, f"{path}, line {number}")
        items.append(item)
    if not items:
        raise EvalError(f"{path}: the {kind} set is empty")
    return items


def read_tools(path: Path) -> list[dict]:
    tools = read_json(path)
    check(tools, "tools", str(path))
    for tool in tools:
        try:
            jsonschema.Draft202012Validator.check_schema(tool["function"]["parameters"])
        except jsonschema.SchemaError as error:
            raise EvalError(f"{path}: tool {tool['function']['name']!r} has an invalid parameters schema: "
                            f"{error.message}") from None
    return tools


def check(item, kind: str, where: str) -> None:
    error = jsonschema.exceptions.best_match(jsonschema.Draft202012Validator(SCHEMAS[kind]).iter_errors(item))
    if error is not None:
        field = "/".join(str(p) for p in error.absolute_path) or "(the item)"
        raise EvalError(f"{where}: not a {kind} item: {field}: {error.message}")


def first_per_case(items: list[dict], per_case: int) -> list[dict]:
    """The first `per_case` trials of every tool-call case, in file order; too few is an error."""
    chosen: dict[str, list[dict]] = {}
    for item in items:
        bucket = chosen.setdefault(item["case"], [])
        if len(bucket) < per_case:
            bucket.append(item)
    short = {case: len(v) for case, v in chosen.items() if len(v) < per_case}
    if short:
        raise EvalError(f"evals.toolcalls.trials_per_case is {per_case}, but the set has fewer trials for {short}")
    return [item for bucket in chosen.values() for item in bucket]


def take(items: list[dict], count: int | None, key: str, where: str) -> list[dict]:
    if count is not None and count > len(items):
        raise EvalError(f"{key} is {count}, but {where} holds only {len(items)} items")
    return items if count is None else items[:count]
