"""A toy eval, the way a new eval is added: this one module, which registers itself when imported
(another package would name it in the `moeshrink.evals` entry-point group; a module that is only on
the Python path, in MOESHRINK_PLUGINS). Paired: it asks the organism's arithmetic questions without
shots and counts a reply right when its first number is the answer."""
from __future__ import annotations

import hashlib
import re

from moeshrink.core import stats
from moeshrink.core.eval_kinds import EvalKind, register

SCHEMA = {"type": "object", "additionalProperties": False,
          "properties": {"items": {"type": "integer", "minimum": 1, "default": 8},
                         "max_tokens": {"type": "integer", "minimum": 1, "default": 24}}}
TOY = register(EvalKind("toy", "Toy arithmetic", f"{__name__}:run",
                        lambda spec, data: {"questions": f"{data}/arith_test.jsonl"},
                        paired=True, metric="accuracy", schema=SCHEMA))


def run(job) -> dict:
    from moeshrink.evals import sets

    prov = job.provenance()
    items = sets.take(sets.read_set(job.inputs["questions"], "gsm8k"), job.cfg["items"], "evals.toy.items",
                      str(job.inputs["questions"]))
    endpoint = job.endpoint()
    requests = [(str(i), {"model": endpoint.model, "prompt": f"Question: {item['question']}\nAnswer:",
                          "max_tokens": job.cfg["max_tokens"], "temperature": 0}) for i, item in enumerate(items)]
    replies = job.pool(endpoint).map("/v1/completions", requests)
    records = []
    for (item_id, _), item, reply in zip(requests, items, replies):
        text = reply["choices"][0]["text"]
        first = re.search(r"-?\d+", text)
        answer = item["answer"].rsplit("####", 1)[1].strip()
        records.append({"id": item_id, "doc_hash": hashlib.sha256(item["question"].encode()).hexdigest()[:16],
                        "correct": bool(first and first.group() == answer), "reply": text})
    right = sum(r["correct"] for r in records)
    return job.write(prov, endpoint, len(records), {"accuracy": stats.rate_with_ci(right, len(records))}, records)
