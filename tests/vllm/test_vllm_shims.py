"""The kernel shims and the patched vLLM call sites, run on the CPU.

The patched vLLM function is cut out of the patched 0.10.2 file and executed with vLLM's native op
replaced by a recorder, so both paths are observed: the project's kernel answering (checked against
the float64 reference) and the fallback to vLLM's own op on any failure.
"""
from __future__ import annotations

import ast
import importlib.util
import sys
import types
from typing import Optional

import pytest
import torch

import kernels
from kernels import inputs

from vllm_source import OPTIMIZATIONS, patched_files


def load_shim(plugin: str, name: str, monkeypatch) -> types.ModuleType:
    """The shim from the plugin's files/, importable as vllm.<name> as the patched call site expects."""
    path = OPTIMIZATIONS / plugin / "files" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    package = types.ModuleType("vllm")
    package.__path__ = []
    monkeypatch.setitem(sys.modules, "vllm", package)
    for parent in ("vllm.attention", "vllm.attention.ops", "vllm.attention.backends"):
        sub = types.ModuleType(parent)
        sub.__path__ = []
        monkeypatch.setitem(sys.modules, parent, sub)
    return module


def cut_function(source: bytes, name: str, namespace: dict):
    """Define the top-level function `name` of `source` in `namespace` and return it."""
    tree = ast.parse(source)
    node = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name)
    exec(compile(ast.Module([node], []), "<patched>", "exec"), namespace)
    return namespace[name]


class Native:
    """Stands in for vLLM's own op; records that the fallback ran."""

    def __init__(self):
        self.calls = 0

    def __call__(self, *args, **kwargs):
        self.calls += 1


@pytest.fixture
def patched_v2(vllm_pinned, monkeypatch):
    def make(plugin, shim_name):
        shim = load_shim(plugin, shim_name, monkeypatch)
        monkeypatch.setitem(sys.modules, f"vllm.{shim_name}", shim)
        native = Native()
        fake_torch = types.SimpleNamespace(Tensor=torch.Tensor,
                                           ops=types.SimpleNamespace(_C=types.SimpleNamespace(paged_attention_v2=native)))
        source = patched_files(vllm_pinned, plugin)[vllm_pinned / "_custom_ops.py"]
        fn = cut_function(source, "paged_attention_v2", {"torch": fake_torch, "Optional": Optional})
        return fn, native, shim
    return make


def decode_call(fn, alibi=None, kv_cache_dtype="auto"):
    args = inputs.paged_decode([1, 17, 40], num_heads=4, num_kv_heads=2, head_size=32, seed=1)
    out = torch.full_like(args["query"], float("nan"))
    scratch = torch.empty(0)
    fn(out, scratch, scratch, scratch, args["query"], args["key_cache"], args["value_cache"], 2, args["scale"],
       args["block_tables"], args["seq_lens"], 16, 40, alibi, kv_cache_dtype, torch.tensor(1.0), torch.tensor(1.0))
    return out, kernels.get("paged_decode", "reference")(**args)


@pytest.mark.parametrize("plugin, shim", [("decode-v2-triton", "_orchestrator_decode_v2_triton"),
                                          ("decode-v2-layout", "_orchestrator_decode_v2_layout")])
def test_decode_call_site_uses_the_project_kernel(patched_v2, plugin, shim):
    fn, native, _ = patched_v2(plugin, shim)
    out, ref = decode_call(fn)
    assert native.calls == 0
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)


def test_decode_call_site_falls_back_for_unsupported_inputs(patched_v2):
    fn, native, shim = patched_v2("decode-v2-triton", "_orchestrator_decode_v2_triton")
    decode_call(fn, alibi=torch.zeros(4))
    decode_call(fn, kv_cache_dtype="fp8")
    assert native.calls == 2
    assert shim._adapter.failure is None  # unsupported inputs do not disable the kernel
    decode_call(fn)
    assert native.calls == 2


def test_decode_call_site_falls_back_and_stops_trying_after_a_failure(patched_v2, monkeypatch):
    fn, native, shim = patched_v2("decode-v2-triton", "_orchestrator_decode_v2_triton")
    tries = []

    def broken(*args, **kwargs):
        tries.append(1)
        raise RuntimeError("out of shared memory")

    real_get = kernels.get
    monkeypatch.setattr(kernels, "get", lambda op, variant: real_get(op, variant) if variant == "reference" else broken)
    decode_call(fn)
    decode_call(fn)
    assert native.calls == 2 and len(tries) == 1
    assert "out of shared memory" in shim._adapter.failure


class FellBack(Exception):
    pass


class VllmBody:
    """vLLM's own prefill body starts by reading IS_TURING: reaching it means the fallback ran."""

    def __bool__(self):
        raise FellBack()


@pytest.fixture
def patched_prefill(vllm_pinned, monkeypatch):
    shim = load_shim("prefill-triton", "_orchestrator_prefill_triton", monkeypatch)
    monkeypatch.setitem(sys.modules, "vllm.attention.ops._orchestrator_prefill_triton", shim)
    source = patched_files(vllm_pinned, "prefill-triton")[vllm_pinned / "attention/ops/prefix_prefill.py"]
    return cut_function(source, "context_attention_fwd", {"torch": torch, "IS_TURING": VllmBody()}), shim


def prefill_call(fn, seqs, **kwargs):
    """vLLM's arguments: b_seq_len is context + new tokens; returns (o, reference)."""
    args = inputs.prefix_prefill(seqs, num_heads=4, num_kv_heads=2, head_size=32, seed=2)
    o = torch.full_like(args["query"], 7.0)
    qsl = args["query_start_loc"]
    seq_len = args["context_lens"] + (qsl[1:] - qsl[:-1])
    fn(args["query"], args["key"], args["value"], o, "auto", args["key_cache"], args["value_cache"],
       args["block_tables"], qsl, seq_len, None, max(n for _, n in seqs), torch.tensor(1.0), torch.tensor(1.0),
       **kwargs)
    return o, kernels.get("prefix_prefill", "reference")(**args)


def test_prefill_call_site_uses_the_project_kernel(patched_prefill):
    fn, _ = patched_prefill
    o, ref = prefill_call(fn, [(0, 9), (17, 20), (5, 3)])
    torch.testing.assert_close(o, ref, rtol=1e-4, atol=1e-4)


def test_prefill_skip_decode_leaves_single_token_rows_alone(patched_prefill):
    fn, _ = patched_prefill
    o, ref = prefill_call(fn, [(17, 1), (5, 6)], skip_decode=True)
    assert torch.equal(o[0], torch.full_like(o[0], 7.0))
    torch.testing.assert_close(o[1:], ref[1:], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kwargs", [{"alibi_slopes": torch.zeros(4)}, {"sliding_window": 128},
                                    {"sinks": torch.zeros(4)}])
def test_prefill_call_site_falls_back_for_unsupported_inputs(patched_prefill, kwargs):
    fn, shim = patched_prefill
    with pytest.raises(FellBack):
        prefill_call(fn, [(0, 9)], **kwargs)
    assert shim._failure is None


def test_head_mapping_shim_turns_the_int_into_the_tensor(monkeypatch):
    shim = load_shim("fork-head-mapping-tensor", "_orchestrator_head_mapping", monkeypatch)
    seen = {}

    def native_v1(out, query, key_cache, value_cache, head_mapping, scale):
        seen["mapping"], seen["scale"] = head_mapping, scale

    query = torch.zeros(3, 8, 16)
    shim.with_head_mapping(native_v1)(None, query, None, None, 2, 0.5)
    assert seen["mapping"].tolist() == [0, 0, 0, 0, 1, 1, 1, 1] and seen["mapping"].dtype == torch.int32
    assert seen["scale"] == 0.5
    tensor = torch.tensor([0, 1], dtype=torch.int32)
    shim.with_head_mapping(native_v1)(None, query, None, None, tensor, 0.5)
    assert seen["mapping"] is tensor
    with pytest.raises(ValueError, match="do not split evenly"):
        shim.head_mapping(3, 8, "cpu")


def test_flash_prefill_shim_tries_flash_then_falls_back_for_good(monkeypatch):
    shim = load_shim("fork-xformers-flash-prefill", "_orchestrator_flash_prefill", monkeypatch)
    calls = {"flash": 0, "sdpa": 0}

    def flash_attn_func(q, k, v, causal):
        calls["flash"] += 1
        assert causal and q.shape == (1, 5, 4, 8)  # flash-attention's [batch, tokens, heads, d]
        if calls["flash"] > 1:
            raise RuntimeError("head_dim unsupported")
        return q

    functions = types.SimpleNamespace(flash_attn_func=flash_attn_func)
    monkeypatch.setitem(sys.modules, "ixformer", types.SimpleNamespace(functions=functions))

    class Backend:
        @shim.flash_first
        def _run_sdpa_fallback(self, query, key, value):
            calls["sdpa"] += 1
            return torch.nn.functional.scaled_dot_product_attention(query, key, value, is_causal=True)

    q = torch.randn(1, 4, 5, 8)  # SDPA's [batch, heads, tokens, d]
    assert torch.equal(Backend()._run_sdpa_fallback(q, q, q), q)
    assert calls == {"flash": 1, "sdpa": 0}
    Backend()._run_sdpa_fallback(q, q, q)  # flash fails: SDPA answers, and flash is not tried again
    Backend()._run_sdpa_fallback(q, q, q)
    assert calls == {"flash": 2, "sdpa": 2}
    assert "head_dim unsupported" in shim._failure
