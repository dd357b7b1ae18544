"""Byte-level tokenizer: token id = UTF-8 byte, so any text round-trips without a vocabulary file.

Ids 256 and above (the model's vocabulary is larger) stand for no text and decode to nothing.
"""
from __future__ import annotations

NUM_BYTES = 256


def encode(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def count(text: str) -> int:
    """How many tokens ``encode`` makes of ``text``, without making them."""
    return len(text.encode("utf-8"))


def decode(token_ids: list[int]) -> str:
    return bytes(t for t in token_ids if 0 <= t < NUM_BYTES).decode("utf-8", errors="replace")
