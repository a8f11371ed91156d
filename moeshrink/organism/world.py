"""A deterministic synthetic world: people, cities, regions and rivers with categorical attributes.

Everything the organism knows, and every eval's ground truth, is derived from a `World` built by
`generate_world(seed, ...)`; the same seed and sizes always give the same world.
"""
from __future__ import annotations

import random
from dataclasses import asdict, dataclass, field

from moeshrink.organism import OrganismError

ONSETS = ["b", "d", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z",
          "th", "br", "dr", "kr", "tr", "st", "sh", "gl", "vr"]
VOWELS = ["a", "e", "i", "o", "u", "ae", "ai", "ou", "ei"]
CODAS = ["", "", "n", "r", "l", "s", "th", "m", "k", "nd", "rn"]

# Attribute vocabularies are plain English words, so the tokenizer spends its merges on them once.
TRADES = ["weaver", "potter", "smith", "baker", "sailor", "miner", "scribe", "healer",
          "farmer", "tailor", "mason", "hunter"]
COLORS = ["red", "blue", "green", "yellow", "purple", "orange", "white", "black",
          "silver", "gold", "brown", "gray"]
PETS = ["owl", "fox", "cat", "goat", "hawk", "hare", "toad", "crow", "lynx", "mole",
        "newt", "otter"]
INSTRUMENTS = ["flute", "drum", "harp", "lute", "horn", "fiddle", "bell", "pipe",
               "oboe", "cello"]

# relation id -> (attribute vocabulary or entity kind, canonical phrase used in fact lists)
PERSON_RELATIONS: dict[str, str] = {
    "city": "lives in",
    "trade": "works as",
    "color": "favorite color",
    "pet": "keeps",
    "instrument": "plays",
}
CITY_RELATIONS: dict[str, str] = {
    "region": "lies in",
    "river": "is on the river",
}


@dataclass(frozen=True)
class Person:
    name: str
    city: str
    trade: str
    color: str
    pet: str
    instrument: str
    age: int


@dataclass(frozen=True)
class City:
    name: str
    region: str
    river: str


@dataclass
class World:
    seed: int
    regions: list[str]
    rivers: list[str]
    cities: list[City]
    people: list[Person]
    # Names that exist nowhere in the world: used for passages and tool calls about strangers.
    stranger_names: list[str] = field(default_factory=list)

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> World:
        return cls(
            seed=data["seed"],
            regions=list(data["regions"]),
            rivers=list(data["rivers"]),
            cities=[City(**c) for c in data["cities"]],
            people=[Person(**p) for p in data["people"]],
            stranger_names=list(data["stranger_names"]),
        )

    def city(self, name: str) -> City:
        return next(c for c in self.cities if c.name == name)

    def vocabulary(self, relation: str) -> list[str]:
        """All values a relation can take, for distractors and random strangers."""
        return {
            "city": [c.name for c in self.cities],
            "trade": TRADES,
            "color": COLORS,
            "pet": PETS,
            "instrument": INSTRUMENTS,
            "region": self.regions,
            "river": self.rivers,
        }[relation]


class NameMaker:
    """Pronounceable, unique, capitalised fictional names."""

    def __init__(self, rng: random.Random):
        self.rng = rng
        self.used: set[str] = set()

    def make(self, syllables: tuple[int, ...] = (2, 2, 3)) -> str:
        for _ in range(10_000):
            count = self.rng.choice(syllables)
            parts = [self.rng.choice(ONSETS) + self.rng.choice(VOWELS) for _ in range(count)]
            name = ("".join(parts) + self.rng.choice(CODAS)).capitalize()
            if 4 <= len(name) <= 10 and name not in self.used:
                self.used.add(name)
                return name
        raise OrganismError("name space exhausted; lower the world sizes")


def generate_world(seed: int, people: int, cities: int, regions: int, rivers: int,
                   strangers: int) -> World:
    if cities < 4 or people < 8 or regions < 4 or rivers < 4:
        raise OrganismError("world too small: a question has 4 choices, so cities, regions and rivers need >= 4 "
                         "(and people >= 8)")
    rng = random.Random(seed)
    names = NameMaker(rng)
    region_names = [names.make((2, 3)) for _ in range(regions)]
    river_names = [names.make((2,)) for _ in range(rivers)]
    city_list = [City(name=names.make(), region=rng.choice(region_names), river=rng.choice(river_names))
                 for _ in range(cities)]
    person_list = [
        Person(
            name=names.make(),
            city=rng.choice(city_list).name,
            trade=rng.choice(TRADES),
            color=rng.choice(COLORS),
            pet=rng.choice(PETS),
            instrument=rng.choice(INSTRUMENTS),
            age=rng.randint(18, 90),
        )
        for _ in range(people)
    ]
    stranger_list = [names.make() for _ in range(strangers)]
    return World(seed=seed, regions=region_names, rivers=river_names, cities=city_list,
                 people=person_list, stranger_names=stranger_list)
