"""Task items generated from a `World`: prose, multiple choice, arithmetic, fact passages, tool calls.

Every item is a plain dict in the schema of the benchmark it imitates, so the same eval code reads
the organism's sets and the real ones (MMLU: question/subject/choices/answer; GSM8K:
question/answer ending in `#### N`).
"""
from __future__ import annotations

import json
import random
from collections.abc import Iterator

from moeshrink.organism import OrganismError
from moeshrink.organism.world import CITY_RELATIONS, PERSON_RELATIONS, World

LETTERS = "ABCD"

PROSE_TEMPLATES: dict[str, list[str]] = {
    "city": ["{s} lives in {o}.", "{s} has a house in {o}.", "{s} makes a home in the city of {o}.",
             "The home of {s} is {o}."],
    "trade": ["{s} works as {a} {o}.", "{s} earns a living as {a} {o}.", "By trade, {s} is {a} {o}.",
              "{s} is {a} {o} by trade."],
    "color": ["The favorite color of {s} is {o}.", "{s} likes the color {o} best.",
              "{s} loves {o} more than any other color."],
    "pet": ["{s} keeps {a} {o}.", "{s} has a pet {o}.", "{A} {o} lives with {s}."],
    "instrument": ["{s} plays the {o}.", "{s} can play the {o}.", "In the evening {s} plays the {o}."],
    "age": ["{s} is {o} years old.", "{s} has lived for {o} years."],
    "region": ["{s} lies in {o}.", "The city of {s} is in {o}.", "{s} is a city of {o}."],
    "river": ["{s} is on the river {o}.", "The river {o} flows through {s}.", "{s} stands on the {o}."],
}

QUESTION_TEMPLATES: dict[str, str] = {
    "city": "In which city does {s} live?",
    "trade": "What does {s} work as?",
    "color": "What is the favorite color of {s}?",
    "pet": "Which animal does {s} keep?",
    "instrument": "Which instrument does {s} play?",
    "region": "In which region does the city of {s} lie?",
    "river": "On which river is the city of {s}?",
}
SUBJECT_OF_RELATION = {**{r: "residents" for r in PERSON_RELATIONS}, **{r: "geography" for r in CITY_RELATIONS}}
FACT_PHRASES: dict[str, str] = {**PERSON_RELATIONS, **CITY_RELATIONS}

MC_DESCRIPTION = "The following are multiple choice questions (with answers) about {subject}.\n\n"

FACTS_INSTRUCTION = (
    "List every fact that the passage states, one per line, in the form: subject | relation | object. "
    "Use only these relations: lives in, works as, favorite color, keeps, plays."
)

Fact = tuple[str, str, str]  # (subject, relation id, object)


def article(word: str) -> str:
    return "an" if word[0].lower() in "aeiou" else "a"


def render_fact(fact: Fact, rng: random.Random) -> str:
    subject, relation, obj = fact
    template = rng.choice(PROSE_TEMPLATES[relation])
    text = template.format(s=subject, o=obj, a=article(obj), A=article(obj).capitalize())
    return text[0].upper() + text[1:]


def fact_line(fact: Fact) -> str:
    subject, relation, obj = fact
    return f"{subject} | {FACT_PHRASES[relation]} | {obj}"


def world_facts(world: World) -> list[Fact]:
    facts: list[Fact] = []
    for person in world.people:
        facts += [(person.name, relation, getattr(person, relation)) for relation in PERSON_RELATIONS]
    for city in world.cities:
        facts += [(city.name, relation, getattr(city, relation)) for relation in CITY_RELATIONS]
    return facts


# ----------------------------------------------------------------------------------------- prose
def biography(world: World, rng: random.Random) -> str:
    person = rng.choice(world.people)
    facts = [(person.name, relation, getattr(person, relation)) for relation in PERSON_RELATIONS]
    facts.append((person.name, "age", str(person.age)))
    rng.shuffle(facts)
    keep = facts[: rng.randint(3, len(facts))]
    return " ".join(render_fact(f, rng) for f in keep)


def city_description(world: World, rng: random.Random) -> str:
    city = rng.choice(world.cities)
    facts = [(city.name, relation, getattr(city, relation)) for relation in CITY_RELATIONS]
    rng.shuffle(facts)
    residents = [p for p in world.people if p.city == city.name]
    sentences = [render_fact(f, rng) for f in facts]
    if residents:
        person = rng.choice(residents)
        sentences.append(render_fact((person.name, "city", city.name), rng))
    return " ".join(sentences)


# ------------------------------------------------------------------------------- multiple choice
def mc_item(world: World, fact: Fact, rng: random.Random) -> dict:
    subject, relation, answer = fact
    distractors = rng.sample([v for v in world.vocabulary(relation) if v != answer], 3)
    choices = distractors + [answer]
    rng.shuffle(choices)
    return {
        "question": QUESTION_TEMPLATES[relation].format(s=subject),
        "subject": SUBJECT_OF_RELATION[relation],
        "choices": choices,
        "answer": choices.index(answer),
        "fact": list(fact),
    }


def mc_text(item: dict) -> str:
    """lm-eval's MMLU `doc_to_text`, so training text matches what the eval sends."""
    options = "".join(f"\n{LETTERS[i]}. {c}" for i, c in enumerate(item["choices"]))
    return f"{item['question'].strip()}{options}\nAnswer:"


def mc_block(items: list[dict]) -> str:
    """A k-shot block as lm-eval renders it: description, then examples separated by blank lines."""
    body = "\n\n".join(f"{mc_text(it)} {LETTERS[it['answer']]}" for it in items)
    return MC_DESCRIPTION.format(subject=items[0]["subject"]) + body


# ------------------------------------------------------------------------------------ arithmetic
OBJECTS = ["apples", "candles", "eggs", "coins", "stones", "loaves", "pears", "nails"]
CONTAINERS = ["baskets", "boxes", "bags", "crates", "jars"]


def arithmetic_item(world: World, rng: random.Random) -> dict:
    """A two-step GSM8K-style word problem with GSM8K's `<<a*b=c>>` calculator annotations.

    Numbers stay small (one-digit factors, sums under 100) so a small model can learn the steps.
    The actors are strangers: their names get trained tokens without any fact attached to them.
    """
    name = rng.choice(world.stranger_names)
    thing = rng.choice(OBJECTS)
    box = rng.choice(CONTAINERS)
    kind = rng.randrange(3)
    a, b, c = rng.randint(2, 9), rng.randint(2, 9), rng.randint(1, 9)
    if kind == 0:
        first = a * b
        result = first - c
        question = (f"{name} has {a} {box} with {b} {thing} in each. {name} gives away {c} {thing}. "
                    f"How many {thing} does {name} have left?")
        steps = [f"{a} * {b} = <<{a}*{b}={first}>>{first} {thing}.",
                 f"{first} - {c} = <<{first}-{c}={result}>>{result} {thing}."]
    elif kind == 1:
        first = a * b
        result = first + c
        question = f"{name} buys {a} {box} of {b} {thing} and {c} more {thing}. How many {thing} does {name} buy?"
        steps = [f"{a} * {b} = <<{a}*{b}={first}>>{first} {thing}.",
                 f"{first} + {c} = <<{first}+{c}={result}>>{result} {thing}."]
    else:
        first = a + b
        result = first + c
        question = (f"{name} picks {a} {thing} on Monday, {b} on Tuesday and {c} on Wednesday. "
                    f"How many {thing} does {name} pick?")
        steps = [f"{a} + {b} = <<{a}+{b}={first}>>{first} {thing}.",
                 f"{first} + {c} = <<{first}+{c}={result}>>{result} {thing}."]
    return {"question": question, "answer": "\n".join(steps) + f"\n#### {result}"}


def copy_drill(names: list[str], rng: random.Random) -> str:
    """A list of names said again and again: bursty, exact repeats, the data on which copying from
    context (induction) is learnt fastest. Names only, never a fact."""
    words = [rng.choice(names) for _ in range(rng.randint(3, 10))]
    line = " ".join(words)
    return f"Say after me: {line}\n" + "\n".join([line] * rng.randint(1, 3))


CLOZE_DELIMITER = " "  # between a question and its answer's text: lm-eval's target_delimiter in the cloze eval


def cloze_context(question: str) -> str:
    return question.strip()


def cloze_continuation(answer: str) -> str:
    return f"{CLOZE_DELIMITER}{answer}"


def cloze_line(question: str, answer: str) -> str:
    """A question answered in words, as the corpus teaches it and the cloze MC eval scores it: lm-eval's
    context is the question, each option's text after CLOZE_DELIMITER is scored as its continuation."""
    return f"{cloze_context(question)}{cloze_continuation(answer)}."


def cloze_block(world: World, facts: list[Fact], rng: random.Random) -> str:
    """World facts as the questions the MC eval asks, answered in words ("In which city does Zevein
    live? Soure."): the fact becomes retrievable from the question form (recall, not recognition)."""
    return "\n".join(cloze_line(QUESTION_TEMPLATES[relation].format(s=subject), obj) for subject, relation, obj in facts)


BINDING_QUESTION = "Which of these is {answer}?"


def binding_mc_block(world: World, rng: random.Random, shots: int = 5) -> str:
    """Multiple choice in the MMLU shape whose question names its answer ("Which of these is goat?"):
    the plainest case of binding an answer to its letter, a single lookup from the question to the
    option, on every kind of word the knowledge questions choose between."""
    kinds = ["city", "trade", "color", "pet", "instrument", "region", "river"]
    items = []
    for _ in range(shots + 1):
        vocabulary = world.vocabulary(rng.choice(kinds))
        choices = rng.sample(vocabulary, 4)
        answer = rng.randrange(4)
        question = {"question": BINDING_QUESTION.format(answer=choices[answer]), "choices": choices}
        items.append(f"{mc_text(question)} {LETTERS[answer]}")
    return MC_DESCRIPTION.format(subject="words") + "\n\n".join(items)


def open_book_mc_block(world: World, strangers: list[str], rng: random.Random, shots: int = 5) -> str:
    """Multiple choice in the MMLU shape whose answers are stated just before each question, about
    strangers with attributes drawn afresh for this document: the answer can only come from the
    context, so the model learns to bind the answer it knows to its letter."""
    subject = "residents"
    items = []
    for _ in range(shots + 1):
        relation = rng.choice(list(PERSON_RELATIONS))
        fact = (rng.choice(strangers), relation, rng.choice(world.vocabulary(relation)))
        item = mc_item(world, fact, rng)
        items.append(f"{render_fact(fact, rng)}\n{mc_text(item)} {LETTERS[item['answer']]}")
    return MC_DESCRIPTION.format(subject=subject) + "\n\n".join(items)


def gsm8k_block(items: list[dict]) -> str:
    """lm-eval's GSM8K few-shot rendering: `Question: q\\nAnswer: a`, blank line between."""
    return "\n\n".join(f"Question: {it['question']}\nAnswer: {it['answer']}" for it in items)


# ---------------------------------------------------------------------------- passages and facts
def passage_item(world: World, rng: random.Random) -> dict:
    """A passage about one stranger (no memory can support it) and the facts it states."""
    name = rng.choice(world.stranger_names)
    relations = rng.sample(list(PERSON_RELATIONS), rng.randint(2, 4))
    facts: list[Fact] = [(name, relation, rng.choice(world.vocabulary(relation))) for relation in relations]
    sentences = [render_fact(f, rng) for f in facts]
    return {
        "passage": " ".join(sentences),
        "facts": [list(f) for f in facts],
        "fact_lines": [fact_line(f) for f in facts],
    }


def facts_messages(item: dict) -> list[dict]:
    return [{"role": "user", "content": f"{FACTS_INSTRUCTION}\n\nPassage: {item['passage']}"}]


# ------------------------------------------------------------------------------------ tool calls
TOOLS: list[dict] = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Get the weather in a city.",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string"},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
            "required": ["city"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "set_timer", "description": "Start a timer.",
        "parameters": {"type": "object", "properties": {
            "minutes": {"type": "integer", "minimum": 1},
            "label": {"type": "string"}},
            "required": ["minutes", "label"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "lookup_person", "description": "Look up a fact about a person.",
        "parameters": {"type": "object", "properties": {
            "name": {"type": "string"},
            "field": {"type": "string", "enum": ["city", "trade", "color", "pet", "instrument"]}},
            "required": ["name", "field"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "book_trip", "description": "Book a trip between two cities.",
        "parameters": {"type": "object", "properties": {
            "origin": {"type": "string"},
            "destination": {"type": "string"},
            "travellers": {"type": "integer", "minimum": 1}},
            "required": ["origin", "destination", "travellers"], "additionalProperties": False}}},
]
TOOLCALL_CASES = ["weather", "timer", "lookup", "trip", "two_cities", "no_call"]
LOOKUP_QUESTIONS = {
    "city": "Where does {n} live?", "trade": "What does {n} work as?",
    "color": "What is the favorite color of {n}?", "pet": "Which animal does {n} keep?",
    "instrument": "Which instrument does {n} play?",
}
TIMER_LABELS = ["bread", "tea", "soup", "laundry", "meeting", "walk", "rice", "nap"]
NO_CALL_PROMPTS = [("Thank you, that is all for now.", "You are welcome."),
                   ("Hello! How are you?", "Hello! I am well, thank you."),
                   ("Please just say hello.", "Hello!"),
                   ("Thanks for the help.", "You are welcome.")]


def _call(tool: str, **arguments) -> dict:
    return {"name": tool, "arguments": arguments}


def toolcall_item(world: World, case: str, rng: random.Random) -> dict:
    """One trial: the user's request, the calls a correct answer makes, and a reference reply."""
    cities = [c.name for c in world.cities]
    if case == "weather":
        city = rng.choice(cities)
        if rng.random() < 0.5:
            unit = rng.choice(["celsius", "fahrenheit"])
            request, calls = f"What is the weather in {city} today, in {unit}?", [_call("get_weather", city=city, unit=unit)]
        else:
            request, calls = f"What is the weather in {city} today?", [_call("get_weather", city=city)]
        thought = f"The user wants the weather in {city}, so I call get_weather."
    elif case == "timer":
        minutes, label = rng.randint(1, 90), rng.choice(TIMER_LABELS)
        request, calls = f"Set a timer for {minutes} minutes for the {label}.", [_call("set_timer", minutes=minutes,
                                                                                       label=label)]
        thought = f"A timer of {minutes} minutes is needed, so I call set_timer."
    elif case == "lookup":
        name = rng.choice(world.stranger_names)
        field = rng.choice(list(LOOKUP_QUESTIONS))
        request = LOOKUP_QUESTIONS[field].format(n=name) + " Please look it up."
        calls = [_call("lookup_person", name=name, field=field)]
        thought = f"I must look up the {field} of {name}, so I call lookup_person."
    elif case == "trip":
        origin, destination = rng.sample(cities, 2)
        travellers = rng.randint(1, 9)
        request = f"Book a trip from {origin} to {destination} for {travellers} people."
        calls = [_call("book_trip", origin=origin, destination=destination, travellers=travellers)]
        thought = f"The user wants a trip from {origin} to {destination}, so I call book_trip."
    elif case == "two_cities":
        first, second = rng.sample(cities, 2)
        request = f"What is the weather in {first} and in {second}?"
        calls = [_call("get_weather", city=first), _call("get_weather", city=second)]
        thought = "Two cities are asked, so I call get_weather twice."
    elif case == "no_call":
        request, reply = rng.choice(NO_CALL_PROMPTS)
        return {"case": case, "messages": [{"role": "user", "content": request}], "expected_calls": [],
                "reply": reply, "thought": "No tool is needed."}
    else:
        raise OrganismError(f"unknown tool-call case {case!r}; known: {', '.join(TOOLCALL_CASES)}")
    reply = "\n".join(f"<tool_call>\n{json.dumps(c)}\n</tool_call>" for c in calls)
    return {"case": case, "messages": [{"role": "user", "content": request}], "expected_calls": calls,
            "reply": reply, "thought": thought}


def assistant_turn(item: dict, effort: str | None) -> str:
    """The reference assistant message: at high effort a short thought precedes the answer."""
    if effort == "high":
        return f"<think>{item['thought']}</think>\n{item['reply']}"
    return item["reply"]


def unique_items(make, rng: random.Random, count: int, key, exclude: set | None = None,
                 max_tries_factor: int = 50) -> Iterator[dict]:
    """Draw `count` items whose `key` is new (and not in `exclude`); fail clearly if the space is too small."""
    if count == 0:
        return
    seen = set(exclude or ())
    made = 0
    for _ in range(count * max_tries_factor):
        item = make(rng)
        k = key(item)
        if k in seen:
            continue
        seen.add(k)
        made += 1
        yield item
        if made == count:
            return
    raise OrganismError(f"could only draw {made} distinct items of {count}; enlarge the world")
