"""The synthetic corpus the package ships (kvsplice/data/synthetic_corpus.json): encyclopedia-style
passages about invented towns, people and institutions, from templates and a seeded generator.

It stands in for real passages when ../shared/data/musique_s.json is absent, and fills the `qa`
workload's documents. Regenerate with `python -m kvsplice.bench.synth` (the output is deterministic,
and a test checks that the shipped file equals it).
"""

from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass
from pathlib import Path

CORPUS_PATH = Path(__file__).resolve().parent.parent / "data" / "synthetic_corpus.json"
NUM_PASSAGES = 64
SEED = 1234
# Passages are cut at a sentence boundary near this many words (~350-450 Gemma tokens).
TARGET_WORDS = 300

_ONSETS = ["b", "br", "d", "dr", "f", "g", "h", "k", "l", "m", "n", "p", "r", "s", "st", "t", "th", "v", "w"]
_VOWELS = ["a", "e", "i", "o", "u", "ae", "ei", "ou"]
_CODAS = ["", "", "n", "r", "l", "s", "th", "nd", "rk", "m"]
_SUFFIXES = ["holm", "ford", "wick", "stad", "mere", "burg", "dale", "ton", "vik", "ora", "ia", "ley"]
_PROFESSIONS = [
    "miller", "cartographer", "merchant", "physician", "stonemason", "weaver", "astronomer", "priest",
    "shipwright", "botanist", "engineer", "poet", "glassblower", "judge", "teacher", "brewer",
]  # fmt: skip
_INDUSTRIES = [
    "fishing", "wool", "salt mining", "timber", "glassmaking", "printing", "orchards", "copper smelting",
    "river trade", "tourism", "cheese making", "shipbuilding", "clockmaking", "paper mills",
]  # fmt: skip
_BUILDINGS = ["cathedral", "town hall", "library", "granary", "bridge", "observatory", "abbey", "market hall"]
_EVENTS = ["fire", "flood", "storm", "earthquake", "siege", "plague"]
_SEASONS = ["spring", "summer", "autumn", "winter"]
_DIRECTIONS = ["northern", "southern", "eastern", "western", "central"]
_FEATURES = [
    "its long vowels", "a whistled greeting", "counting in dozens", "borrowed sailing terms",
    "songs sung in rounds", "dropping the final consonant",
]  # fmt: skip
_THINGS = ["maps", "coins", "clocks", "manuscripts", "tapestries", "ship models", "seeds", "instruments"]
_DEEDS = [
    "draining the marshes", "founding the first school", "a treaty with the river towns",
    "rebuilding the harbour", "a famous dispute over water rights", "paving the market square",
]  # fmt: skip
_FIELDS = ["mathematics", "botany", "navigation", "medicine", "architecture", "music", "law", "chemistry"]


KINDS = ("place", "person", "organisation")


@dataclass(frozen=True)
class Passage:
    title: str
    text: str
    # What the passage is about, one of KINDS ("" for passages of other corpora).
    kind: str = ""


class _Words:
    def __init__(self, rng: random.Random) -> None:
        self.rng = rng

    def name(self, syllables: int = 2) -> str:
        r = self.rng
        word = "".join(r.choice(_ONSETS) + r.choice(_VOWELS) + r.choice(_CODAS) for _ in range(syllables))
        return word.capitalize()

    def place(self) -> str:
        return self.name(self.rng.choice([1, 2])) + self.rng.choice(_SUFFIXES)

    def person(self) -> str:
        return f"{self.name()} {self.place()}"

    def year(self, lo: int = 1150, hi: int = 1990) -> int:
        return self.rng.randint(lo, hi)


def _a(noun: str) -> str:
    return ("an " if noun[0] in "aeiou" else "a ") + noun


def _town(w: _Words, title: str) -> list[str]:
    r = w.rng
    founded = w.year(1100, 1700)
    mayor_from = w.year(1750, 1950)
    return [
        f"{title} is a {r.choice(['small', 'market', 'harbour', 'hill'])} town in the "
        f"{r.choice(_DIRECTIONS)} part of the province of {w.place()}.",
        f"It was founded in {founded} by {w.person()}, {_a(r.choice(_PROFESSIONS))} from {w.place()}.",
        f"The town lies on the {r.choice(['left', 'right'])} bank of the {w.name()} river, about "
        f"{r.randint(3, 90)} kilometres from the city of {w.place()}.",
        f"In {founded + r.randint(40, 300)}, {_a(r.choice(_EVENTS))} destroyed much of the old "
        f"{r.choice(_BUILDINGS)}, which was rebuilt over the following {r.randint(2, 30)} years.",
        f"Its economy has long depended on {r.choice(_INDUSTRIES)} and {r.choice(_INDUSTRIES)}; the market "
        f"held every {r.choice(['Monday', 'Wednesday', 'Friday', 'Saturday'])} draws traders from the "
        "whole valley.",
        f"{w.person()}, who served as mayor from {mayor_from} to {mayor_from + r.randint(2, 20)}, is "
        f"remembered for {r.choice(_DEEDS)}.",
        f"The local dialect is known for {r.choice(_FEATURES)}, which visitors often find hard to follow.",
        f"{_a(r.choice(_BUILDINGS)).capitalize()} built in the {r.randint(12, 18)}th century still "
        f"stands near the {r.choice(['square', 'harbour', 'old gate', 'river crossing'])}.",
        f"The {w.name()} festival, held each {r.choice(_SEASONS)}, celebrates the end of the "
        f"{r.choice(['harvest', 'fishing season', 'long winter', 'wool fair'])}.",
        "Scholars disagree about the origin of the name: some trace it to an old word for "
        f"{r.choice(['ford', 'willow', 'salt', 'hill', 'mill'])}, others to a family called {w.name()}.",
        f"The climate is {r.choice(['mild', 'damp', 'dry', 'windy'])}, with "
        f"{r.choice(['fog', 'heavy rain', 'snow', 'warm evenings'])} in {r.choice(_SEASONS)}.",
        f"The {r.choice(_BUILDINGS)} houses a collection of {r.choice(_THINGS)}, some said to date from "
        f"{w.year(1200, 1800)}.",
        f"Notable residents have included the {r.choice(_PROFESSIONS)} {w.person()} and the "
        f"{r.choice(_PROFESSIONS)} {w.person()}.",
        f"A railway line reached {title} in {w.year(1840, 1910)}, and the old toll road was closed "
        "soon after.",
    ]


def _person(w: _Words, title: str) -> list[str]:
    r = w.rng
    born = w.year(1500, 1900)
    died = born + r.randint(35, 90)
    field = r.choice(_FIELDS)
    return [
        f"{title} ({born}-{died}) was {_a(r.choice(_PROFESSIONS))} and writer on {field} from {w.place()}.",
        f"The child of {_a(r.choice(_PROFESSIONS))}, {title.split()[0]} was educated at the school of "
        f"{w.place()} and later studied {field} under {w.person()}.",
        f"In {born + r.randint(18, 30)}, {title.split()[0]} moved to {w.place()}, where a first book, "
        f"on {r.choice(_THINGS)} and their makers, appeared {r.randint(2, 9)} years later.",
        f"Contemporaries described {title.split()[0]} as {r.choice(['patient', 'quarrelsome', 'generous'])}"
        f" and {r.choice(['precise', 'restless', 'shy', 'witty'])}, and the letters that survive bear "
        "this out.",
        f"A long correspondence with {w.person()} covered {field}, {r.choice(_FIELDS)} and the price of "
        f"{r.choice(_INDUSTRIES)}.",
        f"In {born + r.randint(30, 45)}, {_a(r.choice(_EVENTS))} cost {title.split()[0]} most of a library, "
        f"and the next {r.randint(2, 8)} years went into rebuilding it.",
        f"The best known work, a study of {r.choice(_THINGS)} in {r.choice(_DIRECTIONS)} {w.place()}, was "
        f"reprinted {r.randint(2, 11)} times.",
        f"{title.split()[0]} also served as {r.choice(['town clerk', 'magistrate', 'harbour master'])} of "
        f"{w.place()} and is remembered there for {r.choice(_DEEDS)}.",
        f"Late in life, {title.split()[0]} returned to {w.place()} and died there in {died}.",
        f"A street in {w.place()} and {_a(r.choice(_BUILDINGS))} in {w.place()} bear the name today.",
        f"Historians still debate whether the {r.choice(_THINGS)} attributed to {title.split()[0]} were "
        f"made by a pupil, {w.person()}.",
    ]


def _institution(w: _Words, title: str) -> list[str]:
    r = w.rng
    founded = w.year(1300, 1950)
    return [
        f"The {title} is {_a(r.choice(['guild', 'society', 'company', 'academy']))} of "
        f"{r.choice(_PROFESSIONS)}s based in {w.place()}.",
        f"It was established in {founded} by {r.randint(3, 40)} members who had left the older "
        f"{w.name()} guild after a dispute over {r.choice(['fees', 'apprentices', 'the use of the hall'])}.",
        f"Its first hall stood beside the {r.choice(_BUILDINGS)} of {w.place()} and was replaced in "
        f"{founded + r.randint(20, 150)} by a larger building in the {r.choice(_DIRECTIONS)} quarter.",
        f"Members met every {r.choice(_SEASONS)} to elect a warden; {w.person()} held the post for "
        f"{r.randint(3, 25)} years, longer than anyone else.",
        f"The {title} kept a collection of {r.choice(_THINGS)} and a library of books on "
        f"{r.choice(_FIELDS)} that was opened to the public in {w.year(1800, 1990)}.",
        f"During the {r.choice(_EVENTS)} of {min(founded + r.randint(10, 200), 1990)}, members organised "
        f"{r.choice(['shelters', 'food stores', 'boats', 'a hospital'])} for the town.",
        f"Its rules required every apprentice to spend {r.randint(2, 7)} years in training and to "
        f"present a finished piece to the wardens.",
        f"The trade it governed was tied to {r.choice(_INDUSTRIES)}, and its seal shows a "
        f"{r.choice(['heron', 'anchor', 'key', 'wheel', 'lamp'])} above a river.",
        f"Today the {title} has about {r.randint(40, 900)} members and awards a prize each year for work in "
        f"{r.choice(_FIELDS)}.",
        f"Its archive, kept in {w.place()}, records disputes with the {w.name()} family over "
        f"{r.choice(['land', 'water rights', 'timber', 'a mill'])}.",
    ]


def make_corpus(num: int = NUM_PASSAGES, seed: int = SEED, target_words: int = TARGET_WORDS) -> list[Passage]:
    """`num` passages, each one topic, cut at a sentence end once past `target_words` words."""
    rng = random.Random(seed)
    words = _Words(rng)
    titles: set[str] = set()
    passages: list[Passage] = []
    while len(passages) < num:
        kind = len(passages) % 3
        title = (words.place(), words.person(), f"{words.name()} {rng.choice(_PROFESSIONS).title()}s Guild")[
            kind
        ]
        if title in titles:
            continue
        titles.add(title)
        make = (_town, _person, _institution)[kind]
        sentences = make(words, title)
        # The opening sentence stays first; when one topic runs short, a neighbouring town follows.
        rest = sentences[1:]
        rng.shuffle(rest)
        sentences[1:] = rest
        while sum(len(s.split()) for s in sentences) < target_words:
            sentences += _town(words, words.place())
        text, count = [], 0
        for sentence in sentences:
            text.append(sentence)
            count += len(sentence.split())
            if count >= target_words:
                break
        passages.append(Passage(title, " ".join(text), KINDS[kind]))
    return passages


def load_corpus(path: Path = CORPUS_PATH) -> list[Passage]:
    return [Passage(**p) for p in json.loads(path.read_text())]


def main() -> None:
    passages = make_corpus()
    CORPUS_PATH.parent.mkdir(parents=True, exist_ok=True)
    CORPUS_PATH.write_text(json.dumps([asdict(p) for p in passages], indent=1, ensure_ascii=False) + "\n")
    print(f"wrote {len(passages)} passages to {CORPUS_PATH}")


if __name__ == "__main__":
    main()
