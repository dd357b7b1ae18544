"""Launch configurations chosen against the device's shared memory: the estimates, the fallbacks,
the tuned MoE tables, and (compiled for an H200 by the ptxas Triton ships) what the compiler reports."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kernels import triton_env
from kernels.decode_triton import launch_configs as decode_configs, split_shared
from kernels.gdn_triton import _prepare_shared, _scan_shared, chunk_configs
from kernels.moe_triton import fitting, gemm_shared, launch_config, table_config
from kernels.prefill_triton import launch_configs as prefill_configs, prefill_shared
from kernels.triton_env import HOPPER_SHARED_MEM, FirstThatFits, OutOfResources

CPU = torch.device("cpu")
ROOT = Path(__file__).resolve().parents[2]


def _limited(monkeypatch, limit):
    monkeypatch.setattr(triton_env, "max_shared_mem", lambda device: limit)


def test_first_that_fits_tries_in_order_and_remembers_the_one_that_ran():
    tried = []

    def run(cfg):
        tried.append(cfg["n"])
        if cfg["n"] > 2:
            raise OutOfResources(cfg["n"] * 1000, 2000, "shared memory")
        return cfg["n"]

    launcher = FirstThatFits()
    configs = [dict(n=4), dict(n=3), dict(n=2), dict(n=1)]
    assert launcher.launch(configs, run) == 2 and tried == [4, 3, 2]
    tried.clear()
    assert launcher.launch(configs, run) == 2 and tried == [2]  # straight to the one that ran
    with pytest.raises(OutOfResources):
        launcher.launch([dict(n=9), dict(n=8)], run)  # none fits: the device's own error
    with pytest.raises(ValueError):
        launcher.launch([], run)


def test_moe_float32_small_preset_fits_the_h200():
    """The engine's start-up check of the small preset in float32 asked for 417,792 bytes (16/128/128,
    4 stages, gated): now its tiles are sized from the element size and within the device's limit."""
    assert gemm_shared(16, 128, 128, 4, 4, gated=True) == 417792  # the configuration that failed
    cfg = launch_config(12, 4, 32, 512, 128, torch.float32, CPU)
    for gemm, gated in ((cfg["gate_up"], True), (cfg["down"], False)):
        first = fitting(gemm, cfg["BLOCK_M"], 4, gated, HOPPER_SHARED_MEM)[0]
        assert gemm_shared(cfg["BLOCK_M"], first["BLOCK_N"], first["BLOCK_K"], first["num_stages"], 4,
                           gated) <= HOPPER_SHARED_MEM


@pytest.mark.parametrize("limit", [48 * 1024, 100 * 1024, HOPPER_SHARED_MEM])
def test_moe_tiles_narrow_to_fit_a_smaller_device(limit):
    gemm = dict(BLOCK_N=128, BLOCK_K=128, num_warps=4, num_stages=4)
    options = fitting(gemm, 16, 2, True, limit)
    assert options and all(gemm_shared(16, o["BLOCK_N"], o["BLOCK_K"], o["num_stages"], 2, True) <= limit
                           for o in options)
    if gemm_shared(16, 128, 128, 4, 2, True) <= limit:
        assert options[0] == gemm  # what was asked for, when it fits
    assert fitting(gemm, 16, 2, True, 1000) == [dict(gemm, BLOCK_N=16, BLOCK_K=32, num_stages=1)]


def test_moe_table_follows_rows_per_expert_and_overrides_apply():
    assert table_config(8, 256)["BLOCK_M"] == 16  # one decode token
    assert table_config(2048 * 8, 256)["BLOCK_M"] == 64
    cfg = launch_config(2048, 8, 256, 2048, 512, torch.bfloat16, CPU,
                        dict(BLOCK_N=32, down=dict(num_warps=8), BLOCK_M=32))
    assert cfg["BLOCK_M"] == 32 and cfg["gate_up"]["BLOCK_N"] == cfg["down"]["BLOCK_N"] == 32
    assert cfg["down"]["num_warps"] == 8
    with pytest.raises(ValueError, match="BLOCK_X"):
        launch_config(1, 8, 256, 2048, 512, torch.bfloat16, CPU, dict(BLOCK_X=1))


def test_moe_tuned_file_is_used_by_nearest_token_count(tmp_path, monkeypatch):
    from kernels import moe_triton
    name = moe_triton.config_file_name(256, 2048, 512, "bfloat16", "GPU_X")
    tuned = {"1": dict(BLOCK_M=16, gate_up=dict(BLOCK_N=16, BLOCK_K=64, num_warps=2, num_stages=5),
                       down=dict(BLOCK_N=16, BLOCK_K=64, num_warps=2, num_stages=5)),
             "1024": dict(BLOCK_M=32, gate_up=dict(BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=3),
                          down=dict(BLOCK_N=128, BLOCK_K=64, num_warps=4, num_stages=3))}
    (tmp_path / name).write_text(json.dumps(tuned))
    monkeypatch.setattr(moe_triton, "CONFIG_DIR", tmp_path)
    monkeypatch.setattr(moe_triton, "device_name", lambda device: "GPU_X")
    moe_triton._tuned_table.cache_clear()
    try:
        assert launch_config(3, 8, 256, 2048, 512, torch.bfloat16, CPU)["gate_up"]["num_warps"] == 2
        assert launch_config(900, 8, 256, 2048, 512, torch.bfloat16, CPU)["BLOCK_M"] == 32
        assert launch_config(900, 8, 256, 2048, 512, torch.bfloat16, CPU, dict(BLOCK_M=64))["BLOCK_M"] == 64
        assert launch_config(3, 8, 256, 2048, 512, torch.float16, CPU)["gate_up"]["num_warps"] != 2  # no fp16 file
    finally:
        moe_triton._tuned_table.cache_clear()


@pytest.mark.parametrize("head,dtype", [(128, torch.bfloat16), (256, torch.bfloat16), (128, torch.float32),
                                        (256, torch.float32)])
def test_gdn_chunk_configs_fit_the_h200_for_head_sizes_up_to_256(head, dtype):
    elt = 4 if dtype == torch.float32 else 2
    configs = chunk_configs(head, head, dtype, 64, CPU)
    assert configs
    for c in configs:
        assert _scan_shared(c["chunk_size"], head, c["block_v"], c["num_stages"], elt) <= HOPPER_SHARED_MEM
        assert _prepare_shared(c["chunk_size"], head, min(head, 64), elt) <= HOPPER_SHARED_MEM
    if dtype == torch.bfloat16 and head == 128:
        assert configs[0]["chunk_size"] == 64 and configs[0]["num_stages"] == 2


def test_gdn_chunk_configs_shrink_on_a_smaller_device_and_widen_with_parallelism(monkeypatch):
    monkeypatch.setattr(triton_env, "num_sms", lambda device: 132)
    many = chunk_configs(128, 128, torch.bfloat16, 4096, CPU)[0]
    one = chunk_configs(128, 128, torch.bfloat16, 1, CPU)[0]
    assert many["block_v"] == 32 and one["block_v"] == 16  # a lone sequence: more value blocks in flight
    _limited(monkeypatch, 64 * 1024)
    small = chunk_configs(128, 128, torch.bfloat16, 4096, CPU)
    assert small and all(_scan_shared(c["chunk_size"], 128, c["block_v"], c["num_stages"], 2) <= 64 * 1024
                         for c in small)
    assert small[0]["chunk_size"] < 64 or small[0]["num_stages"] < 2


@pytest.mark.parametrize("limit", [40 * 1024, 80 * 1024, HOPPER_SHARED_MEM])
def test_decode_and_prefill_configs_fit(monkeypatch, limit):
    _limited(monkeypatch, limit)
    for c in decode_configs(256, 16, 2, 16, CPU, 64, 4, 3):
        assert split_shared(c["block_n"], 256, 16, c["num_stages"], 2) <= limit
    for c in prefill_configs(128, 64, 8, 2, 256, 2, 16, CPU):
        assert prefill_shared(c["block_m"], c["block_n"], 256, c["num_stages"], 2) <= limit
        assert c["block_m"] % c["block_n"] == 0


def _estimate(row) -> int | None:
    """The wrapper's own estimate of a compiled kernel's shared memory."""
    elt = 4 if row["dtype"] == "float32" else 2
    if row["kernel"] == "_grouped_gemm":
        return gemm_shared(row["BLOCK_M"], row["BLOCK_N"], row["BLOCK_K"], row["num_stages"], elt, row["GATED"])
    if row["kernel"] == "_split_kernel":
        return split_shared(row["BLOCK_N"], row["HEAD"], row["GROUP_PAD"], row["num_stages"], elt)
    if row["kernel"] == "_prefill_kernel":
        return prefill_shared(row["BLOCK_M"], row["BLOCK_N"], row["HEAD"], row["num_stages"], elt)
    if row["kernel"] == "_chunk_scan_kernel":
        return _scan_shared(row["BT"], row["DK"], row["BV"], row["num_stages"], elt)
    if row["kernel"] == "_chunk_prepare_kernel":
        return _prepare_shared(row["BT"], row["DK"], row["BV"], elt)
    return None


def test_kernels_compiled_for_an_h200_fit_its_shared_memory(tmp_path):
    """Each wrapper's chosen configuration at Qwen3.6-35B-A3B shapes (bf16) and in the engine's float32
    checks, compiled for sm_90: within 232,448 bytes, and never above the wrapper's own estimate."""
    pytest.importorskip("triton.backends.nvidia")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT)
    out = tmp_path / "compiled.json"
    proc = subprocess.run([sys.executable, "-m", "kernels.compile_report", "--quick", "--json", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    if "ptxas" in proc.stderr and not out.exists():
        pytest.skip("Triton cannot compile for NVIDIA GPUs here: " + proc.stderr[-300:])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    kernels_seen = {r["kernel"] for r in result["rows"]}
    assert {"_grouped_gemm", "_route_kernel", "_align_scan_kernel", "_align_scatter_kernel",
            "_split_kernel", "_prefill_kernel", "_chunk_scan_kernel",
            "_chunk_prepare_kernel", "_conv_kernel", "_gating_kernel", "_norm_gated_kernel"} <= kernels_seen
    for row in result["rows"]:
        assert row["shared"] <= HOPPER_SHARED_MEM, row
        est = _estimate(row)
        assert est is None or row["shared"] <= est, (row, est)


def test_a_served_step_compiles_nothing_the_engine_warm_up_did_not(tmp_path):
    """Compiled for sm_90 with the engine's GPU warm-up sizes first (engine/warm_up.py), the MoE at every token
    count up to 200 and decode attention at every batch size and many block-table widths compile no further
    variant: counts and widths that change from step to step are not specialized on, and the size classes
    that choose launch configurations are all warmed."""
    pytest.importorskip("triton.backends.nvidia")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(PYTHONPATH=str(ROOT), TRITON_CACHE_DIR=str(tmp_path / "cache"))
    proc = subprocess.run([sys.executable, "-m", "kernels.compile_report", "--sweep", "--sweep-tokens", "200"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=1500)
    if "ptxas" in proc.stderr and "warm-up sizes" not in proc.stdout:
        pytest.skip("Triton cannot compile for NVIDIA GPUs here: " + proc.stderr[-300:])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "compiled 0 more" in proc.stdout, proc.stdout
