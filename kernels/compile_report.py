"""Compile the Triton kernels for a GPU on a machine without one: the shared memory, registers and
spills of the launch configurations the wrappers choose, against the device's limits.

    python -m kernels.compile_report [--arch 90] [--shared-mem 232448] [--sms 132] [--cases decode,moe,gdn]
        [--json out.json]
    python -m kernels.compile_report --sweep [--sweep-tokens 8192]   # what a served step compiles after the
                                                                     # engine's GPU warm-up (engine/warm_up.py)

Triton compiles down to a cubin with the ``ptxas`` it ships, and that needs no GPU: this script
stands a driver in for the missing one (target ``sm_<arch>``), runs each case's wrapper on CPU
tensors shaped like the GPU's, and compiles every kernel it would launch instead of launching it.
The shared memory Triton reports is the figure it checks against the device before a launch (an
H200 allows 232,448 bytes per program), so a configuration that fits here fits there. It must run
in its own process: kernels already defined for Triton's interpreter cannot be compiled.

Prints one row per compiled kernel; exits 1 when one needs more shared memory than ``--shared-mem``.
"""
from __future__ import annotations

import os

if os.environ.get("TRITON_INTERPRET") == "1":
    raise SystemExit("kernels.compile_report compiles kernels: run it without TRITON_INTERPRET=1, in its own process")
os.environ["TRITON_INTERPRET"] = "0"

import argparse  # noqa: E402
import glob  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.backends.driver import DriverBase  # noqa: E402
from triton.runtime import driver  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

H200 = dict(arch=90, shared_mem=232448, sms=132)


class CompileOnlyDriver(DriverBase):
    """Enough of a driver for Triton to compile for ``target``; nothing can be launched."""

    def __init__(self, target: GPUTarget):
        self.target = target

    @classmethod
    def is_active(cls):
        return True

    def map_python_to_cpp_type(self, ty):
        raise NotImplementedError

    def get_current_target(self):
        return self.target

    def get_active_torch_device(self):
        return torch.device("cpu")

    def get_benchmarker(self):
        raise NotImplementedError

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_device_interface(self):
        return torch.cuda


def _resource_usage(cubin: bytes) -> dict:
    """Registers per thread and stack bytes per thread (where registers spill), read off the cubin."""
    tools = glob.glob(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump"))
    if not tools:
        return {}
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([tools[0], "-res-usage", f.name], capture_output=True, text=True).stdout
    m = re.search(r"REG:(\d+) STACK:(\d+) SHARED:\d+ LOCAL:(\d+)", out)
    return dict(registers=int(m[1]), stack=int(m[2]) + int(m[3])) if m else {}


class Recorder:
    """Replaces every launch by a compilation and keeps what each compiled kernel needs."""

    def __init__(self):
        self.rows: list[dict] = []
        self.case = self.dtype = ""
        self._run = JITFunction.run

    def __enter__(self):
        recorder = self

        def run(fn, *args, grid, warmup, **kwargs):
            t0 = time.perf_counter()
            kernel = recorder._run(fn, *args, grid=grid, warmup=True, **kwargs)
            recorder.add(fn, kernel, kwargs, time.perf_counter() - t0)
            return kernel

        JITFunction.run = run
        return self

    def __exit__(self, *exc):
        JITFunction.run = self._run

    def add(self, fn, kernel, kwargs, seconds):
        md = kernel.metadata
        consts = {k: v for k, v in kwargs.items() if k.isupper() and isinstance(v, (int, bool))}
        row = dict(case=self.case, dtype=self.dtype, kernel=fn.fn.__name__, num_warps=md.num_warps,
                   num_stages=md.num_stages, shared=md.shared, **consts)
        row.update(_resource_usage(kernel.asm["cubin"]), compile_s=round(seconds, 1))
        self.rows.append(row)


def cases(names: list[str], quick: bool = False):
    """(label, dtype, thunk) of each case: a wrapper called on CPU tensors shaped as on the GPU.
    ``quick``: the Qwen3.6-35B-A3B shapes in bfloat16 and the engine's float32 checks only."""
    import kernels
    from kernels import bench, inputs

    out = []
    if "decode" in names:
        fn = kernels.get("paged_decode", "v2_triton")
        for dtype in (torch.bfloat16,) if quick else (torch.bfloat16, torch.float16, torch.float32):
            args = inputs.paged_decode([600, 33], dtype=dtype, **bench.ATTENTION)
            out.append((f"v2_triton {_dt(dtype)} head 256", dtype, lambda a=args, f=fn: f(**a)))
        args = inputs.paged_decode([600, 33], num_heads=8, num_kv_heads=2, head_size=64, dtype=torch.float32)
        out.append(("v2_triton float32 small preset", torch.float32, lambda a=args, f=fn: f(**a)))
    if "prefill" in names:
        fn = kernels.get("prefix_prefill", "triton")
        for dtype in (torch.bfloat16,) if quick else (torch.bfloat16, torch.float32):
            args = inputs.prefix_prefill([(40, 70)], dtype=dtype, **bench.ATTENTION)
            out.append((f"triton {_dt(dtype)} head 256", dtype, lambda a=args, f=fn: f(**a, max_query_len=70)))
    if "moe" in names:
        fn = kernels.get("moe", "triton")
        sizes = [(torch.bfloat16, t) for t in ((256, 2048) if quick else (1, 8, 64, 256, 512, 2048, 16384))]
        for dtype, tokens in sizes + ([] if quick else [(torch.float32, t) for t in (1, 256, 4096)]):
            args = _moe_args(tokens, dtype, **bench.MOE)
            out.append((f"triton {_dt(dtype)} {tokens} tokens", dtype, lambda a=args, f=fn: f(**a)))
        # the engine's Qwen3.6 layers: a shared expert too, so 9 pairs a token (144 a routing program)
        args = dict(_moe_args(128, torch.bfloat16, **{**bench.MOE, "experts": bench.MOE["experts"] + 1}),
                    shared_experts=1)
        out.append(("triton bfloat16 128 tokens, shared expert", torch.bfloat16, lambda a=args, f=fn: f(**a)))
        small = dict(hidden=512, experts=32, intermediate=128, top_k=4)  # the engine's small preset
        for tokens in (12,) if quick else (12, 64, 1024):
            args = _moe_args(tokens, torch.float32, **small)
            out.append((f"triton float32 small preset {tokens} tokens", torch.float32,
                        lambda a=args, f=fn: f(**a)))
    if "gdn" in names:
        for variant in ("triton_chunk",) if quick else ("triton_chunk", "triton_recurrent"):
            fn = kernels.get("gated_delta_rule", variant)
            for dtype in (torch.bfloat16, torch.float32) if quick else (torch.bfloat16, torch.float16, torch.float32):
                for head in (128,) if quick else (128, 256):
                    dims = dict(bench.GDN, head_k=head, head_v=head)
                    lens = [100, 30] if variant == "triton_chunk" else [1, 1]
                    args = inputs.gated_delta_rule(lens, packed=variant == "triton_chunk", slots=True, dtype=dtype,
                                                   **dims)
                    out.append((f"{variant} {_dt(dtype)} head {head}", dtype, lambda a=args, f=fn: f(**a)))
        for dtype in (torch.bfloat16, torch.float32) if quick else (torch.bfloat16, torch.float16, torch.float32):
            for label, args in [("causal_conv1d decode", inputs.causal_conv1d([1] * 4, dtype=dtype, **bench.GDN_CONV)),
                                ("causal_conv1d prefill", inputs.causal_conv1d([70, 3], dtype=dtype, **bench.GDN_CONV)),
                                ("gdn_gating", inputs.gdn_gating(16, bench.GDN["num_heads"], dtype=dtype)),
                                ("rms_norm_gated", inputs.rms_norm_gated(16, bench.GDN["num_heads"], bench.GDN["head_v"],
                                                                         dtype=dtype))]:
                fn = kernels.get(label.split()[0], "triton")
                out.append((f"{label} {_dt(dtype)}", dtype, lambda a=args, f=fn: f(**a)))
    return out


def sweep(max_tokens: int = 8192, max_seqs: int = 256, max_model_len: int = 16384, block_size: int = 16,
          tokens_up_to: int = 8192, widths: tuple[int, ...] = tuple(range(1, 80)) + (97, 130, 257, 513, 1024)):
    """(thunks at the sizes the engine's GPU warm-up runs, thunks at the other sizes a served step can have) for
    the kernels whose launch configurations or compiled variants depend on a step's size: the MoE at the
    engine's Qwen3.6 shapes (a shared expert folded in) for each step's token count, and decode attention for
    each batch size and block-table width. Compiled one after the other, the second list must compile nothing
    new: what a served step would compile inside a measured window."""
    import kernels
    from engine import warm_up
    from kernels import bench

    moe_fn, decode_fn = kernels.get("moe", "triton"), kernels.get("paged_decode", "v2_triton")
    moe = {**bench.MOE, "experts": bench.MOE["experts"] + 1}
    geometry = bench.ATTENTION

    def moe_call(tokens):
        return lambda: moe_fn(**_moe_args(tokens, torch.bfloat16, **moe), shared_experts=1)

    def decode_call(batch, width):
        heads, kvh, head = geometry["num_heads"], geometry["num_kv_heads"], geometry["head_size"]
        x = 16 // 2
        args = dict(query=torch.empty(batch, heads, head, dtype=torch.bfloat16),
                    key_cache=torch.empty(2, kvh, head // x, block_size, x, dtype=torch.bfloat16),
                    value_cache=torch.empty(2, kvh, head, block_size, dtype=torch.bfloat16),
                    block_tables=torch.zeros(batch, width, dtype=torch.int32),
                    seq_lens=torch.full((batch,), width * block_size, dtype=torch.int32), scale=head ** -0.5)
        return lambda: decode_fn(**args)

    plan = warm_up.plan(max_tokens, max_seqs, max_model_len, block_size, num_blocks=1 << 20, num_slots=max_seqs,
                        compiled={"moe-dispatch", "attention-decode"})
    warm_tokens = sorted({sum(s.num_new_tokens for s in step) for step in plan})
    warm_decode = sorted({(sum(s.num_new_tokens == 1 for s in step),
                           max(-(-(s.seq.num_computed_tokens + 1) // block_size) for s in step if s.num_new_tokens == 1))
                          for step in plan if any(s.num_new_tokens == 1 for s in step)})
    warm = [moe_call(t) for t in warm_tokens] + [decode_call(b, w) for b, w in warm_decode]
    rest = [moe_call(t) for t in range(1, tokens_up_to + 1)]
    rest += [decode_call(b, w) for b in range(1, max_seqs + 1) for w in widths]
    return warm, rest


def _run_sweep(tokens_up_to: int) -> int:
    """Runs :func:`sweep`, printing each pass's compiled variants; 1 when the second pass compiled any."""
    compiled: dict[int, str] = {}
    launch = JITFunction.run

    def run(fn, *args, grid, warmup, **kwargs):
        kernel = launch(fn, *args, grid=grid, warmup=True, **kwargs)
        if id(kernel) not in compiled:
            consts = {k: v for k, v in kwargs.items() if k.isupper() and isinstance(v, (int, bool))}
            compiled[id(kernel)] = f"{fn.fn.__name__} {consts}"
        return kernel

    JITFunction.run = run
    try:
        warm, rest = sweep(tokens_up_to=tokens_up_to)
        counts = []
        for thunks in (warm, rest):
            before, t0 = len(compiled), time.perf_counter()
            for thunk in thunks:
                thunk()
            counts.append((len(thunks), len(compiled) - before, time.perf_counter() - t0))
    finally:
        JITFunction.run = launch
    (n_warm, c_warm, s_warm), (n_rest, c_rest, s_rest) = counts
    print(f"warm-up sizes: {n_warm} calls compiled {c_warm} variants in {s_warm:.0f} s")
    print(f"every other size: {n_rest} calls compiled {c_rest} more in {s_rest:.0f} s")
    for label in list(compiled.values())[c_warm:]:
        print("  compiled after the warm-up: " + label)
    return 1 if c_rest else 0


def _dt(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _moe_args(tokens, dtype, hidden, experts, intermediate, top_k):
    """Uninitialised weights (never touched: nothing runs), random routing."""
    return dict(hidden_states=torch.randn(tokens, hidden).to(dtype), router_logits=torch.randn(tokens, experts),
                w13=torch.empty(experts, 2 * intermediate, hidden, dtype=dtype),
                w2=torch.empty(experts, hidden, intermediate, dtype=dtype), top_k=top_k)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m kernels.compile_report", description=__doc__.splitlines()[0])
    p.add_argument("--arch", type=int, default=H200["arch"], help="compute capability x 10 (90: H100/H200)")
    p.add_argument("--shared-mem", type=int, default=H200["shared_mem"], help="bytes per program the device allows")
    p.add_argument("--sms", type=int, default=H200["sms"], help="streaming multiprocessors (split counts)")
    p.add_argument("--cases", default="decode,prefill,moe,gdn")
    p.add_argument("--quick", action="store_true",
                   help="Qwen3.6-35B-A3B's shapes in bfloat16 and the engine's float32 checks only (~30 s)")
    p.add_argument("--json", help="write the rows here")
    p.add_argument("--sweep", action="store_true",
                   help="compile the MoE and decode attention at the engine warm-up's sizes, then at every other "
                        "step size; exits 1 when the second pass compiles a variant the first did not")
    p.add_argument("--sweep-tokens", type=int, default=8192, help="--sweep: the MoE's token counts 1 to this")
    a = p.parse_args(argv)
    driver.set_active(CompileOnlyDriver(GPUTarget("cuda", a.arch, 32)))
    from kernels import triton_env
    # the wrappers plan for the device described on the command line
    triton_env.max_shared_mem = lambda device: a.shared_mem
    triton_env.num_sms = lambda device: a.sms
    if a.sweep:
        return _run_sweep(a.sweep_tokens)
    rec = Recorder()
    failures = []
    with rec:
        for label, dtype, thunk in cases(a.cases.split(","), a.quick):
            rec.case, rec.dtype = label, _dt(dtype)
            try:
                thunk()
            except Exception as exc:  # a compile error is a finding: report it and go on
                failures.append(f"{label}: {type(exc).__name__}: {str(exc).splitlines()[0][:300]}")
    over = [r for r in rec.rows if r["shared"] > a.shared_mem]
    cols = ["case", "kernel", "num_warps", "num_stages", "shared", "registers", "stack"]
    shown = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "BT", "BV", "TAIL_N")
    print(" | ".join(cols + ["tiles"]) + "   (shared: bytes per program; stack: spilled bytes per thread)")
    for r in rec.rows:
        tiles = ", ".join(f"{k}={r[k]}" for k in shown if k in r)
        print(" | ".join(str(r.get(c, "")) for c in cols) + " | " + tiles
              + ("  OVER THE LIMIT" if r["shared"] > a.shared_mem else ""))
    for f in failures:
        print("FAILED " + f)
    result = dict(arch=a.arch, shared_mem=a.shared_mem, rows=rec.rows, over=len(over), failures=failures)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1)
    print(json.dumps(dict(kernels=len(rec.rows), over_the_limit=len(over), failures=len(failures))))
    return 1 if over or failures else 0


if __name__ == "__main__":
    sys.exit(main())
