"""The shipped plugins as data: they load on every target kind they name, each engine plugin changes
the baseline serve config into one the engine accepts, and all of them kept reproduce the engine's
fully optimized config."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml

import kernels
from engine.config import KERNEL_KEYS, key_ops, load_config
from orchestrator.plugin import load_all
from orchestrator.steps import FILE_CHECKS, StepContext, check, compute

REPO = Path(__file__).resolve().parents[2]
OPTIMIZATIONS = REPO / "optimizations"
CONFIGS = REPO / "engine" / "configs"

SHIPPED = {
    "max-num-seqs-256", "max-batched-tokens-32k", "gpu-memory-095",              # the seed's serve config
    "decode-v2-long", "decode-v2-triton", "decode-v2-layout", "decode-threshold-64k",  # decode
    "prefill-pregather", "prefill-triton", "prefill-triton-autotune", "prefill-triton-tuning",  # prefix prefill
    "moe-sorted", "moe-triton",                                                 # MoE
    "fused-norm-rope", "cuda-graphs",                                           # engine decode steps
    "gdn-prefill-triton", "gdn-decode-triton", "gdn-fused-triton",              # Gated DeltaNet
    "fork-head-mapping-tensor", "fork-xformers-flash-prefill", "fork-enable-triton",  # fork-only fixes
    "max-num-seqs-search", "max-batched-tokens-search", "prefix-caching", "async-scheduling",  # vLLM serve options
    "kv-cache-fp8", "prefill-cudagraph-tokens", "api-server-count", "stream-interval", "fusion-qk-norm-rope",
    "moe-backend", "quantization-fp8", "ssm-state-bf16", "torch-compile",
}
ENGINE_TOO = {"async-scheduling"}  # vLLM-serve plugins whose key the engine has too
# vLLM-serve plugin: (the key its precondition asks the installed vLLM for, the serve-config key it sets)
VLLM_SERVE = {"max-num-seqs-search": ("max-num-seqs", "max-num-seqs"),
              "max-batched-tokens-search": ("max-num-batched-tokens", "max-num-batched-tokens"),
              "prefix-caching": ("enable-prefix-caching", "enable-prefix-caching"),
              "async-scheduling": ("async-scheduling", "async-scheduling"),
              "kv-cache-fp8": ("kv-cache-dtype", "kv-cache-dtype"),
              "prefill-cudagraph-tokens": ("compilation-config.max_prefill_cudagraph_capture_tokens",
                                           "compilation-config.max_prefill_cudagraph_capture_tokens"),
              "api-server-count": ("api-server-count", "api-server-count"),
              "stream-interval": ("stream-interval", "stream-interval"),
              "fusion-qk-norm-rope": ("compilation-config.pass_config.enable_qk_norm_rope_fusion",
                                      "compilation-config.pass_config.enable_qk_norm_rope_fusion"),
              "moe-backend": ("kernel-config.moe_backend=flashinfer_cutlass", "kernel-config.moe_backend"),
              "quantization-fp8": ("quantization=fp8_per_tensor", "quantization")}
CHANGES_NUMERICS = {"kv-cache-fp8", "quantization-fp8", "ssm-state-bf16", "torch-compile"}


TIMED = "prefill-triton-autotune"  # its step times launches on the device, then writes the serve config
LAUNCH = ("prefill_block_m", "prefill_block_n", "prefill_num_warps")


def engine_plugins(workspace: Path):
    """The engine plugins whose steps are serve-config edits (all but the autotuner, tested on its own)."""
    roots = {"workspace": workspace, "serve": workspace}
    return [p for p in load_all(OPTIMIZATIONS, roots, {"serve_config": "serve.yaml"})
            if "engine" in p.manifest.targets and p.id != TIMED], roots


def apply_engine(plugin, variant, roots, files: dict[Path, bytes]) -> dict[Path, bytes]:
    """The plugin's engine steps on `files` (path -> bytes), in memory; returns the new mapping."""
    ctx = StepContext(roots=roots, kind="engine", plugin_dir=plugin.folder, env={})
    files = dict(files)
    for step in variant.apply:
        if step.runs_on("engine"):
            assert step.kind == "yaml_set", f"{plugin.id}: engine plugins edit the serve config only"
            _, _, full, data = compute(step, ctx, lambda p: files.get(p, p.read_bytes() if p.is_file() else None))
            files[full] = data
    return files


@pytest.fixture
def workspace(tmp_path) -> Path:
    (tmp_path / "serve.yaml").write_bytes((CONFIGS / "baseline.yaml").read_bytes())
    return tmp_path


def test_every_folder_is_one_shipped_plugin_named_by_its_id():
    folders = {p.name for p in OPTIMIZATIONS.iterdir() if p.is_dir() and (p / "plugin.yaml").is_file()}
    assert folders == SHIPPED
    for name in folders:
        assert yaml.safe_load((OPTIMIZATIONS / name / "plugin.yaml").read_text())["id"] == name


@pytest.mark.parametrize("kind, roots", [("engine", ("workspace", "serve")), ("vllm", ("vllm", "serve"))])
def test_plugins_load_for_each_target_kind(tmp_path, kind, roots):
    plugins = load_all(OPTIMIZATIONS, {r: tmp_path for r in roots}, {"serve_config": "serve.yaml"})
    assert {p.id for p in plugins} == SHIPPED
    for p in plugins:
        assert len(p.manifest.description.split()) >= 25, f"{p.id}: say what it changes and what to do about it"
        assert "files" not in p.manifest.targets, p.id


def test_fork_fixes_are_vllm_only_and_anchored(tmp_path):
    plugins = load_all(OPTIMIZATIONS, {"vllm": tmp_path, "serve": tmp_path}, {"serve_config": "serve.yaml"})
    for p in plugins:
        if p.id.startswith("fork-"):
            assert p.manifest.targets == ["vllm"]
            assert any(c.kind == "contains" for c in p.manifest.applies_if), p.id


def test_each_engine_plugin_changes_the_baseline_into_a_valid_config(workspace):
    plugins, roots = engine_plugins(workspace)
    baseline = load_config(workspace / "serve.yaml")
    for plugin in plugins:
        for variant in plugin.variants:
            files = apply_engine(plugin, variant, roots, {})
            (path, data), = files.items()
            assert path == workspace / "serve.yaml"
            candidate = workspace / "candidate.yaml"
            candidate.write_bytes(data)
            cfg = load_config(candidate)  # raises ConfigError naming the key if a plugin wrote a bad value
            changed = {k for k, v in cfg.as_dict().items() if v != getattr(baseline, k)}
            assert changed, f"{plugin.id} {variant.label} changes nothing on the engine"
            for key in KERNEL_KEYS:
                for name in cfg.chain(key):
                    assert all(name in kernels.variants(op) for op in key_ops(key))
            assert data.startswith(b"# The seed deployment's starting point"), "comments are kept"


def test_all_engine_plugins_kept_give_the_optimized_config(workspace):
    plugins, roots = engine_plugins(workspace)
    files: dict[Path, bytes] = {}
    for plugin in plugins:
        files = apply_engine(plugin, plugin.variants[0], roots, files)
    (workspace / "serve.yaml").write_bytes(files[workspace / "serve.yaml"])
    kept = load_config(workspace / "serve.yaml").as_dict()
    optimized = load_config(CONFIGS / "optimized.yaml").as_dict()
    assert {k: v for k, v in kept.items() if k not in LAUNCH} == {k: v for k, v in optimized.items() if k not in LAUNCH}


def test_tuning_searches_the_seed_parameter_space(tmp_path):
    plugins = load_all(OPTIMIZATIONS, {"vllm": tmp_path, "serve": tmp_path}, {"serve_config": "serve.yaml"})
    tuning = next(p for p in plugins if p.id == "prefill-triton-tuning")
    assert [v.params for v in tuning.variants] == [
        {"block_m": m, "block_n": n, "num_warps": w} for m in (64, 128) for n in (64, 128) for w in (4, 8)]


def test_plugin_table_lists_every_plugin():
    table = (REPO / "docs" / "plugins.md").read_text()
    for pid in SHIPPED:
        assert f"`{pid}`" in table, pid
    assert "CCCL" in table


def test_vllm_serve_plugins_check_their_option_verify_and_roll_back(tmp_path):
    """Each needs its option in the installed vLLM (read from source; else not_applicable), verifies the
    value landed and the whole config is servable there, and re-checks the restored config on rollback."""
    plugins = {p.id: p for p in load_all(OPTIMIZATIONS, {"vllm": tmp_path, "serve": tmp_path},
                                         {"serve_config": "serve.yaml"})}
    for pid, (asked, option) in VLLM_SERVE.items():
        m = plugins[pid].manifest
        assert m.targets == (["vllm", "engine"] if pid in ENGINE_TOO else ["vllm"]), pid
        assert [c.body.run[-2:] for c in m.applies_if if c.runs_on("vllm")] == [["has", asked]], pid
        for variant in plugins[pid].variants:
            assert [s.body.key for s in variant.apply if s.runs_on("vllm")] == [option], pid
            assert {c.kind for c in variant.verify if c.runs_on("vllm")} == {"yaml_has", "command"}, pid
            assert [s.body.run[-2:] for s in variant.rollback if s.runs_on("vllm")] == [["check", "serve.yaml"]], pid
        assert m.changes_numerics == (pid in CHANGES_NUMERICS), pid
    assert [v.params for v in plugins["max-num-seqs-search"].variants] == [
        {"max_num_seqs": n} for n in (512, 1024)]


# the serve configs the shipped vLLM plugins are staged on: the Dockerfile's, the GPU run's (flow mappings in it)
SERVE_CONFIGS = [REPO / "docker" / "serve.yaml", REPO / "benchmarks" / "vllm_h200" / "serve.yaml",
                 REPO / "benchmarks" / "vllm_h200" / "defaults.yaml"]


@pytest.mark.parametrize("config", SERVE_CONFIGS, ids=lambda p: str(p.relative_to(REPO)))
def test_every_vllm_serve_variant_passes_its_own_file_checks_on_the_shipped_configs(tmp_path, config):
    """A variant's edit, made on a config the project ships, passes the variant's own checks of the file: on one
    H100, moe-backend wrote into the config's flow mapping `kernel-config: {...}` and its text check failed."""
    serve = tmp_path / "serve.yaml"
    plugins = load_all(OPTIMIZATIONS, {"vllm": tmp_path, "serve": tmp_path}, {"serve_config": "serve.yaml"})
    checked = 0
    for plugin in plugins:
        edits = [s for v in plugin.variants for s in v.apply if s.runs_on("vllm")]
        if "vllm" not in plugin.manifest.targets or not all(s.kind == "yaml_set" for s in edits):
            continue  # it patches vLLM's source (tests/vllm)
        ctx = StepContext(roots={"vllm": tmp_path, "serve": tmp_path}, kind="vllm", plugin_dir=plugin.folder, env={})
        for variant in plugin.variants:
            files = {serve: config.read_bytes()}  # the serve config, and the serve environment where one is written
            for step in variant.apply:
                if step.runs_on("vllm") and step.kind == "yaml_set":
                    _, _, full, data = compute(step, ctx, files.get)
                    files[full] = data
            for path, data in files.items():
                path.write_bytes(data)
            for chk in variant.verify:
                if chk.runs_on("vllm") and chk.kind in FILE_CHECKS:
                    ok, why = check(chk, ctx)
                    assert ok, f"{plugin.id} {variant.label} on {config.name}: {why}"
                    checked += 1
            assert len(files) > 1 or yaml.safe_load(serve.read_text()) != yaml.safe_load(config.read_text()), \
                plugin.id
            for path in files:
                if path != serve:
                    path.unlink()
    assert checked >= 17


def test_changes_numerics_reaches_the_probe_environment(tmp_path):
    from orchestrator.plugin import NUMERICS_ENV, numerics_env

    plugins = {p.id: p for p in load_all(OPTIMIZATIONS, {"vllm": tmp_path, "serve": tmp_path},
                                         {"serve_config": "serve.yaml"})}
    assert numerics_env([plugins["max-num-seqs-search"], plugins["async-scheduling"]]) == {}
    assert numerics_env([plugins["kv-cache-fp8"], plugins["async-scheduling"]]) == {NUMERICS_ENV: "kv-cache-fp8"}


def test_autotune_writes_the_fastest_correct_launch_of_the_grid(tmp_path):
    """Under Triton's interpreter (the CPU stand-in for a GPU) every launch of the grid is run against
    the float64 reference and timed; the fastest correct one lands in the serve config, comments kept."""
    import os
    import subprocess
    import sys

    serve = tmp_path / "serve.yaml"
    serve.write_text((CONFIGS / "baseline.yaml").read_text().replace("attention-prefill: loop",
                                                                     "attention-prefill: [triton, pregather]"))
    script = (f"import sys; sys.path.insert(0, {str(OPTIMIZATIONS / TIMED)!r}); import hooks, pathlib; "
              f"sys.exit(0 if hooks.tune_prefill_launch(pathlib.Path({str(tmp_path)!r}), 'serve.yaml') else 3)")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    timed = [line for line in proc.stdout.splitlines() if " ms, relative error " in line]
    refused = [line for line in proc.stdout.splitlines() if "fails: ValueError: block_m 64 must be a multiple" in line]
    assert len(timed) == 6 and len(refused) == 2, proc.stdout  # BLOCK_N may not exceed BLOCK_M; the rest ran right
    cfg = load_config(serve)
    best = proc.stdout.split("fastest: ")[1].splitlines()[0]
    assert f"'block_m': {cfg.prefill_block_m}, 'block_n': {cfg.prefill_block_n}, " \
           f"'num_warps': {cfg.prefill_num_warps}" in best
    assert serve.read_text().startswith("# The seed deployment's starting point")
