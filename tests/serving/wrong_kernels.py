"""Deliberately wrong decode kernels that still pass the engine's start-up self-check (it looks at
contexts of at most 600 tokens), as a size-dependent bug would: the seed's native V2 kernel was off
by 1.28 only on the long sequences routed to it."""
from kernels.decode_torch import paged_decode_v2


def off_by_constant_when_long(query, key_cache, value_cache, block_tables, seq_lens, scale):
    out = paged_decode_v2(query, key_cache, value_cache, block_tables, seq_lens, scale)
    return out + 1.28 * (seq_lens > 600).to(out.dtype)[:, None, None]


def crash_when_long(query, key_cache, value_cache, block_tables, seq_lens, scale):
    if int(seq_lens.max()) > 600:
        raise RuntimeError("illegal memory access")
    return paged_decode_v2(query, key_cache, value_cache, block_tables, seq_lens, scale)
