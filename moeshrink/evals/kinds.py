"""The five built-in evals' registry entries (`moeshrink.core.eval_kinds`): their set files, runners
(`evals/run.py`) and how compare and the report treat them. Light: no lm-eval, no torch."""
from __future__ import annotations

from moeshrink.core.eval_kinds import EvalKind, register


def _organism_set(**files: str):
    """lm-eval's own task on real runs (it loads its data itself); the organism's set files otherwise."""
    return lambda spec, data: {name: f"{data}/{file}" for name, file in files.items()} \
        if spec["dataset"] == "organism" else {}


register(EvalKind("mmlu", "Knowledge (MMLU)", "moeshrink.evals.run:run_mmlu",
                  _organism_set(test="mc_test.jsonl", dev="mc_dev.jsonl"),
                  paired=True, metric="accuracy"))
register(EvalKind("gsm8k", "Arithmetic (GSM8K)", "moeshrink.evals.run:run_gsm8k",
                  _organism_set(test="arith_test.jsonl", train="arith_train.jsonl"), paired=True, metric="exact_match"))
register(EvalKind("facts", "Made-up facts", "moeshrink.evals.run:run_facts",
                  lambda spec, data: {"passages": f"{data}/passages_test.jsonl"},
                  comparer="moeshrink.compare.paired:made_up_facts"))
register(EvalKind("toolcalls", "Tool calls", "moeshrink.evals.run:run_toolcalls",
                  lambda spec, data: {"trials": f"{data}/toolcalls_test.jsonl", "tools": f"{data}/tools.json"},
                  comparer="moeshrink.compare.paired:tool_calls"))
register(EvalKind("agreement", "Next-word agreement", "moeshrink.evals.run:run_agreement",
                  lambda spec, data: {"texts": spec["file"] or f"{data}/corpus.jsonl"}))
