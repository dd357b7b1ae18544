"""The GPU report's bookkeeping, on the CPU: busy time is the union of kernel intervals, the
steady-decode set-up leaves every sequence decoding, and the throughput loop counts every token."""
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
    for key in ("decode_step_eager", "decode_step_graphs", "throughput_graphs", "throughput_eager"):
        assert key in engine, key
    assert engine["throughput_graphs"]["output_tok_s"] > 0


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
    assert "gdn-fused triton | 14 kernels (token mixer 6)" in p.stdout
