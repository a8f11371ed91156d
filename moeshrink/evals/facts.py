"""facts: the build reads each passage and writes out the facts it states, one `subject | relation |
object` line each; every line is matched back to the passage's gold facts after normalisation.
A fact the passage does not state is made up; a line that is not a fact is unparseable."""
from __future__ import annotations

from moeshrink.core.stats import rate_with_ci
from moeshrink.evals import finite
from moeshrink.evals.client import RequestPool
from moeshrink.evals.scoring import FACT_OUTCOMES, fact_outcomes, holds_call_markup
from moeshrink.organism.tasks import facts_messages


def run(pool: RequestPool, model: str, passages: list[dict], cfg: dict) -> tuple[dict, list[dict]]:
    requests = [(p["id"], {"model": model, "messages": facts_messages(p), "temperature": 0,
                           "max_tokens": cfg["max_tokens"], "seed": cfg["seed"], **finite.CHAT_LOGPROBS})
                for p in passages]
    replies = pool.map("/v1/chat/completions", requests)
    records = []
    totals = dict.fromkeys(FACT_OUTCOMES, 0)
    for passage, reply in zip(passages, replies):
        text = reply["choices"][0]["message"].get("content") or ""
        outcomes = fact_outcomes(text, passage["fact_lines"])
        counts = {key: sum(1 for _, o in outcomes if o == key) for key in FACT_OUTCOMES}
        for key, value in counts.items():
            totals[key] += value
        records.append({"id": passage["id"], **counts, "gold_facts": len(passage["fact_lines"]),
                        "lines": [{"line": line, "outcome": outcome} for line, outcome in outcomes],
                        "reply": text, "finish_reason": reply["choices"][0].get("finish_reason")})
    stated = totals["supported"] + totals["made_up"]
    gold = sum(len(p["fact_lines"]) for p in passages)
    metrics = {
        "made_up": {**rate_with_ci(totals["made_up"], stated),
                    "text": f"{100 * totals['made_up'] / stated:.1f}%, {totals['made_up']:,} of {stated:,}"
                    if stated else "no fact stated"},
        "supported_recall": rate_with_ci(totals["supported"], gold),
        "unparseable_lines": totals["unparseable"],
        "passages_with_made_up": sum(1 for r in records if r["made_up"]),
        # a reply with call markup instead of fact lines: the chat prompts of facts and tools confused
        "tool_call_replies": rate_with_ci(sum(1 for r in records if holds_call_markup(r["reply"])), len(records)),
    }
    return metrics, records
