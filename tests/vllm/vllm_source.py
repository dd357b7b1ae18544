"""Real vLLM source for the plugin tests: the 0.10.2 wheel (the last with the V0 attention ops) and
the newest release, downloaded once into a cache and unpacked (Python files only)."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from orchestrator.plugin import load_plugin
from orchestrator.steps import StepContext, compute

REPO = Path(__file__).resolve().parents[2]
OPTIMIZATIONS = REPO / "optimizations"
PINNED = "0.10.2"

# What each shipped plugin does on vLLM 0.10.2: applies, needs a fork's code or a newer vLLM, or is for the
# engine only. SERVE_OPTIONS edit only the serve config, with options both releases have.
SERVE_OPTIONS = {"max-num-seqs-search", "max-batched-tokens-search", "prefix-caching", "async-scheduling",
                 "kv-cache-fp8", "api-server-count"}
ON_PINNED = {"max-num-seqs-256", "max-batched-tokens-32k", "gpu-memory-095", "decode-v2-layout", "decode-v2-triton",
             "prefill-triton", "prefill-triton-tuning"} | SERVE_OPTIONS
# what 0.10.2 lacks: compilation_config.max_prefill_cudagraph_capture_tokens, --stream-interval, pass_config.enable_qk_norm_rope_fusion,
# --kernel-config, fp8_per_tensor among the values of --quantization, bfloat16 among those of --mamba-ssm-cache-dtype,
# the environment variable VLLM_USE_BREAKABLE_CUDAGRAPH
NEWER_ONLY = {"prefill-cudagraph-tokens", "stream-interval", "fusion-qk-norm-rope", "moe-backend", "quantization-fp8",
              "ssm-state-bf16", "torch-compile"}
FORK_ONLY = {"fork-head-mapping-tensor", "fork-enable-triton", "fork-xformers-flash-prefill", "decode-v2-long",
             "decode-threshold-64k"}
ENGINE_ONLY = {"prefill-pregather", "prefill-triton-autotune", "moe-sorted", "moe-triton", "fused-norm-rope", "cuda-graphs", "gdn-prefill-triton",
               "gdn-decode-triton", "gdn-fused-triton"}


def wheel_cache() -> Path:
    cache = Path(os.environ.get("ORCHESTRATOR_WHEEL_CACHE") or Path.home() / ".cache/llm-deploy-orchestrator/wheels")
    cache.mkdir(parents=True, exist_ok=True)
    return cache


def version_key(version: str) -> tuple:
    return tuple(int(p) if p.isdigit() else -1 for p in re.split(r"[.+]", version))


def cached_wheel(version: str) -> Path | None:
    found = sorted(wheel_cache().glob(f"vllm-{version}-*.whl"))
    return found[0] if found else None


def newest_version() -> str:
    """The newest vllm on the index; offline, the newest wheel already in the cache."""
    out = subprocess.run([sys.executable, "-m", "pip", "index", "versions", "vllm"],
                         capture_output=True, text=True, timeout=120)
    found = re.search(r"^vllm \(([^)]+)\)", out.stdout, re.M)
    if found:
        return found.group(1)
    cached = [p.name.split("-")[1] for p in wheel_cache().glob("vllm-*.whl")]
    if not cached:
        raise RuntimeError(f"cannot list vllm versions (pip index: {out.stderr.strip()[-300:]}) and no wheel is cached")
    return max(cached, key=version_key)


def wheel(version: str) -> Path:
    """The cached wheel of `version`, downloaded on first use."""
    path = cached_wheel(version)
    if path is None:
        subprocess.run([sys.executable, "-m", "pip", "download", f"vllm=={version}", "--no-deps",
                        "--only-binary", ":all:", "-d", str(wheel_cache()), "-q"], check=True, timeout=3600)
        path = cached_wheel(version)
        if path is None:
            raise RuntimeError(f"pip download left no vllm-{version} wheel in {wheel_cache()}")
    return path


def unpack(whl: Path, dest: Path) -> Path:
    """Only vllm/**/*.py: the plugins patch Python source, and binaries would only cost time."""
    with zipfile.ZipFile(whl) as z:
        names = [n for n in z.namelist() if n.startswith("vllm/") and n.endswith(".py")]
        z.extractall(dest, names)
    return dest / "vllm"


def linked(package: Path, dest: Path) -> Path:
    """A package folder of its own whose files are links to `package`'s: a plugin may add or edit files in it."""
    shutil.copytree(package, dest, copy_function=os.symlink)
    return dest


def without_sleep_mode(package: Path, dest: Path) -> Path:
    """`package` as a vLLM without sleep mode: its argument parser built without --enable-sleep-mode."""
    linked(package, dest)
    arg_utils = dest / "engine" / "arg_utils.py"
    text = arg_utils.read_text()
    assert text.count('"--enable-sleep-mode",') == 1, arg_utils
    arg_utils.unlink()
    arg_utils.write_text(text.replace('"--enable-sleep-mode",', ""))
    return dest


def probe_env(package: Path) -> dict[str, str]:
    """What the staging loop gives a plugin's command steps: the package root and this repository."""
    return {**os.environ, "ORCHESTRATOR_ROOT_VLLM": str(package),
            "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}


def patched_files(package: Path, plugin_id: str, variant: int = 0) -> dict[Path, bytes]:
    """The files one plugin's vLLM steps would write (path -> new bytes), computed without writing."""
    roots = {"vllm": package, "serve": package.parent}
    plugin = load_plugin(OPTIMIZATIONS / plugin_id, roots, {"serve_config": "serve.yaml"})
    ctx = StepContext(roots=roots, kind="vllm", plugin_dir=plugin.folder, env=probe_env(package))
    files: dict[Path, bytes] = {}
    for step in plugin.variants[variant].apply:
        if step.runs_on("vllm"):
            _, _, full, data = compute(step, ctx, lambda p: files.get(p, p.read_bytes() if p.is_file() else None))
            files[full] = data
    return files
