"""Small routing-benchmark datasets the simulation tests write: `tiny_dataset` (eight tools of
several intents each) and `twin_dataset` (each tool split in twins that share a description).
Registered in conftest.py."""

from __future__ import annotations

import json
import random

import pytest

# Each tool has several distinct intents; a client sees only some of them early on, so coverage
# (and accuracy) grows as experience accumulates over rounds.
TOOLS = {
    "weather": ("Weather", ["rain forecast tomorrow", "temperature this weekend", "snow storm warning",
                            "humidity and wind speed", "sunrise and sunset times", "uv index at noon"]),
    "flights": ("Travel", ["cheap flight tickets", "airport departure gate", "flight delay status",
                           "baggage allowance rules", "seat upgrade to business class", "layover connections"]),
    "hotels": ("Travel", ["hotel room booking", "late checkout request", "hostel beds downtown",
                          "resort with a pool", "cancel my reservation", "room service menu"]),
    "calculator": ("Math", ["multiply two numbers", "square root of a value", "percentage of a total",
                            "solve a quadratic equation", "convert fractions to decimals", "compound interest formula"]),
    "stocks": ("Finance", ["share price of a company", "dividend yield history", "market cap ranking",
                           "stock portfolio performance", "earnings report date", "buy or sell rating"]),
    "recipes": ("Food", ["vegan dinner recipe", "bake chocolate cake", "gluten free bread",
                         "quick breakfast ideas", "slow cooker stew", "spicy curry sauce"]),
    "music": ("Media", ["play a jazz playlist", "lyrics of a song", "new album releases",
                        "concert tickets nearby", "guitar chords tutorial", "similar artists radio"]),
    "news": ("Media", ["latest headlines today", "election results coverage", "sports scores update",
                       "technology news digest", "local news in my town", "breaking news alerts"]),
}
OPENERS = ["Can you find", "Please show me", "I need", "Help me with", "What about", "Look up"]
SUFFIXES = ["", " please", " for me", " right now", " today", " quickly"]


def _write_dataset(folder, tools) -> None:
    """A routing-benchmark dataset of (tool_id, category, description, intents) tools: six
    queries per intent, an opener and a suffix drawn around it."""
    rng = random.Random(7)
    folder.mkdir()
    with (folder / "tools.jsonl").open("w") as tool_file, (folder / "queries.jsonl").open("w") as queries:
        n = 0
        for tool_id, category, description, intents in tools:
            tool_file.write(json.dumps({"tool_id": tool_id, "name": tool_id, "description": description,
                                        "category": category}) + "\n")
            for intent in intents:
                for _ in range(6):
                    text = f"{rng.choice(OPENERS)} {intent}{rng.choice(SUFFIXES)}"
                    queries.write(json.dumps({"query": text, "tool_id": tool_id,
                                              "category": category, "qid": f"q{n}"}) + "\n")
                    n += 1


@pytest.fixture
def tiny_dataset(tmp_path):
    folder = tmp_path / "tiny"
    _write_dataset(folder, [
        (tool_id, category, f"{tool_id.capitalize()} service: " + ", ".join(intents[:2]), intents)
        for tool_id, (category, intents) in TOOLS.items()
    ])
    return folder


@pytest.fixture
def twin_dataset(tmp_path):
    """Each tool of TOOLS split in two twins that share one plain description ("Weather
    service") and half the intents each: descriptions cannot tell twins apart, and a public probe
    set of one request per tool (`--probe-fraction 0.05`) covers one of a twin's three intents;
    only the clients' experience, which grows over the rounds, covers the rest."""
    folder = tmp_path / "twins"
    _write_dataset(folder, [
        (f"{tool_id}_{twin}", category, f"{tool_id.capitalize()} service", own)
        for tool_id, (category, intents) in TOOLS.items()
        for twin, own in (("a", intents[::2]), ("b", intents[1::2]))
    ])
    return folder
