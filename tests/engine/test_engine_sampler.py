"""Greedy sampling over 16-bit logits picks what a float32 copy of them would, ties to the first index."""
from __future__ import annotations

import pytest
import torch

from engine.layers.sampler import greedy, greedy_ids


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_sixteen_bit_logits_give_the_float32_choice_and_the_first_of_ties(dtype):
    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(64, 1000, generator=gen) * 4).to(dtype)
    logits[0, 10] = logits[0, 900] = logits[0].max() + 1  # a tie: the first wins
    logits[1] = 0  # every entry tied
    ids = greedy_ids(logits)
    assert torch.equal(ids, logits.float().argmax(dim=-1))
    assert ids[0] == 10 and ids[1] == 0
    assert greedy(logits) == ids.tolist()
