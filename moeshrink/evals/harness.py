"""mmlu and gsm8k through lm-eval's `local-completions` model against the build's server.

Real runs use lm-eval's own `mmlu` and `gsm8k` tasks. The organism's sets are served to lm-eval as
custom tasks made from lm-eval's own task definitions (the installed package's YAML) with only the
data swapped for local JSONL files, registered through an include path: same code path, other data.
"""
from __future__ import annotations

import math
import os
from pathlib import Path

import yaml

from moeshrink.core.ioutil import atomic_write_jsonl
from moeshrink.core.stats import rate_with_ci
from moeshrink.evals import EvalError
from moeshrink.evals.finite import NonFiniteError
from moeshrink.evals.scoring import gsm8k_answer
from moeshrink.evals.usage import Usage
from moeshrink.organism.tasks import CLOZE_DELIMITER, LETTERS, MC_DESCRIPTION
from moeshrink.serve.endpoint import Endpoint, EndpointError
from moeshrink.serve.vllm_server import log_tail

LM_EVAL_MODEL = "moeshrink-completions"  # lm-eval's local-completions with the non-finite check (lm_eval_model)
ORGANISM_MMLU = "moeshrink_organism_mmlu"
ORGANISM_GSM8K = "moeshrink_organism_gsm8k"


def _lm_eval_task_yaml(relative: str) -> dict:
    import lm_eval

    return yaml.safe_load((Path(lm_eval.__file__).parent / "tasks" / relative).read_text())


# evals.mmlu.form -> lm-eval's own MMLU task, and the template the organism's tasks are made from
MMLU_FORMS = {"letter": ("mmlu", "mmlu/default/_default_template_yaml"),
              "cloze": ("mmlu_continuation", "mmlu/continuation/_continuation_template_yaml")}
SCORED_BY = {"letter": "loglikelihood of the answer letters (R-013's protocol)",
             "cloze": "loglikelihood of each option's text as the continuation of the question (cloze form, "
                      "OLMES's CF); acc on the summed loglikelihood, acc_norm on it per character"}


def organism_mmlu_tasks(test: list[dict], dev: list[dict], task_dir: Path, form: str = "letter") -> str:
    """One task per subject (as MMLU has), few-shot examples from that subject's dev items. `letter`:
    lm-eval's MMLU rendering; `cloze`: lm-eval's continuation task with the bare question as the context
    and no description, the rendering the corpus teaches (organism.tasks.cloze_line)."""
    template = _lm_eval_task_yaml(MMLU_FORMS[form][1])
    subjects = sorted({item["subject"] for item in test})
    tasks = []
    for subject in subjects:
        name = f"{ORGANISM_MMLU}_{subject}"
        files = {}
        for split, items in (("test", test), ("dev", dev)):
            files[split] = str((task_dir / f"{name}.{split}.jsonl").resolve())
            atomic_write_jsonl(files[split], [it for it in items if it["subject"] == subject])
        config = {**template, "task": name, "dataset_path": "json", "dataset_kwargs": {"data_files": files},
                  "description": MC_DESCRIPTION.format(subject=subject)}
        if form == "cloze":
            config.update({"description": "", "doc_to_text": "{{question.strip()}}", "target_delimiter": CLOZE_DELIMITER,
                           "metric_list": [{"metric": m, "aggregation": "mean", "higher_is_better": True}
                                           for m in ("acc", "acc_norm")]})
        (task_dir / f"{name}.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
        tasks.append(name)
    group = {"group": ORGANISM_MMLU, "task": tasks, "aggregate_metric_list": [{"metric": "acc", "weight_by_size": True}],
             "metadata": {"version": 1.0}}
    (task_dir / f"{ORGANISM_MMLU}.yaml").write_text(yaml.safe_dump(group, sort_keys=False))
    return ORGANISM_MMLU


def organism_gsm8k_task(test: list[dict], train: list[dict], task_dir: Path) -> str:
    """lm-eval's gsm8k with the organism's arithmetic set; few-shot: the first training items."""
    config = _lm_eval_task_yaml("gsm8k/gsm8k.yaml")
    files = {}
    for split, items in (("test", test), ("train", train)):
        files[split] = str((task_dir / f"{ORGANISM_GSM8K}.{split}.jsonl").resolve())
        atomic_write_jsonl(files[split], items)
    config.pop("tag", None)
    config.pop("dataset_name", None)
    config.update({"task": ORGANISM_GSM8K, "dataset_path": "json", "dataset_kwargs": {"data_files": files},
                   "fewshot_config": {"sampler": "first_n"}})
    (task_dir / f"{ORGANISM_GSM8K}.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    return ORGANISM_GSM8K


def model_args(endpoint: Endpoint, tokenizer_dir: Path, client: dict, max_length: int, seed: int) -> dict:
    return {"base_url": endpoint.base_url + "/v1/completions", "model": endpoint.model,
            "tokenizer_backend": "huggingface", "tokenizer": str(tokenizer_dir), "tokenized_requests": True,
            "num_concurrent": client["concurrency"], "batch_size": client["lm_eval_batch_size"],
            "max_retries": client["retries"] + 1,
            "timeout": int(client["timeout_s"]), "max_length": max_length, "seed": seed}


def evaluate(endpoint: Endpoint, tokenizer_dir: Path, task: str, include_path: Path | None, shots: int,
             limit: int | None, client: dict, max_length: int, seed: int, gen_kwargs: dict | None = None,
             usage: Usage | None = None) -> dict:
    """lm-eval's results; `usage` counts what its replies used."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    from moeshrink.evals import lm_eval_model

    lm_eval_model.register(LM_EVAL_MODEL)
    lm_eval_model.USAGE[0] = usage or Usage()

    os.environ["OPENAI_API_KEY"] = endpoint.api_key  # what local-completions sends as its bearer token
    # the organism's tasks are whole in their own folder: indexing lm-eval's thousands of others took 5.5 s
    manager = TaskManager(include_path=str(include_path), include_defaults=False) if include_path else TaskManager()
    try:
        results = lm_eval.simple_evaluate(
            model=LM_EVAL_MODEL, model_args=model_args(endpoint, tokenizer_dir, client, max_length, seed),
            tasks=[task], num_fewshot=shots, limit=limit, log_samples=True, task_manager=manager,
            gen_kwargs=gen_kwargs, random_seed=seed, numpy_random_seed=seed, torch_random_seed=seed,
            fewshot_random_seed=seed)
    except NonFiniteError as error:
        raise NonFiniteError(f"{endpoint.build}/{task}: {error}") from None
    except Exception as error:
        if not endpoint.alive():
            raise EndpointError(f"the vLLM server of build {endpoint.build!r} is gone (lm-eval: {type(error).__name__}: "
                                f"{error}); last lines of {endpoint.log}:\n{log_tail(endpoint.log, 50)}") from error
        raise
    if results is None:
        raise EvalError(f"lm-eval returned nothing for task {task}")
    return results


def _item_id(task: str, sample: dict) -> str:
    doc = sample["doc"]
    return str(doc["id"]) if isinstance(doc, dict) and "id" in doc else f"{task}/{sample['doc_id']}"


def mmlu_records(results: dict) -> list[dict]:
    records = []
    for task, samples in sorted(results["samples"].items()):
        for sample in sorted(samples, key=lambda s: s["doc_id"]):
            loglikelihoods = [float(resp[0]) for resp in sample["filtered_resps"]]
            predicted = max(range(len(loglikelihoods)), key=loglikelihoods.__getitem__)
            record = {"id": _item_id(task, sample), "task": task, "doc_id": sample["doc_id"],
                      "subject": sample["doc"].get("subject"), "answer": LETTERS[int(sample["target"])],
                      "predicted": LETTERS[predicted], "correct": bool(sample["acc"]),
                      "loglikelihoods": loglikelihoods, "doc_hash": sample["doc_hash"]}
            if "acc_norm" in sample:
                record["correct_norm"] = bool(sample["acc_norm"])
            records.append(record)
    return records


def mmlu_metrics(records: list[dict], results: dict, task: str) -> dict:
    """acc (the verdict's), and acc_norm where lm-eval computed it (cloze), each checked against lm-eval's."""
    metrics = {}
    for name, key, field in (("accuracy", "acc", "correct"), ("accuracy_norm", "acc_norm", "correct_norm")):
        if field not in records[0]:
            continue
        right = sum(r[field] for r in records)
        lm_eval_value = results["results"].get(task, {}).get(f"{key},none")
        if lm_eval_value is not None and not math.isclose(lm_eval_value, right / len(records), abs_tol=1e-9):
            raise EvalError(f"lm-eval's {key} {lm_eval_value} differs from its own samples' {right}/{len(records)}")
        metrics[name] = {**rate_with_ci(right, len(records)),
                         "lm_eval_stderr": results["results"].get(task, {}).get(f"{key}_stderr,none")}
    return metrics


def gsm8k_records(results: dict) -> list[dict]:
    by_doc: dict[tuple[str, int], dict] = {}
    for task, samples in sorted(results["samples"].items()):
        for sample in samples:
            record = by_doc.setdefault((task, sample["doc_id"]), {
                "id": _item_id(task, sample), "task": task, "doc_id": sample["doc_id"],
                "target": gsm8k_answer(sample["target"]), "reply": sample["resps"][0][0],
                "doc_hash": sample["doc_hash"]})
            record[sample["filter"]] = {"extracted": sample["filtered_resps"][0],
                                        "correct": bool(sample["exact_match"])}
    records = [by_doc[key] for key in sorted(by_doc)]
    for record in records:
        record["correct"] = record["strict-match"]["correct"]
    return records


def gsm8k_metrics(records: list[dict]) -> dict:
    return {"exact_match": rate_with_ci(sum(r["strict-match"]["correct"] for r in records), len(records)),
            "exact_match_flexible": rate_with_ci(sum(r["flexible-extract"]["correct"] for r in records), len(records))}
