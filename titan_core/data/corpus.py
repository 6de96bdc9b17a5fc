"""A generated English-like corpus, so the default recipe trains with no download.

Documents come from a small grammar with a fixed vocabulary and topic-dependent word choice,
which gives a language model something to learn beyond word frequencies. The output depends
only on the seed and the document count.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

_TOPICS = {
    "weather": (
        [
            "rain",
            "wind",
            "cloud",
            "storm",
            "sun",
            "morning",
            "river",
            "valley",
            "coast",
            "winter",
            "summer",
            "harbour",
        ],
        ["falls", "rises", "moves", "drifts", "changes", "returns", "gathers", "fades"],
    ),
    "city": (
        [
            "street",
            "market",
            "bridge",
            "tower",
            "square",
            "station",
            "library",
            "garden",
            "museum",
            "tram",
        ],
        ["opens", "closes", "grows", "stands", "waits", "shines", "wakes", "sleeps"],
    ),
    "science": (
        [
            "model",
            "signal",
            "energy",
            "particle",
            "theory",
            "measure",
            "sample",
            "pattern",
            "network",
            "field",
        ],
        ["predicts", "explains", "describes", "converges", "improves", "fails", "holds", "changes"],
    ),
    "kitchen": (
        [
            "bread",
            "soup",
            "oven",
            "spoon",
            "table",
            "window",
            "pepper",
            "butter",
            "kettle",
            "recipe",
        ],
        ["bakes", "boils", "cools", "rests", "sits", "warms", "smells", "waits"],
    ),
}
_ADJECTIVES = [
    "quiet",
    "old",
    "bright",
    "small",
    "large",
    "early",
    "late",
    "green",
    "silver",
    "careful",
    "sudden",
    "long",
]
_DETERMINERS = ["the", "a", "this", "every", "each", "that", "one"]
_ADVERBS = ["slowly", "quickly", "again", "today", "often", "rarely", "gently", "always"]
_LINKS = ["and", "but", "while", "because", "so", "when", "after", "before"]


def _phrase(rng: random.Random, nouns: list[str]) -> str:
    words = [rng.choice(_DETERMINERS)]
    if rng.random() < 0.5:
        words.append(rng.choice(_ADJECTIVES))
    words.append(rng.choice(nouns))
    return " ".join(words)


def _sentence(rng: random.Random, topic: str) -> str:
    nouns, verbs = _TOPICS[topic]
    clause = f"{_phrase(rng, nouns)} {rng.choice(verbs)}"
    if rng.random() < 0.4:
        clause += f" {rng.choice(_ADVERBS)}"
    if rng.random() < 0.5:
        clause += f" {rng.choice(_LINKS)} {_phrase(rng, nouns)} {rng.choice(verbs)}"
    return clause[0].upper() + clause[1:] + "."


#: Seed of the training documents (the ``bundled`` dataset's ``documents``).
TRAINING_SEED = 1234
#: Seed of the held-out documents (its ``held_out``, read by validation): the same grammar and
#: topics, other draws. A document is a title and 6 to 30 sentences, each one of thousands, so two
#: seeds practically never give the same document; a test checks the default 4000 share none.
HELD_OUT_SEED = 4321


def documents(count: int = 4000, seed: int = TRAINING_SEED) -> Iterator[str]:
    """Yield ``count`` documents; the same arguments always give the same text."""
    rng = random.Random(seed)
    topics = sorted(_TOPICS)
    for index in range(count):
        topic = topics[index % len(topics)]
        title = f"On the {rng.choice(_TOPICS[topic][0])}."
        body = " ".join(_sentence(rng, topic) for _ in range(rng.randint(6, 30)))
        yield f"{title} {body}"
