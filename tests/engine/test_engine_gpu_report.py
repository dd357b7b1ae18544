"""The GPU report's bookkeeping, on the CPU: busy time is the union of kernel intervals, the
steady-decode set-up leaves every sequence decoding, the throughput loop counts every token, and the
profile section sorts kernels into classes by name and holds each class to a floor from the model's shapes."""
from engine_helpers import tiny
from engine import gpu_report
from engine.llm_engine import LLMEngine


def test_busy_time_is_the_union_of_overlapping_kernels():
    assert gpu_report._busy_us([(0, 10), (5, 12), (20, 25), (21, 22)]) == 17
    assert gpu_report._busy_us([]) == 0


def test_steady_decode_and_throughput_on_a_tiny_engine():
    engine = LLMEngine(tiny(**{"max-model-len": 4096, "kv-cache-memory": 1 << 24, "max-num-batched-tokens": 64}))
    gpu_report._steady_decode(engine, batch=3, prompt_len=50, seed=1)
    assert len(engine.scheduler.running) == 3
    assert all(s.num_computed_tokens == len(s) - 1 for s in engine.scheduler.running)
    for rid in list(engine._requests):
        engine.abort(rid)
    r = gpu_report._throughput(engine, num_prompts=4, input_len=30, output_len=5, seed=2)
    assert r["output_tok_s"] * r["elapsed_s"] == 20 and not engine.has_unfinished()


GPU_SCRIPT_IMPORTS = r"""
import sys
import torch, triton, numpy, yaml  # what the GPU machine has, loaded first
before = {m.partition(".")[0] for m in sys.modules}
for name in ("pydantic", "pydantic_core", "fastapi", "starlette", "uvicorn", "sqlite_utils", "ruamel", "rich",
             "typer", "httpx", "prometheus_client", "psutil"):
    sys.modules[name] = None  # not installed there: importing one fails
import engine.gpu_report, kernels.gdn_report, kernels.check, engine.bench
added = {m.partition(".")[0] for m, mod in sys.modules.items() if mod is not None} - before
added -= set(sys.stdlib_module_names)
assert added <= {"engine", "kernels"}, added
from engine import LLM
from engine.model_config import PRESETS
assert PRESETS[engine.gpu_report.MODELS[0]].is_hybrid and not PRESETS[engine.gpu_report.MODELS[1]].is_hybrid
out = LLM({"model": "tiny-hybrid", "device": "cpu", "dtype": "float32", "max-model-len": 64,
           "kv-cache-memory": 1 << 20, "max-num-seqs": 2}).generate([[1, 2, 3]], 3)
assert len(out[0]) == 3
print("ok")
"""


def test_gpu_scripts_and_the_engine_need_only_torch_triton_numpy_and_yaml():
    """The GPU machine has no pydantic, fastapi or the orchestrator's other dependencies: the reports
    and the engine they drive must import and run without them."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(repo)}
    p = subprocess.run([sys.executable, "-c", GPU_SCRIPT_IMPORTS], env=env, capture_output=True, text=True,
                       timeout=300, cwd=repo)
    assert p.returncode == 0 and p.stdout.strip() == "ok", p.stderr[-3000:]


def test_cpu_smoke_run_covers_the_graph_and_engine_sections_on_the_hybrid_model(tmp_path):
    """The report's own code paths (the GPU runs them at Qwen3.6-35B-A3B dimensions): static steps
    on the tiny presets give the eager tokens, and the engine section measures every run."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    env = {**os.environ, "OUT": str(tmp_path), "PYTHONPATH": str(repo)}
    env.pop("TRITON_INTERPRET", None)
    p = subprocess.run([sys.executable, "-m", "engine.gpu_report", "--device", "cpu"], env=env, capture_output=True,
                       text=True, timeout=600, cwd=repo)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "FAILED" not in p.stdout and "Traceback" not in p.stderr, p.stdout[-3000:] + p.stderr[-3000:]
    report = json.loads((tmp_path / "gpu_report.json").read_text())
    graphs = report["graphs"]
    assert set(graphs) == {"tiny, float32", "tiny-hybrid, float32"} and graphs["tiny-hybrid, float32"]["hybrid"]
    for run in graphs.values():
        assert run["identical_to_static_eager"] and run["identical_to_eager"] and run["static_steps"] > 0
    engine = report["engine"]
    assert engine["model"] == "tiny-hybrid" and engine["static_steps"] > 0
    for key in ("decode_step_eager", "decode_step_graphs", "throughput_graphs", "throughput_graphs_async",
                "throughput_eager"):
        assert key in engine, key
    assert engine["throughput_graphs"]["output_tok_s"] > 0 and engine["async_scheduling_identical"]
    assert len(report["profile"]["batches"]) == len(gpu_report.SMOKE.profile_batches)  # a default section too


def test_cpu_smoke_run_of_the_gdn_section_counts_kernels_per_layer_and_times_the_fused_ops(tmp_path):
    """Under the interpreter (float16, so that casts count as on a GPU): a Gated DeltaNet layer's
    decode step with gdn-fused torch and triton, and each fused op timed against its torch one."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    env = {**os.environ, "OUT": str(tmp_path), "PYTHONPATH": str(repo), "TRITON_INTERPRET": "1"}
    p = subprocess.run([sys.executable, "-m", "engine.gpu_report", "--device", "cpu", "--sections", "gdn"], env=env,
                       capture_output=True, text=True, timeout=900, cwd=repo)
    assert p.returncode == 0 and "FAILED" not in p.stdout, p.stdout[-3000:] + p.stderr[-3000:]
    gdn = json.loads((tmp_path / "gpu_report.json").read_text())["gdn"]
    layer = {row["gdn_fused"]: row for row in gdn["layer"]}
    assert layer["triton"]["kernels"] <= 15 < layer["torch"]["kernels"]
    assert layer["triton"]["mixer_kernels"] == 6 and "triton:_conv_kernel" in layer["triton"]["kernel_names"]
    assert {(row["op"], row["prefill"]) for row in gdn["ops"]} == {
        (op, prefill) for op in ("causal_conv1d", "gdn_gating", "rms_norm_gated") for prefill in (False, True)}
    assert all(row["torch_ms"] > 0 and row["triton_ms"] > 0 and row["floor_ms"] > 0 for row in gdn["ops"])
    # the alignment's prefix sums in its scatter launch at decode sizes; cuBLAS adds a split-K reduce to the router's
    # GEMM on an H100 (15 there: the profile in BENCHMARKS.md)
    assert "gdn-fused triton | 14 kernels (token mixer 6)" in p.stdout


# the kernel names the profile section sorts: this project's Triton kernels, then names cuBLAS, CUTLASS
# and torch give on an H200, then a CPU smoke run's op names
KERNEL_NAMES = {
    gpu_report.MOE_GEMMS: [
        "_grouped_gemm",
        "void cutlass::device_kernel<at::cuda::detail::enable_3x_kernel_for_sm9x<cutlass::gemm::kernel::"
        "GemmUniversal<cutlass::gemm::GroupProblemShape<cute::tuple<int, int, int> >, cute::tuple<int, int, int>>>>",
        "aten::_grouped_mm",
    ],
    gpu_report.ROUTING: [
        "_route_kernel", "_align_count_kernel", "_align_scan_kernel", "_align_scatter_kernel",
        "void at::native::sbtopk::gatherTopK<float, unsigned int, 2, false>(at::cuda::detail::TensorInfo<float const, "
        "unsigned int>, unsigned int, unsigned int, bool, unsigned int)",
        "void at::native::mbtopk::radixFindKthValues<float, unsigned int, unsigned int, 2>(...)",
        "void (anonymous namespace)::cunn_SoftMaxForward<4, float, float, float, (anonymous namespace)::"
        "SoftMaxForwardEpilogue>(float*, float const*, int)",
        "void at_cuda_detail::cub::DeviceRadixSortOnesweepKernel<at_cuda_detail::cub::DeviceRadixSortPolicy<long, "
        "long, unsigned int>::Policy900, false, long, long, unsigned int, int, int>(...)",
        "void at::native::_scatter_gather_elementwise_kernel<128, 8, at::native::_cuda_scatter_gather_internal_kernel"
        "<true, long>::operator()<at::native::ReduceAdd>(...)",
        "void at::native::indexFuncLargeIndex<float, long, unsigned int, 2, 2, -2, true, at::native::ReduceAdd>(...)",
        "aten::topk", "aten::_softmax", "aten::sort", "aten::scatter_add_", "aten::index_add_",
    ],
    gpu_report.GDN: [
        "_recurrent_kernel", "_chunk_prepare_kernel", "_chunk_scan_kernel", "_conv_kernel", "_gating_kernel",
        "_norm_gated_kernel",
        "void at::native::vectorized_elementwise_kernel<4, at::native::(anonymous namespace)::softplus_kernel("
        "at::TensorIteratorBase&, c10::Scalar const&, c10::Scalar const&)::{lambda()#1}, std::array<char*, 2ul> >",
        "void at::native::index_elementwise_kernel<128, 4, at::native::gpu_index_kernel<at::native::"
        "index_copy_kernel_impl<at::native::OpaqueType<4> >(...)",
        "aten::softplus", "aten::index_copy_", "aten::index_fill_", "aten::conv1d",
    ],
    gpu_report.ATTENTION: [
        "_split_kernel", "_reduce_kernel", "_prefill_kernel",
        "void at::native::index_elementwise_kernel<128, 4, at::native::gpu_index_kernel<at::native::"
        "index_put_kernel_impl<at::native::OpaqueType<2> >(at::TensorIterator&, c10::ArrayRef<long>)>",
        "aten::index_put_", "aten::_index_put_impl_",
    ],
    gpu_report.NORMS: [
        "_rms_norm_kernel", "_qk_norm_rope_kernel",
        "void at::native::vectorized_elementwise_kernel<4, at::native::cos_kernel_cuda(at::TensorIteratorBase&)::"
        "{lambda()#2}::operator()() const::{lambda(float)#1}, std::array<char*, 2ul> >(int, ...)",
        "void at::native::(anonymous namespace)::vectorized_layer_norm_kernel<c10::BFloat16, float, true>(...)",
        "aten::rms_norm", "aten::_fused_rms_norm", "aten::rsqrt", "aten::cos", "aten::sin",
    ],
    gpu_report.PROJECTIONS: [
        "nvjet_tst_192x128_64x4_2x1_v_bz_coopB_TNT",
        "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_execute_segment_k_off_"
        "kernel__5x_cublas",
        "ampere_bf16_s16816gemm_bf16_128x64_ldg8_f2f_stages_64x3_tn",
        "void cutlass::Kernel2<cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16_16x16_128x2_tn_align8>(cutlass_80_"
        "wmma_tensorop_bf16_s161616gemm_bf16_16x16_128x2_tn_align8::Params)",
        "void gemv2T_kernel_val<int, int, __nv_bfloat16, __nv_bfloat16, float, float, 128, 16, 4, 4, false, false, "
        "cublasGemvParamsEx<int, cublasGemvTensorStridedBatched<__nv_bfloat16 const> > >(...)",
        "void cublasLt::splitKreduce_kernel<32, 16, int, float, __nv_bfloat16, float, __nv_bfloat16>(...)",
        "aten::mm", "aten::addmm", "aten::linear",
    ],
    gpu_report.REST: [  # torch's elementwise and reduce kernels: the output gate, the MoE's sum, argmax, casts
        "void at::native::vectorized_elementwise_kernel<4, at::native::sigmoid_kernel_cuda(at::TensorIteratorBase&)"
        "::{lambda()#2}::operator()() const::{lambda(c10::BFloat16)#1}, std::array<char*, 2ul> >(int, ...)",
        "void at::native::vectorized_elementwise_kernel<4, at::native::BinaryFunctor<c10::BFloat16, c10::BFloat16, "
        "c10::BFloat16, at::native::binary_internal::MulFunctor<float> >, std::array<char*, 3ul> >(int, ...)",
        "void at::native::reduce_kernel<512, 1, at::native::ReduceOp<c10::BFloat16, at::native::func_wrapper_t<"
        "c10::BFloat16, at::native::sum_functor<c10::BFloat16, float, c10::BFloat16>::operator()(at::TensorIterator&)"
        "::{lambda(float, float)#1}>, unsigned int, c10::BFloat16, 4, 4> >(...)",
        "void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::ArgMaxOps<float>, unsigned "
        "int, long, 4, 4> >(...)",
        "void at::native::(anonymous namespace)::indexSelectLargeIndex<c10::BFloat16, long, unsigned int, 2, 2, -2, "
        "true>(...)",
        "void at::native::unrolled_elementwise_kernel<at::native::direct_copy_kernel_cuda(at::TensorIteratorBase&)"
        "::{lambda()#3}::operator()() const::{lambda(float)#1}>(...)",
        "aten::mul", "aten::sigmoid", "aten::sum", "aten::argmax", "aten::acos", "aten::sinh", "aten::index",
    ],
}


def test_kernels_are_sorted_into_classes_by_their_names():
    assert set(KERNEL_NAMES) == set(gpu_report.KERNEL_CLASSES)
    wrong = {name: (cls, gpu_report.kernel_class(name)) for cls, names in KERNEL_NAMES.items() for name in names
             if gpu_report.kernel_class(name) != cls}
    assert not wrong, wrong


def _floor_config(shared: int):
    """One Gated DeltaNet layer and one attention layer, numbers small enough to work out by hand."""
    from engine.model_config import ModelConfig
    return ModelConfig(vocab_size=10, hidden_size=8, num_layers=2, num_heads=2, num_kv_heads=1, head_size=8,
                       num_experts=4, top_k=2, moe_intermediate_size=4, shared_expert_intermediate_size=shared,
                       layer_types=("linear_attention", "full_attention"), linear_num_key_heads=1,
                       linear_num_value_heads=2, linear_key_head_dim=4, linear_value_head_dim=4,
                       linear_conv_kernel_dim=4)


def test_decode_floors_by_hand_on_a_two_layer_model():
    """Batch 2, context 10, 2-byte elements; h 8, 4 experts of intermediate 4, top-2, a shared expert of
    the experts' size (folded: a fifth expert every token takes)."""
    g = gpu_report
    floors = g.decode_floors(_floor_config(shared=4), batch=2, context=10, elt=2, state_elt=4)
    # experts hit: 4 (1 - (1 - 2/4)^2) = 3, plus the shared one; 3 * 8 * 4 = 96 weights each; x in, out: 2 * 2 * 8
    # per layer; 2 tokens x 3 pairs x 3 * 8 * 4 multiply-adds per layer
    assert floors[g.MOE_GEMMS] == (2 * (4 * 96 + 32) * 2, 2 * 2 * 6 * 96)
    # logits 2 x 5 x 2 bytes; 6 pairs: weight + id written (8 bytes), id read + order written (8 bytes)
    assert floors[g.ROUTING] == (2 * (20 + 6 * 16), 0)
    # state 2 heads x 4 x 4 x 4 bytes = 128 read and written; conv state 16 channels x 3 x 2 bytes = 96 read and
    # written; in_proj's 16 + 8 + 2 * 2 = 28 outputs read, the norm's 8 written; conv weights 16 x 4 x 2 once
    assert floors[g.GDN] == (2 * (2 * 128 + 2 * 96 + (28 + 8) * 2) + 16 * 4 * 2, 0)
    # K and V of 10 tokens x 1 kv head x 8, the new K and V, q and out of 2 heads x 8: 26 x 8 x 2 bytes per sequence
    assert floors[g.ATTENTION] == (2 * 26 * 8 * 2, 4 * 2 * 10 * 2 * 8)
    # 5 norms reading and writing x and residual (4 x 8 x 2 bytes a token); q (2 x 8) and k (1 x 8) read and written
    assert floors[g.NORMS] == ((5 * 4 * 8 + 2 * 3 * 8) * 2 * 2, 0)
    # (out, in): router (5, 8) x 2 layers, qkv (2 * 2 * 8 + 2 * 8, 8), o (8, 16), in (28, 8), out (8, 8), lm_head
    # (10, 8): 80 + 384 + 128 + 224 + 64 + 80 = 960 weights; inputs and outputs 2 * 13 + 56 + 24 + 36 + 16 + 18 a token
    assert floors[g.PROJECTIONS] == (960 * 2 + 2 * 176 * 2, 2 * 2 * 960)
    # without the shared expert: 3 experts per layer, 4 pairs per token pair, a 4-row router
    floors = g.decode_floors(_floor_config(shared=0), batch=2, context=10, elt=2, state_elt=4)
    assert floors[g.MOE_GEMMS] == (2 * (3 * 96 + 32) * 2, 2 * 2 * 4 * 96)
    assert floors[g.ROUTING] == (2 * (2 * 4 * 2 + 4 * 16), 0)
    # a 16-bit recurrent state: 64 bytes read and written instead of 128, the rest of the layer as before
    half = g.decode_floors(_floor_config(shared=0), batch=2, context=10, elt=2, state_elt=2)
    assert half[g.GDN][0] == floors[g.GDN][0] - 2 * 2 * 64


def test_floor_is_bytes_at_copy_bandwidth_or_flops_at_matmul_peak_whichever_is_longer():
    floors = {"a": (4e9, 1e12), "b": (1e9, 8e12), "c": (2e9, 0)}
    ms = gpu_report.floor_ms(floors, copy_gbps=2000, mm_tflops=1000)
    assert ms == {"a": 2.0, "b": 8.0, "c": 1.0}


def test_class_rows_per_step_with_shares_and_the_largest_gap_first():
    g = gpu_report
    kernels = [("_grouped_gemm", 300.0), ("_grouped_gemm", 100.0), ("nvjet_tst_x", 200.0), ("aten::mul", 400.0)]
    rows = g.class_rows(kernels, steps=2, floors={g.MOE_GEMMS: 0.1, g.PROJECTIONS: 0.05, g.ATTENTION: 0.01})
    assert [r["class"] for r in rows][:3] == [g.REST, g.MOE_GEMMS, g.PROJECTIONS]  # gaps 0.2, 0.1, 0.05 ms
    assert rows[-1]["class"] == g.ATTENTION  # no kernel: a gap of -0.01 ms
    assert {r["class"] for r in rows} == set(g.KERNEL_CLASSES)
    moe = rows[1]
    assert moe["kernels"] == 1 and abs(moe["ms"] - 0.2) < 1e-12 and moe["share"] == 0.4
    assert abs(moe["ratio"] - 2) < 1e-9 and moe["top"] == {"_grouped_gemm": 0.2}
    assert rows[0]["ratio"] is None and rows[0]["floor_ms"] == 0
    assert abs(sum(r["share"] for r in rows) - 1) < 1e-12


def test_cpu_smoke_run_of_the_profile_section_fills_every_class_table(tmp_path):
    """Both batches profiled on tiny-hybrid; the CPU ops' names give the attention, Gated DeltaNet,
    norms, routing and projection classes kernels of their own."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    env = {**os.environ, "OUT": str(tmp_path), "PYTHONPATH": str(repo)}
    env.pop("TRITON_INTERPRET", None)
    p = subprocess.run([sys.executable, "-m", "engine.gpu_report", "--device", "cpu", "--sections", "profile"],
                       env=env, capture_output=True, text=True, timeout=600, cwd=repo)
    assert p.returncode == 0 and "FAILED" not in p.stdout, p.stdout[-3000:] + p.stderr[-3000:]
    profile = json.loads((tmp_path / "gpu_report.json").read_text())["profile"]
    assert profile["model"] == "tiny-hybrid" and profile["copy_gbps"] > 0 and profile["matmul_tflops"] > 0
    assert [b["batch"] for b in profile["batches"]] == list(gpu_report.SMOKE.profile_batches)
    for b in profile["batches"]:
        rows = {r["class"]: r for r in b["rows"]}
        assert list(rows) == [r["class"] for r in b["rows"]] and set(rows) == set(gpu_report.KERNEL_CLASSES)
        assert b["context"] > gpu_report.SMOKE.prompt_len
        assert abs(sum(r["share"] for r in b["rows"]) - 1) < 1e-6
        assert abs(sum(r["ms"] for r in b["rows"]) - b["kernel_ms"]) < 1e-9
        gaps = [r["ms"] - r["floor_ms"] for r in b["rows"]]
        assert gaps == sorted(gaps, reverse=True)
        assert all(r["floor_ms"] > 0 for c, r in rows.items() if c != gpu_report.REST)
        assert rows[gpu_report.REST]["floor_ms"] == 0 and rows[gpu_report.REST]["ratio"] is None
        assert abs(b["floor_ms"] - sum(r["floor_ms"] for r in b["rows"])) < 1e-9
        for cls in (gpu_report.ATTENTION, gpu_report.GDN, gpu_report.NORMS, gpu_report.ROUTING, gpu_report.PROJECTIONS):
            assert rows[cls]["kernels"] > 0 and rows[cls]["ms"] > 0, cls
    assert f"batch {gpu_report.SMOKE.profile_batches[-1]}: {gpu_report.MOE_GEMMS}" in p.stdout


def test_thread_cpu_tells_the_main_thread_from_the_others():
    import os
    import threading
    import time

    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            pass

    before = gpu_report._thread_cpu(os.getpid())
    worker = threading.Thread(target=spin)
    worker.start()
    try:
        time.sleep(0.5)  # the main thread waits: the spinning one is busy
        during = gpu_report._thread_cpu(os.getpid())  # a thread's CPU is listed while it lives
    finally:
        stop.set()
        worker.join()
    assert during["others"] - before["others"] >= 0.2
    assert during["main"] - before["main"] < 0.2


def test_the_served_section_streams_the_engine_sections_workload_through_the_engine_server(tmp_path):
    """A smoke run on the CPU: the same engine config served, every token of the batch streamed back and counted,
    its throughput set beside the offline one, the server's steps and its threads' CPU read."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    env = {**os.environ, "OUT": str(tmp_path), "PYTHONPATH": str(repo)}
    p = subprocess.run([sys.executable, "-m", "engine.gpu_report", "--device", "cpu", "--sections", "engine,served"],
                       env=env, capture_output=True, text=True, timeout=600, cwd=repo)
    assert p.returncode == 0, p.stderr[-3000:]
    report = json.loads((tmp_path / "gpu_report.json").read_text())
    sizes = gpu_report.SMOKE
    assert [s["stream_interval"] for s in report["served"]] == [1, 4]
    for served in report["served"]:
        assert round(served["output_tok_s"] * served["elapsed_s"]) == sizes.num_prompts * sizes.output_len
        offline = report["engine"]["throughput_graphs"]["output_tok_s"]
        assert served["served_over_offline"] == served["output_tok_s"] / offline
        assert served["server_steps"] >= sizes.output_len and 0 < served["step_busy"]
        assert set(served["thread_cpu_per_s"]) == {"main", "others"}
    assert not any("FAILED" in value for _, value, _ in report["summary"])


def test_the_state_dtype_option_reaches_the_engine_config():
    """--state-dtype sets the recurrent state of the engine and profile sections (the model's float32 by default)."""
    import argparse
    import torch
    from engine.config import load_config
    for given, want in (("auto", torch.float32), ("bfloat16", torch.bfloat16)):
        args = argparse.Namespace(device="cuda", model=gpu_report.MODELS[0], layers=4, state_dtype=given)
        assert load_config(gpu_report._engine_config(args)).state_dtype() == want
