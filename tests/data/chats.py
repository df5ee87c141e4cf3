"""Conversation corpora for the loss-mask tests: seeded records of every shape, with text that tries the span
boundaries (replies ending in punctuation or newlines, colons, CJK, "…\\n", empty and multi-paragraph turns)."""

import json
from pathlib import Path

import numpy as np

WORDS = ["hello", "world", "the", "RWKV", "model", "2+2", "is", "4", "ok", "yes", "no", "你好", "世界", "naïve",
         "don't", "e.g.", "x:", "(think)", "<think>", "</think>", "```json", "{\"a\": 1}", "Assistant:", "User:"]
ENDS = ["", ".", "!", "?", ":", "…", "\n", "\n\n", " ", "。", "，\n", "…\n", "\t", "\r\n"]


def sentence(rng) -> str:
    words = rng.choice(WORDS, size=int(rng.integers(1, 9))).tolist()
    glue = rng.choice([" ", " ", " ", "\n", "\n\n", ", "], size=len(words)).tolist()
    text = "".join(w + g for w, g in zip(words, glue, strict=True)).rstrip(" ")
    return text + str(rng.choice(ENDS))


def conversation(rng) -> dict:
    messages = []
    if rng.random() < 0.3:
        messages.append({"role": "system", "content": sentence(rng)})
    for _ in range(int(rng.integers(1, 4))):
        messages.append({"role": "user", "content": sentence(rng)})
        messages.append({"role": "assistant", "content": sentence(rng)})
    if rng.random() < 0.2:
        messages.append({"role": "user", "content": sentence(rng)})  # a conversation may end with the user
    return {"messages": messages, "id": int(rng.integers(1 << 30))}


def pair(rng) -> dict:
    return {"prompt": sentence(rng), "response": sentence(rng)}


def write_chats(path: Path, n: int, seed: int = 0, shape: str = "messages") -> list[dict]:
    rng = np.random.default_rng(seed)
    make = {"messages": conversation, "prompt": pair, "text": lambda r: {"text": sentence(r)}}[shape]
    records = [make(rng) for _ in range(n)]
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")
    return records
