"""vLLM's own Triton decode attention on this project's decode workloads (kernels/vllm_decode.py), the newest
release's source run under Triton's interpreter: with the caches converted to the Triton backends' layout it
gives the float64 reference's output for every KV split the GPU report tries, and a conversion that lays the
head dimension out wrongly does not."""
from __future__ import annotations

import importlib.util
import sys
import types
from pathlib import Path

import pytest
import torch

from kernels import inputs, reference, vllm_decode


def load_vllm_decode(package: Path, monkeypatch) -> types.ModuleType:
    """The release's triton_decode_attention module from the unpacked wheel, its two imports of vLLM's runtime
    (the platform, Triton's handles) stood in: the wheel's compiled parts are not unpacked here."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    import triton
    import triton.language as tl

    platforms = types.ModuleType("vllm.platforms")
    platforms.current_platform = types.SimpleNamespace(is_rocm=lambda: False)
    triton_utils = types.ModuleType("vllm.triton_utils")
    triton_utils.tl, triton_utils.triton = tl, triton
    for name, module in (("vllm", types.ModuleType("vllm")), ("vllm.platforms", platforms),
                         ("vllm.triton_utils", triton_utils)):
        monkeypatch.setitem(sys.modules, name, module)
    path = package / "v1/attention/ops/triton_decode_attention.py"
    spec = importlib.util.spec_from_file_location("vllm_triton_decode_attention", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def workload():
    # two sequences, one ending inside a block and one on a block's edge; GQA 4, the model's head size halved
    return inputs.paged_decode([37, 48], num_heads=8, num_kv_heads=2, head_size=64, block_size=16,
                               dtype=torch.float32, seed=5)


@pytest.mark.parametrize("splits", vllm_decode.SPLITS)
def test_vllm_triton_decode_on_converted_caches_matches_the_float64_reference(vllm_newest, monkeypatch, workload,
                                                                             splits):
    fwd = load_vllm_decode(vllm_newest, monkeypatch).decode_attention_fwd
    expected = reference.paged_decode(**workload)
    call = vllm_decode.prepared(fwd, **workload, num_kv_splits=splits)
    call().fill_(float("nan"))  # the output buffer poisoned: the next call must write every element
    got = call()
    assert torch.allclose(got.double(), expected.double(), atol=1e-4, rtol=1e-4), (got - expected).abs().max()


def test_a_head_dimension_laid_out_wrongly_is_caught(vllm_newest, monkeypatch, workload):
    fwd = load_vllm_decode(vllm_newest, monkeypatch).decode_attention_fwd
    k, v = vllm_decode.nhd_caches(workload["key_cache"], workload["value_cache"])
    blocks, block_size, heads, head = k.shape
    # x and head_size / x swapped: the same bytes, the head's elements in another order
    x = workload["key_cache"].shape[-1]
    wrong = workload["key_cache"].permute(0, 3, 1, 4, 2).reshape(blocks, block_size, heads, head).contiguous()
    seqs, qheads, _ = workload["query"].shape
    out = torch.empty_like(workload["query"])
    lse = torch.empty(seqs, qheads)
    logits = torch.empty(seqs, qheads, 8, head + 1)
    fwd(workload["query"], wrong, v, out, lse, workload["block_tables"], workload["seq_lens"], logits, 8,
        workload["scale"], page_size=block_size)
    assert x > 1 and not torch.allclose(out.double(), reference.paged_decode(**workload).double(), atol=1e-3)


def test_find_says_why_vllm_cannot_be_imported(monkeypatch):
    for name in vllm_decode.MODULES:
        monkeypatch.setitem(sys.modules, name, None)  # an import of it fails
    fwd, why = vllm_decode.find()
    assert fwd is None and all(name in why for name in vllm_decode.MODULES)


def test_the_gpu_report_sets_vllms_kernel_beside_its_own_only_where_they_agree(vllm_newest, monkeypatch, workload):
    import kernels
    from engine import gpu_report

    fwd = load_vllm_decode(vllm_newest, monkeypatch).decode_attention_fwd
    monkeypatch.setattr(gpu_report, "_ms", lambda fn, graph=False: (fn(), 2.0 if graph else 3.0)[1])
    ours = kernels.get("paged_decode", "v1")
    row = gpu_report._against_vllm(fwd, ours, workload, 1.0, lambda ms: 100 / ms, "2 x 48")
    assert row == dict(vllm_splits=vllm_decode.SPLITS[0], vllm_ms=3.0, vllm_pct=100 / 3, vllm_graph_ms=2.0,
                       vllm_graph_pct=50.0, vllm_over_v2_triton=2.0)

    def wrong(**a):
        return ours(**a) + 1.0

    assert gpu_report._against_vllm(fwd, wrong, workload, 1.0, lambda ms: 100 / ms, "2 x 48") == {
        "vllm": "no KV split agreed"}
