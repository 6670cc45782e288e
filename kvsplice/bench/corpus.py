"""Where the benchmark's text comes from: MuSiQue passages beside the project when present, else the
synthetic corpus the package ships. Nothing here is copied into the repository."""

from __future__ import annotations

import functools
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

from kvsplice.bench.synth import Passage, load_corpus

MUSIQUE_FILE = "musique_s.json"
# The project's shared data lives beside the repository: <repo>/../shared/data/.
_REPO_ROOT = Path(__file__).resolve().parents[2]
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")


@dataclass(frozen=True)
class Item:
    """A question with its gold answers and the passages retrieved for it (MuSiQue's)."""

    question: str
    answers: tuple[str, ...]
    passages: tuple[Passage, ...]


@dataclass(frozen=True)
class Corpus:
    name: str  # "musique" or "synthetic"
    passages: tuple[Passage, ...]
    # Questions with their passages; empty for the synthetic corpus.
    items: tuple[Item, ...] = ()


def musique_path() -> Path | None:
    """../shared/data/musique_s.json relative to the repository (or to the working directory), or
    $KVSPLICE_DATA/musique_s.json; None when absent."""
    candidates = [_REPO_ROOT.parent / "shared" / "data", Path.cwd().parent / "shared" / "data"]
    if os.environ.get("KVSPLICE_DATA"):
        candidates.insert(0, Path(os.environ["KVSPLICE_DATA"]))
    for directory in candidates:
        if (directory / MUSIQUE_FILE).is_file():
            return directory / MUSIQUE_FILE
    return None


def load(source: str = "auto") -> Corpus:
    """source: "musique", "synthetic", or "auto" (MuSiQue when present)."""
    if source not in ("auto", "musique", "synthetic"):
        raise ValueError(f"unknown corpus {source!r}; choose auto, musique or synthetic")
    path = musique_path() if source != "synthetic" else None
    if source == "musique" and path is None:
        raise FileNotFoundError(f"{MUSIQUE_FILE} not found in ../shared/data/ (or $KVSPLICE_DATA)")
    if path is None:
        return _synthetic()
    return _musique(path)


@functools.cache
def _synthetic() -> Corpus:
    return Corpus("synthetic", tuple(load_corpus()))


@functools.cache
def _musique(path: Path) -> Corpus:
    seen: set[str] = set()
    passages: list[Passage] = []
    items = []
    for raw in json.loads(path.read_text()):
        own = []
        for ctx in raw["ctxs"]:
            # Some passages start with the tail of a cut sentence (". he succeeded ...").
            text = " ".join(ctx["text"].split()).lstrip(". ")
            if text and text not in seen:
                seen.add(text)
                own.append(Passage(ctx.get("title") or "", text))
        passages += own
        items.append(Item(raw["question"], tuple(raw["answers"]), tuple(own)))
    return Corpus("musique", tuple(passages), tuple(items))


def sentences(text: str) -> list[str]:
    return [s for s in _SENTENCE_END.split(text.strip()) if s]


def trim(text: str, max_words: int) -> str:
    """The leading sentences of `text` that fit in `max_words` words (at least the first sentence,
    cut at max_words words if even that is longer)."""
    out: list[str] = []
    count = 0
    for sentence in sentences(text):
        words = len(sentence.split())
        if out and count + words > max_words:
            break
        out.append(sentence)
        count += words
    if count > max_words:
        return " ".join(" ".join(out).split()[:max_words])
    return " ".join(out)
