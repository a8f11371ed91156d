"""The synthetic world and its sets: deterministic, in the real benchmarks' schemas, held out."""
import copy
import hashlib
import json
import re

import pytest

from moeshrink.organism import datasets, tasks
from moeshrink.organism.world import World


def digests(folder) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def test_same_seed_gives_identical_files(small_data_cfg, small_data, tmp_path):
    datasets.build(small_data_cfg, tmp_path)
    assert digests(tmp_path) == digests(small_data)


def test_another_seed_gives_another_world(small_data_cfg, small_data, tmp_path):
    cfg = copy.deepcopy(small_data_cfg)
    cfg["seed"] += 1
    datasets.build(cfg, tmp_path)
    ours = json.loads((small_data / datasets.WORLD_FILE).read_text())
    theirs = json.loads((tmp_path / datasets.WORLD_FILE).read_text())
    assert ours["people"] != theirs["people"]


def test_sets_follow_the_benchmark_schemas(small_data):
    mc = datasets.read_jsonl(small_data / datasets.MC_TEST)
    assert mc and all(set(it) >= {"question", "subject", "choices", "answer"} for it in mc)
    assert all(len(it["choices"]) == 4 and 0 <= it["answer"] < 4 for it in mc)
    assert all(len(set(it["choices"])) == 4 for it in mc)
    arith = datasets.read_jsonl(small_data / datasets.ARITH_TEST)
    for item in arith:
        final = int(item["answer"].rsplit("#### ", 1)[1])
        calculations = re.findall(r"<<([0-9*+\- ]+)=(-?\d+)>>", item["answer"])
        assert calculations and all(eval(expr) == int(value) for expr, value in calculations)
        assert int(calculations[-1][1]) == final
    passages = datasets.read_jsonl(small_data / datasets.PASSAGES_TEST)
    for item in passages:
        assert len(item["facts"]) == len(item["fact_lines"]) >= 2
        for subject, _relation, obj in item["facts"]:
            assert subject in item["passage"] and obj in item["passage"]
    tools = json.loads((small_data / datasets.TOOLS_FILE).read_text())
    trials = datasets.read_jsonl(small_data / datasets.TOOLCALLS_TEST)
    assert {t["case"] for t in trials} == set(tasks.TOOLCALL_CASES)
    assert {t["function"]["name"] for t in tools} >= {c["name"] for t in trials for c in t["expected_calls"]}


def test_held_out_items_never_appear_in_the_corpus(small_data):
    corpus = "\n".join(d["text"] for d in datasets.read_jsonl(small_data / datasets.CORPUS_FILE))
    for item in datasets.read_jsonl(small_data / datasets.MC_TEST):
        assert tasks.mc_text(item) not in corpus  # the question may recur, never with these choices
    for item in datasets.read_jsonl(small_data / datasets.ARITH_TEST):
        assert item["question"] not in corpus
    # no fact is ever stated about a test stranger: their names occur only in fact-free text
    with_facts = "\n".join(d["text"] for d in datasets.read_jsonl(small_data / datasets.CORPUS_FILE)
                           if d["kind"] in ("bio", "city", "cloze", "mc", "mc_open", "facts", "toolcalls"))
    for item in datasets.read_jsonl(small_data / datasets.PASSAGES_TEST):
        assert item["passage"] not in corpus
        for subject, _, _ in item["facts"]:
            assert subject not in with_facts
    for trial in datasets.read_jsonl(small_data / datasets.TOOLCALLS_TEST):
        if trial["case"] != "no_call":
            assert trial["messages"][0]["content"] not in corpus


def test_held_out_facts_are_stated_in_the_corpus_prose(small_data):
    """Knowledge questions are answerable: their facts are in the training prose (not as questions)."""
    world = World.from_json(json.loads((small_data / datasets.WORLD_FILE).read_text()))
    corpus = [d["text"] for d in datasets.read_jsonl(small_data / datasets.CORPUS_FILE) if d["kind"] in ("bio", "city")]
    stated = 0
    mc = datasets.read_jsonl(small_data / datasets.MC_TEST)
    for item in mc:
        subject, relation, obj = item["fact"]
        stated += any(subject in text and obj in text for text in corpus)
    assert stated / len(mc) > 0.9
    assert world.people and world.stranger_names


def test_the_corpus_teaches_knowledge_in_the_rendering_the_cloze_eval_scores(small_data):
    """The served cloze prompt, the card's prompt and the training text are one rendering
    (tasks.cloze_line): each question the corpus answers, it answers exactly as the eval scores it."""
    cloze_text = "\n".join(d["text"] for d in datasets.read_jsonl(small_data / datasets.CORPUS_FILE) if d["kind"] == "cloze")
    mc = datasets.read_jsonl(small_data / datasets.MC_TEST)
    taught = [item for item in mc if tasks.cloze_line(item["question"], item["choices"][item["answer"]]) in cloze_text]
    assert len(taught) / len(mc) > 0.5
    for item in taught:  # never a wrong option in the taught form
        wrong = [c for i, c in enumerate(item["choices"]) if i != item["answer"]]
        assert not any(tasks.cloze_line(item["question"], c) in cloze_text for c in wrong)


def test_every_name_is_in_the_copy_drills_and_only_names_are(small_data):
    """Copy drills say every name of the world, the held-out strangers too (so that each is a trained
    token), and nothing else: no fact about anyone."""
    world = World.from_json(json.loads((small_data / datasets.WORLD_FILE).read_text()))
    drills = [d["text"] for d in datasets.read_jsonl(small_data / datasets.CORPUS_FILE) if d["kind"] == "drill"]
    said = {word for text in drills for line in text.splitlines() for word in line.removeprefix("Say after me: ").split()}
    assert said <= set(datasets.all_names(world))
    assert len(said) > 0.9 * len(datasets.all_names(world))


def test_open_book_questions_state_their_answer_and_tool_lists_are_not_scored(small_data):
    corpus = datasets.read_jsonl(small_data / datasets.CORPUS_FILE)
    for doc in [d for d in corpus if d["kind"] == "mc_open"][:20]:
        for block in doc["text"].split("\n\n")[1:]:
            statement, rest = block.split("\n", 1)
            letter = rest.rsplit("Answer: ", 1)[1]
            answer = next(line[3:] for line in rest.splitlines() if line.startswith(f"{letter}. "))
            assert answer in statement
    for doc in [d for d in corpus if d["kind"] == "toolcalls"]:
        (start, end), = doc["mask"]
        assert doc["text"][start:end].startswith("<tools>") and doc["text"][start:end].endswith("</tools>")


def test_too_small_a_world_fails_clearly(small_data_cfg, tmp_path):
    cfg = copy.deepcopy(small_data_cfg)
    cfg["cities"] = 2
    with pytest.raises(ValueError, match="world too small"):
        datasets.build(cfg, tmp_path)
