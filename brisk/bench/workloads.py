"""Workloads shared by the benchmarks, so their numbers describe the same requests."""

from __future__ import annotations

from brisk.model.tokenizer import Message

TOPICS = ["rivers", "the moon", "bread", "volcanoes", "chess", "bees", "glass", "trains"]
TEMPLATES = ["Explain {} in one paragraph.", "Write a short poem about {}.", "Give three facts about {}.",
             "Tell me the history of {}."]


def chat_prompts(num_prompts: int) -> list[list[Message]]:
    """Distinct one-line questions (no two share more than the chat template's prefix)."""
    prompts = []
    for i in range(num_prompts):
        text = TEMPLATES[i % len(TEMPLATES)].format(TOPICS[i // len(TEMPLATES) % len(TOPICS)])
        round_ = i // (len(TEMPLATES) * len(TOPICS))
        prompts.append([{"role": "user", "content": text + (f" (take {round_ + 1})" if round_ else "")}])
    return prompts
