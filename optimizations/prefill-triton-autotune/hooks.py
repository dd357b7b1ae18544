"""The engine's Triton prefill launch, tuned on the deployment's own device and shapes.

Its launch parameters only matter where the engine would run the Triton prefill: the serve config
lists it, and the device is a GPU or Triton's interpreter was asked for (otherwise the engine refuses
Triton kernels on the CPU and falls back): that is the precondition."""
from __future__ import annotations

from pathlib import Path


def triton_prefill_in_use(root: Path, serve_config: str) -> bool:
    import kernels
    from engine.config import load_config

    config = load_config(Path(root) / serve_config)
    listed = "triton" in config.chain("attention-prefill")
    runs = config.torch_device().type == "cuda" or kernels.INTERPRET_REQUESTED
    print(f"attention-prefill lists triton: {listed}; device: {config.torch_device()}; "
          f"TRITON_INTERPRET requested: {kernels.INTERPRET_REQUESTED}")
    return listed and runs


LAUNCHES = [(m, n, w) for m in (64, 128) for n in (64, 128) for w in (4, 8)]
TOLERANCE = {"float32": 1e-4, "float16": 5e-3, "bfloat16": 2e-2}


def _seconds(fn, cuda: bool) -> float:
    """Median time of one call: CUDA events through triton.testing.do_bench on a GPU, the wall
    clock over a few calls elsewhere (the interpreter: only the ordering is meaningful there)."""
    if cuda:
        from triton.testing import do_bench

        return do_bench(fn, warmup=25, rep=100, return_mode="median") / 1e3
    import statistics
    import time

    times = []
    for _ in range(3):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def tune_prefill_launch(root: Path, serve_config: str) -> bool:
    """Time each launch on the deployment's shapes, keep the fastest correct one in the serve config."""
    import io

    import torch
    from ruamel.yaml import YAML

    import kernels
    from engine.config import load_config
    from kernels import inputs

    config = load_config(Path(root) / serve_config)
    device, dtype, model = config.torch_device(), config.torch_dtype(), config.hf
    cuda = device.type == "cuda"
    # a chunk of new tokens behind a long context, and a fresh prompt: the prefills a server sees
    seqs = [(6144, 2048), (0, 2048)] if cuda else [(40, 33), (0, 20)]
    args = inputs.prefix_prefill(seqs, num_heads=model.num_heads, num_kv_heads=model.num_kv_heads,
                                 head_size=model.head_size, block_size=config.block_size, dtype=dtype,
                                 device=device, seed=torch.seed() % (1 << 31))
    ref = kernels.get("prefix_prefill", "reference")(**args).double()
    triton_prefill = kernels.get("prefix_prefill", "triton")
    tol = TOLERANCE[str(dtype).removeprefix("torch.")]
    timed = []
    print(f"prefix prefill on {device} {dtype}, heads {model.num_heads}/{model.num_kv_heads}, head {model.head_size}, "
          f"sequences (context, new) {seqs}")
    for block_m, block_n, warps in LAUNCHES:
        launch = dict(block_m=block_m, block_n=block_n, num_warps=warps)
        try:
            out = torch.full_like(args["query"], float("nan"))
            out.copy_(triton_prefill(**args, **launch))
            err = float((out.double() - ref).norm() / ref.norm().clamp_min(1e-30))
            if not err <= tol:
                print(f"  {launch}: wrong, relative error {err:.2e} above {tol:.0e}")
                continue
            seconds = _seconds(lambda: triton_prefill(**args, **launch), cuda)
        except Exception as exc:  # a launch the device cannot run (shared memory) is just not a candidate
            print(f"  {launch}: fails: {type(exc).__name__}: {str(exc).splitlines()[0][:120]}")
            continue
        print(f"  {launch}: {seconds * 1e3:.3f} ms, relative error {err:.1e}")
        timed.append((seconds, launch))
    if not timed:
        print("no launch configuration ran correctly")
        return False
    seconds, best = min(timed, key=lambda t: t[0])
    print(f"fastest: {best} ({seconds * 1e3:.3f} ms)")
    path = Path(root) / serve_config
    yaml = YAML()
    data = yaml.load(path.read_text(encoding="utf-8"))
    data["prefill-block-m"], data["prefill-block-n"], data["prefill-num-warps"] = (
        best["block_m"], best["block_n"], best["num_warps"])
    text = io.StringIO()
    yaml.dump(data, text)
    path.write_text(text.getvalue(), encoding="utf-8")
    return True
