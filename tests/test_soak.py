"""A soak test of a packed build served through the plugin: twx2_5 with the workflow's own server flags,
under the traffic the evals send, all kinds at once for a bounded time (loopback only): long
prompt-log-probability requests (the agreement eval's endpoint, top-400), seeded sampling beside
1,500-token prompts (tool calls at temperature 0.6 and plain completions), greedy generation (GSM8K's
form). It must answer every request, with finite log-probabilities everywhere and the same text to the
same greedy request every time, and the server's memory may grow by at most MEMORY_GROWTH_BOUND_MIB over
the second half of the soak; it prints requests per second and the memory curve. 60 s by default (CI);
MOESHRINK_SOAK_SECONDS runs it longer, up to 600. Runs on the end-to-end test's finished workflow."""
import itertools
import json
import math
import os
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import yaml

from moeshrink.evals.agreement import ENDPOINT, request
from moeshrink.organism import datasets
from moeshrink.serve.supervisor import server_args, server_env
from moeshrink.serve.vllm_server import VLLMServer
from moeshrink_kernels.vllm import logprobs_wire as wire

pytestmark = pytest.mark.slow
BUILD = "twx2_5"
SOAK_SECONDS = min(600.0, float(os.environ.get("MOESHRINK_SOAK_SECONDS", 60)))
CLIENTS = 8
# growth of the server's resident memory (all its processes) over the second half of the soak, when
# every kind of request has been served many times over; a leak of one agreement reply's log-probabilities
# per request (about 51,000 listed tokens, which vLLM holds as Python numbers) would pass it within a minute
MEMORY_GROWTH_BOUND_MIB = 64


def group_rss_mib(leader: int) -> float:
    """Resident memory of every process in the server's process group."""
    total_kib = 0
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if os.getpgid(int(proc.name)) != leader:
                continue
            status = (proc / "status").read_text()
        except (OSError, ProcessLookupError):
            continue
        total_kib += next((int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS:")), 0)
    return total_kib / 1024


def finite_logprobs(reply: dict) -> bool:
    values = []
    for choice in reply.get("choices", []):
        for position in (choice.get("prompt_logprobs") or [])[1:]:
            values += [entry["logprob"] for entry in position.values()]
        content = (choice.get("logprobs") or {}).get("content") or []
        values += [token["logprob"] for token in content]
        values += list((choice.get("logprobs") or {}).get("token_logprobs") or [])
    if "offsets" in reply:  # the agreement endpoint's arrays
        values += wire.decode(reply)[2].tolist()
    return all(v is not None and math.isfinite(v) for v in values)


def test_a_packed_build_under_mixed_load_answers_everything_finitely_and_the_same(workdir, tmp_path):
    from transformers import AutoTokenizer

    config = yaml.safe_load((workdir / "config.yaml").read_text())
    build = workdir / f"results/organism/builds/{BUILD}"
    data = workdir / "results/organism/organism/data"
    tokenizer = AutoTokenizer.from_pretrained(str(build))
    corpus = datasets.read_jsonl(data / datasets.CORPUS_FILE)
    stream = tokenizer(" ".join(d["text"] for d in corpus[:400]))["input_ids"]
    passages = [tokenizer(d["text"])["input_ids"][:128] for d in corpus[:40]]
    tools = json.loads((data / datasets.TOOLS_FILE).read_text())
    trials = datasets.read_jsonl(data / datasets.TOOLCALLS_TEST)[:20]
    arith = datasets.read_jsonl(data / datasets.ARITH_TEST)[:6]
    fewshot = datasets.read_jsonl(data / datasets.ARITH_TRAIN)[:5]
    context = "".join(f"Question: {q['question']}\nAnswer: {q['answer']}\n\n" for q in fewshot)

    def agreement(i: int) -> tuple[str, dict]:
        return ENDPOINT, request(BUILD, passages[i % len(passages)], 400)

    def seeded_long(i: int) -> tuple[str, dict]:
        start = (i * 37) % (len(stream) - 1500)
        return "/v1/completions", {"model": BUILD, "prompt": stream[start:start + 1500], "max_tokens": 8,
                                   "temperature": 0.6, "seed": i, "logprobs": 1}

    def toolcall(i: int) -> tuple[str, dict]:
        trial = trials[i % len(trials)]
        return "/v1/chat/completions", {"model": BUILD, "messages": trial["messages"], "tools": tools,
                                        "tool_choice": "auto", "reasoning_effort": ("low", "high")[i % 2],
                                        "temperature": 0.6, "top_p": 0.95, "max_tokens": 96, "seed": i,
                                        "logprobs": True}

    def greedy(i: int) -> tuple[str, dict]:
        item = arith[i % len(arith)]
        return "/v1/completions", {"model": BUILD, "prompt": context + f"Question: {item['question']}\nAnswer:",
                                   "max_tokens": 64, "temperature": 0, "stop": ["Question:"], "logprobs": 1}

    kinds = {"agreement": agreement, "seeded_long": seeded_long, "toolcall": toolcall, "greedy": greedy}
    serve = config["serve"]
    server = VLLMServer(build, tmp_path / "server.log", served_name=BUILD,
                        args=server_args(serve, kv_cache_bytes=1 << 30), env=server_env(cpu=True))
    failures: list[str] = []
    answers: dict[int, set[str]] = {}
    served: Counter = Counter()
    lock = threading.Lock()

    def send(kind: str, i: int) -> None:
        path, body = kinds[kind](i)
        status, reply = server.post(path, body)
        with lock:
            served[kind] += 1
            if status != 200:
                failures.append(f"{kind} #{i}: HTTP {status}: {str(reply)[:300]}")
            elif not finite_logprobs(reply):
                failures.append(f"{kind} #{i}: a non-finite log-probability")
            elif kind == "greedy":
                answers.setdefault(i % len(arith), set()).add(reply["choices"][0]["text"])

    with server:
        for kind in kinds:  # warm-up: one of each, alone
            send(kind, 0)
        memory = [(0.0, group_rss_mib(server.process.pid))]  # (seconds into the soak, MiB)
        started = time.time()
        counter = itertools.count(1)

        def client(slot: int) -> None:
            while time.time() - started < SOAK_SECONDS and not failures:
                i = next(counter)
                send(list(kinds)[(i + slot) % len(kinds)], i)

        with ThreadPoolExecutor(CLIENTS + 1) as pool:
            clients = [pool.submit(client, slot) for slot in range(CLIENTS)]
            while not all(c.done() for c in clients):
                time.sleep(5)
                memory.append((time.time() - started, group_rss_mib(server.process.pid)))
            for c in clients:
                c.result()
        seconds = time.time() - started
        alive = server.process.poll() is None

    total = sum(served.values())
    halfway = min(memory, key=lambda point: abs(point[0] - seconds / 2))
    print(f"\nsoak: {BUILD}, {total} requests in {seconds:.0f} s ({total / seconds:.2f} requests/s), "
          f"{dict(served)}; server memory (s, MiB): {[(round(t), round(m)) for t, m in memory]}")
    assert alive, "the server died under load"
    assert not failures, failures[:5]
    assert all(served[kind] >= 3 for kind in kinds), served
    assert all(len(texts) == 1 for texts in answers.values()), answers
    assert memory[-1][1] - halfway[1] <= MEMORY_GROWTH_BOUND_MIB, (halfway, memory[-1])
