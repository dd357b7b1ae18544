"""Paged KV blocks: allocation, reference counts, and prefix caching by hashing full blocks.

As in vLLM V1, a freed block keeps its hash and stays findable until it is handed out again;
free blocks are reused least recently freed first, a sequence's tail before its head.
"""
from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass

from engine.sequence import Sequence


def hash_block(parent: bytes | None, token_ids: list[int]) -> bytes:
    """A block's identity is its tokens and everything before them (the parent's hash)."""
    h = hashlib.blake2b(parent or b"", digest_size=16)
    h.update(array("q", token_ids).tobytes())
    return h.digest()


class Block:
    __slots__ = ("block_id", "ref_count", "hash")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.hash: bytes | None = None


@dataclass
class CacheHit:
    block_ids: list[int]
    hashes: list[bytes]


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool):
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._cached: dict[bytes, int] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def find_cached(self, seq: Sequence) -> CacheHit:
        """Leading full blocks of ``seq`` already cached; the last token is never a hit, so
        there is always at least one token to compute and sample from."""
        hit = CacheHit([], [])
        if not self.enable_prefix_caching:
            return hit
        bs, parent = self.block_size, None
        for i in range((len(seq) - 1) // bs):
            parent = hash_block(parent, seq.token_ids[i * bs:(i + 1) * bs])
            block_id = self._cached.get(parent)
            if block_id is None:
                break
            hit.block_ids.append(block_id)
            hit.hashes.append(parent)
        return hit

    def allocate_slots(self, seq: Sequence, num_new_tokens: int, hit: CacheHit | None = None) -> bool:
        """Give ``seq`` blocks for its computed tokens, ``hit``'s and ``num_new_tokens`` more.
        Returns False, changing nothing, when too few blocks are free."""
        hit_ids = hit.block_ids if hit else []
        bs = self.block_size
        num_tokens = seq.num_computed_tokens + len(hit_ids) * bs + num_new_tokens
        num_new_blocks = max(0, -(-num_tokens // bs) - len(seq.block_table) - len(hit_ids))
        revived = sum(1 for b in hit_ids if self.blocks[b].ref_count == 0)
        if num_new_blocks + revived > len(self._free):
            return False
        for block_id in hit_ids:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self._free[block_id]
            block.ref_count += 1
        if hit:
            seq.block_table.extend(hit_ids)
            seq.block_hashes.extend(hit.hashes)
            seq.num_computed_tokens += len(hit_ids) * bs
        seq.block_table.extend(self._take_free() for _ in range(num_new_blocks))
        return True

    def _take_free(self) -> int:
        block_id, _ = self._free.popitem(last=False)
        block = self.blocks[block_id]
        if block.hash is not None and self._cached.get(block.hash) == block_id:
            del self._cached[block.hash]
        block.hash = None
        block.ref_count = 1
        return block_id

    def free(self, seq: Sequence) -> None:
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[block_id] = None
        seq.block_table = []
        seq.block_hashes = []

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register the blocks that became full and computed, so later prompts can reuse them."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        for i in range(len(seq.block_hashes), seq.num_computed_tokens // bs):
            parent = seq.block_hashes[-1] if seq.block_hashes else None
            h = hash_block(parent, seq.token_ids[i * bs:(i + 1) * bs])
            seq.block_hashes.append(h)
            block = self.blocks[seq.block_table[i]]
            if h not in self._cached:  # an identical block computed twice: keep the first
                block.hash = h
                self._cached[h] = block.block_id
