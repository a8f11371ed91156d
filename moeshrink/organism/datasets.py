"""Write the organism's world, training corpus and held-out eval sets from one config subtree.

Held-out items never appear in the corpus: a multiple-choice item's choices never occur with its
question in training (the fact itself is stated there, in prose and in other questions),
arithmetic questions are drawn apart from the training ones, and passages and tool-call trials are
about strangers of whom the corpus states no fact (their names occur only in fact-free text).
"""
from __future__ import annotations

import random
from importlib import resources
from pathlib import Path

from moeshrink.core.ioutil import atomic_write_json, atomic_write_jsonl, read_jsonl
from moeshrink.organism import OrganismError, tasks
from moeshrink.organism.world import World, generate_world

# File names inside the data folder; the eval stages read these.
WORLD_FILE = "world.json"
CORPUS_FILE = "corpus.jsonl"
POLISH_CORPUS_FILE = "corpus_polish.jsonl"  # the second training phase's documents (train.polish); empty without one
MC_TEST, MC_DEV = "mc_test.jsonl", "mc_dev.jsonl"
ARITH_TEST, ARITH_TRAIN = "arith_test.jsonl", "arith_train.jsonl"
PASSAGES_TEST = "passages_test.jsonl"
TOOLS_FILE, TOOLCALLS_TEST = "tools.json", "toolcalls_test.jsonl"
EFFORTS_IN_TRAINING = [None, "low", "high"]


def chat_template() -> str:
    return resources.files("moeshrink.organism").joinpath("chat_template.jinja").read_text()


def render_chat(messages: list[dict], tools: list[dict] | None = None, effort: str | None = None,
                add_generation_prompt: bool = False) -> str:
    """Render with transformers' own chat-template renderer, as vLLM does when serving."""
    from transformers.utils.chat_template_utils import render_jinja_template

    kwargs = {"reasoning_effort": effort} if effort else {}
    rendered, _ = render_jinja_template(conversations=[messages], tools=tools, chat_template=chat_template(),
                                        add_generation_prompt=add_generation_prompt, **kwargs)
    return rendered[0]


# The tokenizer learns its merges from these kinds of document plus `template_texts()`. Every name
# (people, cities, strangers) is frequent in them, so each becomes one token, and no fact about a
# stranger is among them.
TOKENIZER_KINDS = ("bio", "city", "cloze", "mc", "arith", "drill")


def template_texts() -> list[str]:
    """The fixed text of chat prompts (tool list, instructions), without any stranger in it."""
    fixed = [{"role": "user", "content": tasks.FACTS_INSTRUCTION + "\n\nPassage: "}]
    return [render_chat(fixed, tools=tasks.TOOLS, effort=effort, add_generation_prompt=True)
            for effort in EFFORTS_IN_TRAINING] * 50


def tokenizer_texts(corpus_path: Path) -> list[str]:
    return [d["text"] for d in read_jsonl(corpus_path) if d["kind"] in TOKENIZER_KINDS] + template_texts()


def build(cfg: dict, out_dir: Path) -> dict:
    """Generate everything under `out_dir`; returns counts for the provenance record."""
    world = generate_world(cfg["seed"], people=cfg["people"], cities=cfg["cities"], regions=cfg["regions"],
                           rivers=cfg["rivers"], strangers=cfg["strangers"])
    rng = random.Random(cfg["seed"] + 1)
    facts = tasks.world_facts(world)
    half = len(world.stranger_names) // 2
    train_strangers, test_strangers = world.stranger_names[:half], world.stranger_names[half:]
    sets = cfg["sets"]

    # Knowledge questions: every fact is stated in the corpus (in prose and in other questions);
    # a test item's choices and their order never occur in training.
    test_facts = facts if sets["mc_test"] is None else random.Random(cfg["seed"] + 2).sample(facts, sets["mc_test"])
    mc_test = [tasks.mc_item(world, f, rng) for f in test_facts]
    test_keys = {mc_key(it) for it in mc_test}
    mc_dev = []
    dev_rng = random.Random(cfg["seed"] + 6)
    for subject in sorted({it["subject"] for it in mc_test}):
        subject_facts = [f for f in facts if tasks.SUBJECT_OF_RELATION[f[1]] == subject]
        mc_dev += list(tasks.unique_items(lambda r: tasks.mc_item(world, r.choice(subject_facts), r), dev_rng, 5,
                                          key=mc_key, exclude=test_keys))

    arith_test = list(tasks.unique_items(lambda r: tasks.arithmetic_item(world, r), random.Random(cfg["seed"] + 3),
                                         sets["arith_test"], key=lambda it: it["question"]))
    test_questions = {it["question"] for it in arith_test}
    arith_pool = list(tasks.unique_items(lambda r: tasks.arithmetic_item(world, r), random.Random(cfg["seed"] + 4),
                                         sets["arith_train"], key=lambda it: it["question"], exclude=test_questions))

    test_world = _with_strangers(world, test_strangers)
    train_world = _with_strangers(world, train_strangers)
    passages_test = [tasks.passage_item(test_world, rng) for _ in range(sets["passages_test"])]
    trials_per_case = sets["toolcall_trials_per_case"]
    toolcalls_test = []
    for case in tasks.TOOLCALL_CASES:
        make = lambda r, case=case: tasks.toolcall_item(test_world, case, r)  # noqa: E731
        # The no-call case has few distinct requests by design: its trials may repeat.
        if case == "no_call":
            toolcalls_test += [make(rng) for _ in range(trials_per_case)]
        else:
            toolcalls_test += list(tasks.unique_items(make, rng, trials_per_case,
                                                      key=lambda it: it["messages"][0]["content"]))
    for i, item in enumerate(toolcalls_test):
        item["id"] = f"{item['case']}-{i}"
    test_requests = {it["messages"][0]["content"] for it in toolcalls_test if it["case"] != "no_call"}

    corpus = _corpus(cfg["corpus"], world, train_world, facts, test_keys, test_questions, test_requests,
                     random.Random(cfg["seed"] + 5))
    polish_counts = cfg.get("polish_corpus")
    polish_corpus = [] if not polish_counts else _corpus(
        {**POLISH_DEFAULTS, **polish_counts}, world, train_world, facts, test_keys, test_questions, test_requests,
        random.Random(cfg["seed"] + 8))

    out_dir.mkdir(parents=True, exist_ok=True)
    for i, it in enumerate(mc_test):
        it["id"] = f"mc-{i}"
    for i, it in enumerate(arith_test):
        it["id"] = f"arith-{i}"
    for i, it in enumerate(passages_test):
        it["id"] = f"passage-{i}"
    atomic_write_json(out_dir / WORLD_FILE, world.to_json())
    atomic_write_jsonl(out_dir / MC_TEST, mc_test)
    atomic_write_jsonl(out_dir / MC_DEV, mc_dev)
    atomic_write_jsonl(out_dir / ARITH_TEST, arith_test)
    atomic_write_jsonl(out_dir / ARITH_TRAIN, arith_pool)
    atomic_write_jsonl(out_dir / PASSAGES_TEST, passages_test)
    atomic_write_json(out_dir / TOOLS_FILE, tasks.TOOLS)
    atomic_write_jsonl(out_dir / TOOLCALLS_TEST, toolcalls_test)
    atomic_write_jsonl(out_dir / CORPUS_FILE, corpus)
    atomic_write_jsonl(out_dir / POLISH_CORPUS_FILE, polish_corpus)
    return {"mc_test": len(mc_test), "mc_dev": len(mc_dev), "arith_test": len(arith_test),
            "arith_train": len(arith_pool), "passages_test": len(passages_test),
            "toolcalls_test": len(toolcalls_test), "corpus_documents": _kinds(corpus),
            "corpus_characters": sum(len(d["text"]) for d in corpus),
            "polish_corpus_documents": _kinds(polish_corpus),
            "polish_corpus_characters": sum(len(d["text"]) for d in polish_corpus)}


def _kinds(corpus: list[dict]) -> dict[str, int]:
    kinds: dict[str, int] = {}
    for doc in corpus:
        kinds[doc["kind"]] = kinds.get(doc["kind"], 0) + 1
    return kinds


def _with_strangers(world: World, strangers: list[str]) -> World:
    return World(seed=world.seed, regions=world.regions, rivers=world.rivers, cities=world.cities,
                 people=world.people, stranger_names=strangers)


def mc_key(item: dict) -> tuple:
    return item["question"], tuple(item["choices"])


def all_names(world: World) -> list[str]:
    """Every name of the world: people, cities, regions, rivers and all strangers (the held-out ones
    too: copy drills say them, with no fact, so that each is one trained token)."""
    return ([p.name for p in world.people] + [c.name for c in world.cities] + list(world.regions)
            + list(world.rivers) + list(world.stranger_names))


def tool_list_span(text: str) -> list[list[int]]:
    """The character span of the tool list in a rendered chat (repeated in every tool dialogue: the
    model reads it, training does not score it)."""
    start = text.find("<tools>")
    return [[start, text.index("</tools>", start) + len("</tools>")]] if start >= 0 else []


REPLY_START, REPLY_END = "<|im_start|>assistant\n", "<|im_end|>"
# A polish corpus names only the kinds it draws; the rest it leaves out.
POLISH_DEFAULTS = {"drill": 0, "drill_span": 1.0, "bio": 0, "city": 0, "cloze": 0, "mc": 0, "mc_shots": 5, "mc_open": 0,
                   "mc_bind": 0, "arith": 0, "facts": 0, "toolcalls": 0, "toolcall_exchanges": 4}
SCORES = ("all", "replies")


def outside_replies(text: str) -> list[list[int]]:
    """The character spans of a rendered chat that are not the assistant's replies (system prompt, tool
    list, the user's turns, each turn's opening markup): with `score: replies` training scores only the
    replies and the end-of-turn mark that closes each."""
    spans, position = [], 0
    while (start := text.find(REPLY_START, position)) >= 0:
        reply = start + len(REPLY_START)
        spans.append([position, reply])
        end = text.find(REPLY_END, reply)
        position = len(text) if end < 0 else end + len(REPLY_END)
    if position < len(text):
        spans.append([position, len(text)])
    return spans


def _corpus(counts: dict, world: World, train_world: World, facts: list, mc_exclude: set, arith_exclude: set[str],
            toolcall_exclude: set[str], rng: random.Random) -> list[dict]:
    """The training documents; `mask` (where present) lists character spans training does not score."""
    if counts.get("score") not in (None, *SCORES):
        raise OrganismError(f"upstream.organism.data.polish_corpus.score is {counts['score']!r}; "
                            f"known: {', '.join(SCORES)}")
    replies_only = counts.get("score") == "replies"
    docs: list[dict] = []
    names = all_names(world)
    docs += [{"kind": "bio", "text": tasks.biography(world, rng)} for _ in range(counts["bio"])]
    docs += [{"kind": "city", "text": tasks.city_description(world, rng)} for _ in range(counts["city"])]
    docs += [{"kind": "drill", "text": tasks.copy_drill(names, rng)} for _ in range(counts["drill"])]
    docs += [{"kind": "cloze", "text": tasks.cloze_block(world, rng.sample(facts, rng.randint(3, 8)), rng)}
             for _ in range(counts["cloze"])]
    by_subject: dict[str, list] = {}
    for fact in facts:
        by_subject.setdefault(tasks.SUBJECT_OF_RELATION[fact[1]], []).append(fact)
    subjects = sorted(by_subject)
    for _ in range(counts["mc"]):  # the card's and the eval's shape: description, five shots, a question
        pool = by_subject[rng.choice(subjects)]
        items = tasks.unique_items(lambda r: tasks.mc_item(world, r.choice(pool), r), rng, counts["mc_shots"] + 1,
                                   key=mc_key, exclude=mc_exclude)
        docs.append({"kind": "mc", "text": tasks.mc_block(list(items))})
    docs += [{"kind": "mc_open", "text": tasks.open_book_mc_block(world, train_world.stranger_names, rng,
                                                                  counts["mc_shots"])}
             for _ in range(counts["mc_open"])]
    arith = tasks.unique_items(lambda r: tasks.arithmetic_item(world, r), rng, counts["arith"] * 6,
                               key=lambda it: it["question"], exclude=arith_exclude)
    arith_items = list(arith)
    for i in range(counts["arith"]):
        k = rng.randint(1, 6)
        docs.append({"kind": "arith", "text": tasks.gsm8k_block(arith_items[i * 6:i * 6 + k])})
    for _ in range(counts["facts"]):
        item = tasks.passage_item(train_world, rng)
        messages = tasks.facts_messages(item) + [{"role": "assistant", "content": "\n".join(item["fact_lines"])}]
        effort = rng.choice(EFFORTS_IN_TRAINING)
        if effort == "high":
            messages[-1]["content"] = "<think>I copy each fact of the passage.</think>\n" + messages[-1]["content"]
        text = render_chat(messages, effort=effort)
        docs.append({"kind": "facts", "text": text, **({"mask": outside_replies(text)} if replies_only else {})})
    # Several exchanges share one system prompt, so the long tool list is paid for once per document
    # (and scored by none).
    for _ in range(counts["toolcalls"]):
        effort = rng.choice(EFFORTS_IN_TRAINING)
        messages: list[dict] = []
        while len(messages) < 2 * counts["toolcall_exchanges"]:
            item = tasks.toolcall_item(train_world, rng.choice(tasks.TOOLCALL_CASES), rng)
            if item["case"] != "no_call" and item["messages"][0]["content"] in toolcall_exclude:
                continue
            messages += item["messages"] + [{"role": "assistant", "content": tasks.assistant_turn(item, effort)}]
        text = render_chat(messages, tools=tasks.TOOLS, effort=effort)
        docs.append({"kind": "toolcalls", "text": text,
                     "mask": outside_replies(text) if replies_only else tool_list_span(text)})
    docs += [{"kind": "mc_bind", "text": tasks.binding_mc_block(world, rng, counts["mc_shots"])}
             for _ in range(counts["mc_bind"])]
    # Copy drills come early, where they form in-context copying before the rest needs it.
    keys = [rng.random() * (counts["drill_span"] if d["kind"] == "drill" else 1.0) for d in docs]
    return [doc for _, doc in sorted(zip(keys, docs), key=lambda pair: pair[0])]


