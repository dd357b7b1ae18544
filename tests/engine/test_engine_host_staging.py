"""Eager steps stage their metadata in persistent host buffers: values come back exactly, in the
dtype asked for, across buffer growth and from one step to the next."""
import torch

from engine.host_staging import HostStaging


def test_values_round_trip_through_the_buffers_and_outgrown_ones_are_kept_for_the_step():
    staging = HostStaging(torch.device("cpu"), capacity=8)
    staging.begin_step()
    a = staging.tensor([1, 2, 3], torch.int64)
    b = staging.tensor(list(range(100, 120)), torch.int64)  # outgrows the 8-element buffer
    c = staging.tensor([7, 8], torch.int32)
    assert a.tolist() == [1, 2, 3] and b.tolist() == list(range(100, 120)) and c.tolist() == [7, 8]
    assert (a.dtype, b.dtype, c.dtype) == (torch.int64, torch.int64, torch.int32)
    assert len(staging._retired) == 1  # the outgrown buffer outlives the step's copies
    staging.begin_step()
    d = staging.tensor([5] * 30, torch.int64)
    assert d.tolist() == [5] * 30 and b.tolist() == list(range(100, 120))  # earlier tensors are not overwritten
    assert staging._retired == [] and staging._used[torch.int64] == 30
