"""One eval of one build, as a rule runs it: check the config and the set, wait for the build's
server, send the requests, write the records and the JSON."""
from __future__ import annotations

import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from moeshrink.core import eval_kinds, plugins
from moeshrink.core.ioutil import read_json
from moeshrink.core.provenance import Provenance
from moeshrink.evals import EvalError, agreement, facts, harness, result, sets, toolcalls
from moeshrink.evals.client import RequestPool
from moeshrink.evals.usage import Usage
from moeshrink.serve.endpoint import Endpoint
from moeshrink.serve.server_lease import ServerLease


@dataclass
class EvalJob:
    build: str
    eval_id: str
    cfg: dict                 # evals.<eval_id>
    client: dict              # evals.client
    serve: dict               # serve (for limits the server enforces)
    build_dir: Path
    server: ServerLease      # the build's server, acquired when the eval first needs it
    out_json: Path
    records: Path
    inputs: dict[str, Path]   # the eval set files, by name
    reference_file: Path | None = None  # agreement: the reference's top-K (written by the reference's own job)
    reference_build: str | None = None  # agreement: the build that file is of (None: this job is the reference)
    usage: Usage = field(default_factory=Usage)  # what its replies used
    served_since: float | None = None  # when the server answered it

    def provenance(self) -> Provenance:
        return Provenance(f"eval_{self.eval_id}", {self.eval_id: self.cfg, "client": self.client},
                          inputs=[str(p) for p in self.inputs.values()])

    def endpoint(self) -> Endpoint:
        endpoint = self.server.acquire()
        self.served_since = self.served_since or time.time()
        return endpoint

    def pool(self, endpoint: Endpoint) -> RequestPool:
        return RequestPool(endpoint, self.client["concurrency"], self.client["retries"], self.client["timeout_s"],
                           self.client["backoff_s"], label=f"{self.build}/{self.eval_id}", usage=self.usage)

    def write(self, prov: Provenance, endpoint: Endpoint, items: int, metrics: dict, records: list[dict],
              **extra) -> dict:
        seconds = time.time() - (self.served_since or time.time())
        return result.write(self.out_json, self.records, records, build=self.build, eval_id=self.eval_id,
                            prov=prov, endpoint=endpoint, items=items, metrics=metrics,
                            throughput=self.usage.figures(seconds), **extra)


LM_EVAL_TASKS = {  # eval id -> (lm-eval's own task, the organism's task maker, its set kind, its few-shot split)
    "mmlu": (lambda cfg: harness.MMLU_FORMS[cfg["form"]][0],
             lambda test, fewshot, folder, cfg: harness.organism_mmlu_tasks(test, fewshot, folder, cfg["form"]),
             "mmlu", "dev"),
    "gsm8k": (lambda cfg: "gsm8k", lambda test, fewshot, folder, cfg: harness.organism_gsm8k_task(test, fewshot, folder),
              "gsm8k", "train"),
}


def run_lm_eval(job: EvalJob, gen_kwargs: dict | None = None) -> tuple[dict, Endpoint, str, int | None]:
    """lm-eval against the build's server: its own task on real runs, the organism's set otherwise."""
    real_task, organism_task, kind, fewshot_split = LM_EVAL_TASKS[job.eval_id]
    with tempfile.TemporaryDirectory(prefix="moeshrink-tasks-") as tmp:
        if job.cfg["dataset"] == "organism":
            test = sets.take(sets.read_set(job.inputs["test"], kind), job.cfg["items"], f"evals.{job.eval_id}.items",
                             str(job.inputs["test"]))
            task = organism_task(test, sets.read_set(job.inputs[fewshot_split], kind), Path(tmp), job.cfg)
            include, limit = Path(tmp), None
        else:
            task, include, limit = real_task(job.cfg), None, job.cfg["items"]
        endpoint = job.endpoint()
        results = harness.evaluate(endpoint, job.build_dir, task, include, job.cfg["shots"], limit, job.client,
                                   job.serve["max_model_len"], job.cfg["seed"], gen_kwargs, job.usage)
    return results, endpoint, task, limit


def run_mmlu(job: EvalJob) -> dict:
    prov = job.provenance()
    results, endpoint, task, limit = run_lm_eval(job)
    records = harness.mmlu_records(results)
    return job.write(prov, endpoint, len(records), harness.mmlu_metrics(records, results, task), records,
                     lm_eval={"model": harness.LM_EVAL_MODEL, "task": task, "limit_per_task": limit,
                              "num_fewshot": job.cfg["shots"], "form": job.cfg["form"],
                              "scored_by": harness.SCORED_BY[job.cfg["form"]]})


def run_gsm8k(job: EvalJob) -> dict:
    prov = job.provenance()
    gen_kwargs = {"max_gen_toks": job.cfg["max_tokens"], "temperature": 0, "do_sample": False}
    results, endpoint, task, limit = run_lm_eval(job, gen_kwargs)
    records = harness.gsm8k_records(results)
    return job.write(prov, endpoint, len(records), harness.gsm8k_metrics(records), records,
                     lm_eval={"model": harness.LM_EVAL_MODEL, "task": task, "limit": limit,
                              "num_fewshot": job.cfg["shots"], "gen_kwargs": gen_kwargs,
                              "seed": job.cfg["seed"]})


def run_facts(job: EvalJob) -> dict:
    prov = job.provenance()
    passages = sets.take(sets.read_set(job.inputs["passages"], "facts"), job.cfg["passages"], "evals.facts.passages",
                         str(job.inputs["passages"]))
    endpoint = job.endpoint()
    metrics, records = facts.run(job.pool(endpoint), endpoint.model, passages, job.cfg)
    return job.write(prov, endpoint, len(passages), metrics, records)


def run_toolcalls(job: EvalJob) -> dict:
    prov = job.provenance()
    tools = sets.read_tools(job.inputs["tools"])
    trials = sets.first_per_case(sets.read_set(job.inputs["trials"], "toolcalls"), job.cfg["trials_per_case"])
    unknown = {c["name"] for t in trials for c in t["expected_calls"]} - {t["function"]["name"] for t in tools}
    if unknown:
        raise EvalError(f"{job.inputs['trials']}: expected calls name tools that {job.inputs['tools']} lacks: "
                        f"{sorted(unknown)}")
    if not job.serve["tool_call_parser"]:
        raise EvalError("the toolcalls eval needs serve.tool_call_parser (the server parses the calls)")
    endpoint = job.endpoint()
    metrics, records = toolcalls.run(job.pool(endpoint), endpoint.model, trials, tools, job.cfg)
    cases = sorted({t["case"] for t in trials})
    return job.write(prov, endpoint, len(trials), metrics, records, calls_per_effort=metrics.pop("calls_per_effort"),
                     cases=cases, tool_call_parser=job.serve["tool_call_parser"])


def agreement_texts(job: EvalJob) -> list[dict]:
    texts = sets.read_set(job.inputs["texts"], "text")
    return agreement.pick_passages(texts, job.cfg["passages"], str(job.inputs["texts"]))


def run_agreement_reference(job: EvalJob) -> dict:
    """The reference reads the passages: its top-K is stored for every other build, then it reads
    them again and is compared with its own first reading (the serving noise floor)."""
    prov = job.provenance()
    reference_file = job.reference_file
    vocab = read_json(job.build_dir / "config.json")["vocab_size"]
    passages = agreement_texts(job)
    token_ids = agreement.tokenize(job.build_dir, passages, job.cfg["max_tokens"])
    endpoint = job.endpoint()
    pool = job.pool(endpoint)
    top_k = job.cfg["top_k"]
    pairs = list(zip([p["id"] for p in passages], token_ids))
    top_ids, top_lp = agreement.read_top(pool, endpoint.model, pairs, top_k, top_k + 1)
    full = agreement.read_full(pool, endpoint.model, agreement.exact_prompts(pairs, job.cfg), vocab)
    agreement.save_reference(reference_file, [p["id"] for p in passages], token_ids, top_ids, top_lp, full, top_k)
    metrics, records = agreement.run(pool, endpoint.model, agreement.load_reference(reference_file), job.cfg, vocab)
    return job.write(prov, endpoint, len(passages), metrics, records, reference=True,
                     compared_with=f"{job.build} itself, read a second time (serving noise floor)",
                     reference_file=str(reference_file), source=str(job.inputs["texts"]))


def run_agreement(job: EvalJob) -> dict:
    """Against the reference's stored top-K; the reference's own job reads the passages first."""
    if job.reference_build is None:
        return run_agreement_reference(job)
    prov = job.provenance()
    reference_file, reference_build = job.reference_file, job.reference_build
    vocab = read_json(job.build_dir / "config.json")["vocab_size"]
    reference = agreement.load_reference(reference_file)
    if reference["top_k"] != job.cfg["top_k"] or len(reference["passage_ids"]) != job.cfg["passages"]:
        raise EvalError(f"{reference_file} was made with other evals.agreement settings; rerun the reference")
    endpoint = job.endpoint()
    metrics, records = agreement.run(job.pool(endpoint), endpoint.model, reference, job.cfg, vocab)
    return job.write(prov, endpoint, len(records), metrics, records, reference=False, compared_with=reference_build,
                     reference_file=str(reference_file))


def run(job: EvalJob) -> dict:
    """The eval's registered runner (`moeshrink.core.eval_kinds`)."""
    return plugins.resolve(eval_kinds.get(job.eval_id).runner)(job)
