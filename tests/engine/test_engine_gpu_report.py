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
