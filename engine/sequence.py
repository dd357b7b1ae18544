"""One request as the scheduler sees it: its tokens, how many have KV in the cache, its blocks and
state slot."""
from __future__ import annotations

from enum import Enum, auto


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


class Sequence:
    def __init__(self, request_id: str, prompt_token_ids: list[int], max_tokens: int):
        self.request_id = request_id
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.max_tokens = max_tokens
        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = 0  # tokens whose K/V are in the cache
        self.num_cached_tokens: int | None = None  # prefix-cache hit at first scheduling
        self.block_table: list[int] = []
        self.block_hashes: list[bytes] = []  # hashes of the leading full, computed blocks
        self.state_slot: int | None = None  # Gated DeltaNet state slot while running (hybrid models)

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)

    def __repr__(self) -> str:
        return (f"Sequence({self.request_id!r}, tokens={len(self)}, computed={self.num_computed_tokens}, "
                f"{self.status.name})")
