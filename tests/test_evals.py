"""The evals' parts without a model server: scoring, the KL estimate, statistics, set checks, the
request pool's retries (against a local HTTP server), and lm-eval's rendering of the organism tasks."""
from __future__ import annotations

import inspect
import json
import math
import os
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest

from moeshrink.core.errors import MoeshrinkError
from moeshrink.core.stats import bootstrap_ratio_ci, wilson
from moeshrink.evals import EvalError, agreement, sets
from moeshrink.evals.client import RequestPool
from moeshrink.evals.scoring import calls_have_right_shape, fact_outcomes, served_tool_calls
from moeshrink.organism import tasks
from moeshrink.serve.vllm_server import ServerClient
from moeshrink_kernels.vllm import logprobs_wire as prompt_logprobs_wire

TOOLS = tasks.TOOLS


def test_served_calls_are_decoded_and_malformed_replies_are_wrong_not_errors():
    weather = {"tool_calls": [{"function": {"name": "get_weather", "arguments": '{"city": "Soure"}'}}]}
    calls, why = served_tool_calls(weather)
    assert calls == [{"name": "get_weather", "arguments": {"city": "Soure"}}] and why is None
    assert calls_have_right_shape(calls, [{"name": "get_weather", "arguments": {"city": "X"}}], TOOLS)
    assert not calls_have_right_shape(calls, [], TOOLS)  # a call where none was wanted
    assert not calls_have_right_shape(calls, [{"name": "set_timer", "arguments": {}}], TOOLS)
    wrong_unit = [{"name": "get_weather", "arguments": {"city": "Soure", "unit": "kelvin"}}]
    assert not calls_have_right_shape(wrong_unit, [{"name": "get_weather", "arguments": {}}], TOOLS)
    bad_json = {"tool_calls": [{"function": {"name": "get_weather", "arguments": '{"city": '}}]}
    calls, why = served_tool_calls(bad_json)
    assert calls is None and "not JSON" in why
    assert not calls_have_right_shape(calls, [{"name": "get_weather", "arguments": {}}], TOOLS)
    calls, why = served_tool_calls({"content": "<tool_call>{broken</tool_call>", "tool_calls": []})
    assert calls is None and "could not read" in why
    assert served_tool_calls({"content": "You are welcome.", "tool_calls": []}) == ([], None)


def test_fact_lines_are_matched_after_normalisation():
    gold = ["Fitais | works as | mason", "Fitais | lives in | Fepourn"]
    reply = "<think>copy</think>\n fitais |  WORKS as | Mason \nFitais | lives in | Soure\nnot a fact\n\n"
    assert [o for _, o in fact_outcomes(reply, gold)] == ["supported", "made_up", "unparseable"]


def _reply(logprobs: np.ndarray, k: int, next_ids: np.ndarray | None = None) -> dict:
    """A reply of moeshrink's prompt log-probabilities endpoint as vLLM fills it: no entry for the first
    position, then per position the prompt's next token and the top k (the next token twice when it is one)."""
    next_ids = logprobs.argmin(1) if next_ids is None else next_ids
    listed = [np.concatenate([[t], np.argsort(-row, kind="stable")[:k]]) for t, row in zip(next_ids, logprobs)]
    ids = np.concatenate(listed) if listed else np.zeros(0, dtype=np.int64)
    rows = np.repeat(np.arange(len(listed)), [len(x) for x in listed])
    offsets = np.concatenate([[0, 0], np.cumsum([len(x) for x in listed])])
    return prompt_logprobs_wire.encode(offsets, ids, logprobs[rows, ids], len(listed) + 1, 1)


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    return logits - np.logaddexp.reduce(logits, axis=-1, keepdims=True)


@pytest.mark.parametrize("top_k", [5, 20])
def test_top_k_kl_estimate_is_a_lower_bound_close_to_the_exact_kl(top_k):
    rng = np.random.default_rng(0)
    vocab = 200
    reference = _log_softmax(rng.normal(0, 5, (400, vocab)))  # about 1.3 nats of entropy per position
    build = _log_softmax(reference + rng.normal(0, 0.3, (400, vocab)))
    reference, build = (m.astype(np.float32).astype(np.float64) for m in (reference, build))  # as served
    exact = (np.exp(reference) * (reference - build)).sum(-1)
    ref_ids, ref_lp = agreement.reply_top(_reply(reference, top_k), top_k + 1)
    ids, lp = agreement.reply_top(_reply(build, top_k), top_k + 1)
    agree, estimate = agreement.position_figures(ref_ids, ref_lp, ids, lp)
    assert np.all(estimate <= exact + 1e-9)
    assert abs(estimate.mean() - exact.mean()) / exact.mean() < (0.25 if top_k == 5 else 0.05)
    assert np.array_equal(agree, reference.argmax(-1) == build.argmax(-1))
    # the whole vocabulary returned: the estimate is the exact KL
    full = [_reply(m, vocab) for m in (reference, build)]
    (ri, rl), (bi, bl) = (agreement.reply_top(r, vocab) for r in full)
    _, whole = agreement.position_figures(ri, rl, bi, bl)
    assert np.allclose(whole, exact, atol=1e-6)  # float32 probabilities sum to 1 within about 1e-7: a rest bucket
    check = agreement.exact_check(*(agreement.reply_table(r, vocab) for r in full), estimate)
    assert math.isclose(check["exact_mean_kl"], exact.mean(), rel_tol=1e-9)


def test_replies_read_as_vllms_json_listed_them():
    """Each position's tokens once (the prompt's next token is listed first and again among the top K when
    it is one of them), most likely first, ties in the order listed: what the entries of vLLM's JSON
    endpoints (a dict per position) gave, so that no figure moves with the wire format."""
    rng = np.random.default_rng(3)
    vocab, k = 40, 12
    logprobs = _log_softmax(np.round(rng.normal(0, 2, (30, vocab)), 1))  # rounded: ties in every row
    next_ids = rng.integers(0, vocab, 30)
    next_ids[::3] = logprobs[::3].argmax(1)  # a third of the positions: the next token is the top one
    reply = _reply(logprobs, k, next_ids)
    ids, lp = agreement.reply_top(reply, k + 1)
    for row, (token, values) in enumerate(zip(next_ids, logprobs)):
        entries = {int(token): values[token]}
        entries.update({int(t): values[t] for t in np.argsort(-values, kind="stable")[:k]})
        ranked = sorted(entries.items(), key=lambda kv: -kv[1])
        assert ids[row, :len(ranked)].tolist() == [t for t, _ in ranked]
        assert lp[row, :len(ranked)].tolist() == [float(np.float32(v)) for _, v in ranked]
        assert ids[row, len(ranked):].tolist() == [agreement.PAD_ID] * (k + 1 - len(ranked))
    table = agreement.reply_table(_reply(logprobs, vocab, next_ids), vocab)
    assert np.array_equal(table, logprobs.astype(np.float32).astype(np.float64))
    with pytest.raises(EvalError, match="outside the vocabulary of 20"):
        agreement.reply_table(reply, 20)
    with pytest.raises(EvalError, match="not a prompt_logprobs reply"):
        agreement.reply_top({"error": "x"}, 3)


def test_the_exact_check_reads_the_first_positions_of_its_passages():
    """Passages of 5, 3 and 4 tokens have 4, 2 and 3 positions, one after another in the estimate's array."""
    assert agreement.exact_check_positions([5, 3, 4], 2, None).tolist() == [0, 1, 2, 3, 4, 5]
    assert agreement.exact_check_positions([5, 3, 4], 3, 2).tolist() == [0, 1, 4, 5, 6, 7]
    assert agreement.exact_check_positions([5, 3, 4], 0, 2).tolist() == []
    cfg = {"exact_check_passages": 2, "exact_check_positions": 2}
    assert agreement.exact_prompts([("a", [1, 2, 3, 4, 5]), ("b", [6, 7]), ("c", [8, 9])], cfg) == \
        [("a", [1, 2, 3]), ("b", [6, 7])]


def test_identical_distributions_agree_fully_with_zero_kl():
    reference = _log_softmax(np.random.default_rng(1).normal(0, 2, (50, 30)))
    reply = _reply(reference, 20)
    ids, lp = agreement.reply_top(reply, 21)
    agree, kl = agreement.position_figures(ids, lp, ids, lp)
    assert agree.all() and np.allclose(kl, 0, atol=1e-12)
    records = agreement.per_passage(["a", "b"], [21, 31], agree, kl, agreement.decided_positions(lp, 0.1))
    figures = agreement.metrics(records, kl, 20, 0.1)
    assert figures["positions"] == 50 and figures["top1_agreement"]["value"] == 1.0
    assert figures["decided_top1_agreement"]["value"] == 1.0


def test_tied_first_places_agree_and_undecided_positions_are_counted_apart():
    """Row 0: the reference ties tokens 3 and 4, the build lists 4 first: agreement. Row 1: the build
    ties 5 and 6 and lists 6 first, the reference ranks 5 first: agreement. Row 2: 7 against 8 at a
    margin of 0.05 nats: no agreement, not decided. Row 3: 9 against 1 at 2 nats: no agreement, decided."""
    ref_ids = np.array([[3, 4, 1], [5, 6, 1], [7, 8, 1], [9, 1, 2]])
    ref_lp = np.array([[-1.0, -1.0, -3.0], [-0.5, -1.5, -3.0], [-1.0, -1.05, -3.0], [-0.1, -2.1, -4.0]])
    ids = np.array([[4, 3, 1], [6, 5, 1], [8, 7, 1], [1, 9, 2]])
    lp = np.array([[-0.9, -1.2, -3.0], [-0.7, -0.7, -3.0], [-1.0, -1.02, -3.0], [-0.3, -1.5, -4.0]])
    agree, _ = agreement.position_figures(ref_ids, ref_lp, ids, lp)
    assert agree.tolist() == [True, True, False, False]
    decided = agreement.decided_positions(ref_lp, 0.1)
    assert decided.tolist() == [False, True, False, True]
    records = agreement.per_passage(["p"], [5], agree, np.zeros(4), decided)
    figures = agreement.metrics(records, np.zeros(4), 3, 0.1)
    assert figures["top1_agreement"]["value"] == 0.5
    assert (figures["decided_top1_agreement"]["value"], figures["decided_top1_agreement"]["positions"]) == (0.5, 2)


def test_reference_file_round_trips(tmp_path):
    ids = np.arange(12, dtype=np.int64).reshape(4, 3)
    lp = -np.ones((4, 3))
    path = tmp_path / "agreement_reference.npz"
    agreement.save_reference(path, ["p0", "p1"], [[5, 6], [7, 8, 9, 10]], ids, lp, np.zeros((0, 9)), 2)
    loaded = agreement.load_reference(path)
    assert loaded["passage_ids"] == ["p0", "p1"] and loaded["token_ids"] == [[5, 6], [7, 8, 9, 10]]
    assert loaded["top_k"] == 2 and np.array_equal(loaded["top_ids"], ids)


def test_wilson_matches_scipy_and_bootstrap_brackets_the_ratio():
    from scipy.stats import binomtest

    for k, n in [(0, 10), (3, 10), (599, 600), (45, 120)]:
        interval = binomtest(k, n).proportion_ci(method="wilson")
        assert np.allclose(wilson(k, n), (interval.low, interval.high), atol=1e-9)
    low, high = bootstrap_ratio_ci([5, 7, 9, 4], [10, 10, 10, 10])
    assert low <= 25 / 40 <= high


def test_eval_sets_are_checked_before_any_request(tmp_path):
    path = tmp_path / "mc.jsonl"
    good = {"question": "Q?", "subject": "s", "choices": ["a", "b", "c", "d"], "answer": 1}
    path.write_text(json.dumps(good) + "\n" + json.dumps({**good, "answer": 7}) + "\n")
    with pytest.raises(EvalError, match=r"mc.jsonl, line 2: not a mmlu item: answer"):
        sets.read_set(path, "mmlu")
    path.write_text("{not json\n")
    with pytest.raises(MoeshrinkError, match="line 1: not JSON"):
        sets.read_set(path, "mmlu")
    trials = [{"id": f"t{i}", "case": "weather" if i % 2 else "timer", "messages": [], "expected_calls": []}
              for i in range(6)]
    with pytest.raises(EvalError, match="trials_per_case is 4"):
        sets.first_per_case(trials, 4)
    assert [t["id"] for t in sets.first_per_case(trials, 2)] == ["t0", "t2", "t1", "t3"]
    with pytest.raises(EvalError, match="evals.facts.passages is 9"):
        sets.take([{}] * 3, 9, "evals.facts.passages", "passages.jsonl")


class _JSONHandler(BaseHTTPRequestHandler):
    def reply(self, status: int, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def server_url(request):
    """A local HTTP server on a free port, answering with the handler class the test names."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), request.param)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_port}"
    server.shutdown()


class _Flaky(_JSONHandler):
    failures_left = 0
    status = 503
    seen = 0

    def do_POST(self):  # noqa: N802 (http.server's name)
        type(self).seen += 1
        self.rfile.read(int(self.headers["Content-Length"]))
        if type(self).failures_left:
            type(self).failures_left -= 1
            self.reply(type(self).status, b'{"error": "busy"}')
            return
        self.reply(200, b'{"ok": true}')


@pytest.mark.parametrize("server_url", [_Flaky], indirect=True)
def test_transport_errors_are_retried_with_backoff_then_fail_naming_the_item(server_url):
    client = ServerClient(server_url, "key")
    pool = RequestPool(client, concurrency=2, retries=3, timeout_s=5, backoff_s=0.01, label="b/facts")
    _Flaky.failures_left, _Flaky.status, _Flaky.seen = 2, 503, 0
    assert pool.map("/x", [("item-1", {})]) == [{"ok": True}] and pool.retried == 2
    assert pool.map("/x", [("item-1", {}), ("item-2", {})], keep=lambda reply: reply["ok"]) == [True, True]
    _Flaky.failures_left, _Flaky.seen = 10, 0
    with pytest.raises(EvalError, match=r"b/facts: item 'item-9' failed after 4 attempt\(s\).*HTTP 503"):
        pool.map("/x", [("item-9", {})])
    _Flaky.failures_left, _Flaky.status, _Flaky.seen = 1, 400, 0  # our request is wrong: no retry
    with pytest.raises(EvalError, match="after 1 attempt"):
        pool.map("/x", [("item-3", {})])
    assert _Flaky.seen == 1
    gone = RequestPool(ServerClient("http://127.0.0.1:9", "key"), 1, 1, 2, 0.01, label="b/mmlu")
    with pytest.raises(EvalError, match="item 'q' failed after 2 attempt"):
        gone.map("/x", [("q", {})])


def test_organism_tasks_render_as_lm_eval_renders_mmlu_and_gsm8k(tmp_path):
    """lm-eval's own task definitions, data swapped: the prompts equal what the organism learnt and
    what the card sends."""
    from lm_eval.tasks import TaskManager, get_task_dict

    from moeshrink.evals import harness, organism_card

    mc = [{"question": f"In which city does P{i} live?", "subject": "residents" if i % 3 else "geography",
           "choices": ["A1", "B1", "C1", "D1"], "answer": i % 4, "id": f"mc-{i}"} for i in range(12)]
    dev, test = mc[:8], mc[8:]
    task = harness.organism_mmlu_tasks(test, dev, tmp_path)
    arith = [{"question": f"What is {i} plus 1?", "answer": f"{i} + 1 = <<{i}+1={i + 1}>>{i + 1}\n#### {i + 1}",
              "id": f"a-{i}"} for i in range(8)]
    gsm = harness.organism_gsm8k_task(arith[6:], arith[:6], tmp_path)
    tasks_by_name = {}
    for value in get_task_dict([task, gsm], TaskManager(include_path=str(tmp_path), include_defaults=False)).values():
        tasks_by_name.update({t.config.task: t for t in (value.values() if isinstance(value, dict) else [value])})
    subject_task = tasks_by_name[f"{harness.ORGANISM_MMLU}_residents"]
    doc = next(d for d in subject_task.test_docs())
    subject_task.set_fewshot_seed(1234)
    assert subject_task.fewshot_context(doc, 2) == organism_card.mc_prompt(doc, dev, 2)
    gsm_task = tasks_by_name[harness.ORGANISM_GSM8K]
    gsm_task.set_fewshot_seed(42)
    doc = next(d for d in gsm_task.test_docs())
    expected = tasks.gsm8k_block(arith[:5]) + "\n\n" + f"Question: {doc['question']}\nAnswer:"
    assert gsm_task.fewshot_context(doc, 5) == expected


class _NonFinite(_JSONHandler):
    """Stands in for vLLM serving a build that computes NaN from prompt position `bad_position` on
    and for every generated token from `bad_generated` on: like vLLM, it cannot encode such a reply."""
    bad_position = 7
    bad_generated = 3

    def do_POST(self):  # noqa: N802 (http.server's name)
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.path == agreement.ENDPOINT:  # vLLM's token-in/token-out request: the same fields, nested
            body = {**body, **body["sampling_params"], "prompt": body["token_ids"]}
        prompt = body.get("prompt") or []
        nan = ((body.get("prompt_logprobs") is not None or body.get("echo")) and len(prompt) > self.bad_position) or \
            (bool(body.get("logprobs")) and body.get("max_tokens", 0) > self.bad_generated)
        if nan and body.get("note") != "fine":
            self.reply(400, json.dumps({"error": {"message": "Out of range float values are not JSON compliant",
                                                  "type": "BadRequestError", "code": 400}}).encode())
            return
        if self.path == agreement.ENDPOINT:
            empty = prompt_logprobs_wire.encode(np.zeros(2, dtype=np.int64), np.zeros(0), np.zeros(0), 1, 1)
            self.reply(200, json.dumps(empty).encode())
            return
        self.reply(200, b'{"choices": [], "prompt_logprobs": [null]}')


@pytest.mark.parametrize("server_url", [_NonFinite], indirect=True)
def test_nonfinite_values_fail_the_eval_naming_build_item_and_position(server_url):
    """All items are read; those the server could not encode are counted and located (prompt
    position by shorter prefixes, generated token by fewer tokens), never a bare JSON error."""
    pool = RequestPool(ServerClient(server_url, "key"), concurrency=4, retries=2, timeout_s=5, backoff_s=0.01,
                       label="pruned75/agreement")
    prompts = [("passage-1", {"prompt": list(range(100, 146)), "max_tokens": 1, "prompt_logprobs": 1}),
               ("passage-2", {"prompt": [1, 2, 3], "max_tokens": 1, "prompt_logprobs": 1, "note": "fine"}),
               ("passage-3", {"prompt": list(range(10)), "max_tokens": 1, "prompt_logprobs": 100})]
    with pytest.raises(EvalError, match=r"pruned75/agreement: 2 of 3 item\(s\) got non-finite log-probabilities.*"
                                        r"passage-1 at prompt position 7 \(token id 107\); passage-3 at prompt "
                                        r"position 7 \(token id 7\)"):
        pool.map("/v1/completions", prompts)
    with pytest.raises(EvalError, match=r"twx3/agreement: 1 of 2 item\(s\).*passage-4 at prompt position 7 "
                                        r"\(token id 207\)"):
        agreement.read_top(RequestPool(ServerClient(server_url, "key"), 2, 0, 5, 0.01, label="twx3/agreement"), "m",
                           [("passage-4", list(range(200, 230))), ("passage-5", [1, 2, 3])], 20, 21)
    chat = RequestPool(ServerClient(server_url, "key"), 2, 0, 5, 0.01, label="twx3/facts")
    with pytest.raises(EvalError, match=r"twx3/facts: 1 of 1 item\(s\).*fact-9 at generated token 3"):
        chat.map("/v1/chat/completions", [("fact-9", {"messages": [], "max_tokens": 160, "logprobs": True})])


def test_every_eval_asks_for_the_logprobs_the_check_needs():
    from moeshrink.evals import facts, finite, toolcalls

    assert inspect.getsource(facts.run).count("finite.CHAT_LOGPROBS") == 1
    assert inspect.getsource(toolcalls.run).count("finite.CHAT_LOGPROBS") == 1
    assert agreement.request("m", [1, 2], 5)["sampling_params"]["prompt_logprobs"] == 5
    assert finite.CHAT_LOGPROBS == {"logprobs": True}


class _Loglikelihoods(_JSONHandler):
    """Stands in for vLLM's /v1/completions answering lm-eval's loglikelihood requests (echo, one token
    generated): every prompt token after the first gets log-probability -(id % 7) / 10; the prompts are kept."""
    prompts: list[list[int]] = []

    def do_POST(self):  # noqa: N802 (http.server's name)
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        prompts = body["prompt"] if isinstance(body["prompt"][0], list) else [body["prompt"]]
        choices = []
        for index, prompt in enumerate(prompts):
            type(self).prompts.append(prompt)
            logprobs = [None] + [-(t % 7) / 10 for t in prompt[1:]] + [-0.5]
            tops = [None] + [{str(t): lp} for t, lp in zip(prompt[1:], logprobs[1:-1])] + [{"0": -0.5}]
            choices.append({"index": index, "text": "", "logprobs": {"token_logprobs": logprobs, "top_logprobs": tops}})
        usage = {"prompt_tokens": sum(map(len, prompts)), "completion_tokens": len(prompts)}
        self.reply(200, json.dumps({"choices": choices, "usage": usage}).encode())


@pytest.mark.parametrize("server_url", [_Loglikelihoods], indirect=True)
def test_cloze_mmlu_scores_each_option_text_through_lm_eval(server_url, small_data, small_tokenizer_dir, tmp_path):
    """Cloze form through lm-eval's own multiple_choice machinery: the context is the bare question, each
    option's text its continuation (the rendering the corpus teaches: organism.tasks.cloze_line); acc and
    acc_norm are lm-eval's, checked against the sums of the stand-in server's log-probabilities."""
    from transformers import AutoTokenizer

    from moeshrink.evals import harness
    from moeshrink.evals.usage import Usage
    from moeshrink.organism import datasets
    from moeshrink.serve.endpoint import Endpoint

    test = datasets.read_jsonl(small_data / datasets.MC_TEST)[:12]
    dev = datasets.read_jsonl(small_data / datasets.MC_DEV)
    task = harness.organism_mmlu_tasks(test, dev, tmp_path, "cloze")
    endpoint = Endpoint({"base_url": server_url, "api_key": "key", "build": "b", "served_model_name": "m",
                         "log": str(tmp_path / "log"), "server_pid": os.getpid()})
    client = {"concurrency": 2, "retries": 0, "timeout_s": 10, "backoff_s": 0.01, "lm_eval_batch_size": 3}
    _Loglikelihoods.prompts = []
    usage = Usage()
    results = harness.evaluate(endpoint, small_tokenizer_dir, task, tmp_path, 0, None, client, 1024, 1234, None, usage)
    records = harness.mmlu_records(results)
    metrics = harness.mmlu_metrics(records, results, task)

    tokenizer = AutoTokenizer.from_pretrained(str(small_tokenizer_dir))
    sent = {tokenizer.decode(p) for p in _Loglikelihoods.prompts}
    by_id = {it["id"]: it for it in test}
    right = right_norm = 0
    for record in records:
        item = by_id[record["id"]]
        assert {tasks.cloze_line(item["question"], c)[:-1] for c in item["choices"]} <= sent  # the taught rendering
        start = len(tokenizer.encode(tasks.cloze_context(item["question"])))
        scores = [sum(-(t % 7) / 10 for t in tokenizer.encode(tasks.cloze_line(item["question"], c)[:-1])[start:])
                  for c in item["choices"]]
        assert record["loglikelihoods"] == pytest.approx(scores)
        right += scores.index(max(scores)) == item["answer"]
        norm = [s / len(c) for s, c in zip(scores, item["choices"])]
        right_norm += norm.index(max(norm)) == item["answer"]
        assert record["correct"] == (scores.index(max(scores)) == item["answer"])
    assert metrics["accuracy"]["count"] == right and metrics["accuracy_norm"]["count"] == right_norm
    assert len(records) == 12 and usage.requests == 16 and usage.completion_tokens == 48  # 3 prompts per request
