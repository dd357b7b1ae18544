"""vLLM's serve options read from its source with ast (never imported), on the real 0.10.2 and the
newest release, and the command line the vLLM-serve plugins use as precondition, verify and rollback."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from orchestrator.targets import vllm_options
from vllm_source import PINNED, REPO, without_sleep_mode

SERVE_KEYS = ("max-num-seqs", "max-num-batched-tokens", "enable-prefix-caching", "async-scheduling",
              "kv-cache-dtype", "gpu-memory-utilization", "compilation-config", "model", "served-model-name",
              "host", "port", "load-format", "max-model-len")


def cli(*args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "orchestrator.targets.vllm_options", *args],
                          env={**os.environ, "PYTHONPATH": str(REPO), **env}, capture_output=True, text=True,
                          timeout=120)


def test_pinned_release(vllm_pinned):
    options = vllm_options.read(vllm_pinned)
    assert options.version == PINNED
    for key in SERVE_KEYS + ("cuda-graph-sizes", "max-seq-len-to-capture", "disable-log-requests"):
        assert options.missing(key) is None, key
    assert "max-cudagraph-capture-size" not in options.options  # 0.10.x captures cuda-graph-sizes instead
    assert options.missing("max_cudagraph_capture_size").startswith(f"vLLM {PINNED} at {vllm_pinned} has no serve "
                                                                     "option --max-cudagraph-capture-size")
    assert {"max_num_seqs", "async_scheduling", "cuda_graph_sizes"} <= options.engine_fields
    assert "cudagraph_capture_sizes" in options.nested["compilation-config"]
    assert "vllm" not in sys.modules


def test_newest_release(vllm_newest):
    options = vllm_options.read(vllm_newest)
    assert options.version and options.version != PINNED
    for key in SERVE_KEYS + ("max-cudagraph-capture-size", "cudagraph-capture-sizes",
                             "compilation-config.max_cudagraph_capture_size", "compilation-config.cudagraph_mode"):
        assert options.missing(key) is None, key
    assert "no field 'no_such_field'" in options.missing("compilation-config.no_such_field")
    assert "vllm" not in sys.modules


def test_every_option_is_a_real_argument(vllm_pinned, vllm_newest):
    """The literal names are exactly what the parser is built with: every EngineArgs field of 0.10.2
    has its option, and nothing that is not an option name slips in."""
    for package in (vllm_pinned, vllm_newest):
        options = vllm_options.read(package)
        assert all(o and not o.startswith("-") and o == o.lower() and " " not in o for o in options.options)
        assert len(options.options) > 150
    pinned = vllm_options.read(vllm_pinned)
    assert {f.replace("_", "-") for f in pinned.engine_fields} <= pinned.options


def test_command_line_has_check_and_list(vllm_pinned, tmp_path):
    ok = cli("--package", str(vllm_pinned), "has", "max-num-seqs", "async_scheduling")
    assert ok.returncode == 0 and "--max-num-seqs, --async-scheduling are serve options" in ok.stdout
    missing = cli("has", "max-num-seqs", "max-cudagraph-capture-size", ORCHESTRATOR_ROOT_VLLM=str(vllm_pinned))
    assert missing.returncode == 1
    assert missing.stderr.strip() == (f"vLLM {PINNED} at {vllm_pinned} has no serve option "
                                      "--max-cudagraph-capture-size")
    serve = tmp_path / "serve.yaml"
    serve.write_text("model: m\nmax-num-seqs: 8\ncompilation-config: {cudagraph_mode: FULL}\n")
    assert cli("--package", str(vllm_pinned), "check", str(serve)).returncode == 0
    serve.write_text("model: m\nmax-num-seqs: 8\nmax-cudagraph-capture-size: 512\n"
                     "compilation-config: '{\"no_such_field\": 1}'\n")
    bad = cli("--package", str(vllm_pinned), "check", str(serve))
    assert bad.returncode == 1
    assert "--max-cudagraph-capture-size" in bad.stderr and "no field 'no_such_field'" in bad.stderr
    listed = json.loads(cli("--package", str(vllm_pinned), "list").stdout)
    assert listed["version"] == PINNED and "max-num-seqs" in listed["options"]


def test_not_a_vllm_package_is_a_clear_no(tmp_path):
    result = cli("--package", str(tmp_path), "has", "max-num-seqs")
    assert result.returncode == 1
    assert f"{tmp_path} holds no engine/arg_utils.py: not a vLLM package folder" in result.stderr


@pytest.mark.parametrize("key, normal", [("--max_num_seqs", "max-num-seqs"), ("kv-cache-dtype", "kv-cache-dtype")])
def test_keys_are_read_as_vllm_reads_them(key, normal):
    assert vllm_options.normalize(key) == normal


def test_sleep_mode_nested_fields_and_values(vllm_pinned, vllm_newest, tmp_path):
    """Sleep mode (the option and its routes), fields two levels down, and the values a Literal type lists."""
    pinned, newest = vllm_options.read(vllm_pinned), vllm_options.read(vllm_newest)
    assert pinned.sleeps and newest.sleeps
    assert not vllm_options.read(without_sleep_mode(vllm_pinned, tmp_path / "vllm")).sleeps
    key = "compilation-config.pass_config.enable_qk_norm_rope_fusion"
    assert newest.missing(key) is None
    assert pinned.missing(key).endswith("--compilation-config.pass_config has no field 'enable_qk_norm_rope_fusion'")
    assert newest.missing("compilation-config.inductor_compile_config.max_autotune") is None  # a free-form mapping
    assert newest.missing("kernel-config.moe_backend=flashinfer_cutlass") is None
    assert "--kernel-config.moe_backend takes no value 'cutlass_x'" in \
        newest.missing("kernel-config.moe_backend=cutlass_x")
    assert "has no serve option --kernel-config" in pinned.missing("kernel-config.moe_backend=flashinfer_cutlass")
    assert newest.missing("quantization=fp8_per_tensor") is None and pinned.missing("quantization=fp8") is None
    assert "--quantization takes no value 'fp8_per_tensor'" in pinned.missing("quantization=fp8_per_tensor")
    assert "cannot read the values --max-num-seqs takes" in newest.missing("max-num-seqs=8")
    serve = tmp_path / "serve.yaml"
    serve.write_text("model: m\ncompilation-config: {pass_config: {enable_qk_norm_rope_fusion: true}}\n"
                     "kernel-config: {moe_backend: flashinfer_cutlass, enable_flashinfer_autotune: false}\n")
    assert cli("--package", str(vllm_newest), "check", str(serve)).returncode == 0
    bad = cli("--package", str(vllm_pinned), "check", str(serve))
    assert bad.returncode == 1 and "no field 'enable_qk_norm_rope_fusion'" in bad.stderr
    assert "--kernel-config" in bad.stderr


def test_environment_variables_are_read_from_envs(vllm_pinned, vllm_newest, tmp_path):
    """The names vLLM reads from its environment (envs.py's environment_variables), for plugins that set one in
    the serve environment file: has-env as a precondition, check-env as a check."""
    pinned, newest = vllm_options.read(vllm_pinned), vllm_options.read(vllm_newest)
    assert len(pinned.env_vars) > 100 and {"VLLM_USE_V1", "VLLM_SERVER_DEV_MODE"} <= pinned.env_vars
    assert newest.missing_env("VLLM_USE_BREAKABLE_CUDAGRAPH") is None
    assert pinned.missing_env("VLLM_USE_BREAKABLE_CUDAGRAPH") == \
        f"vLLM {PINNED} at {vllm_pinned} reads no environment variable VLLM_USE_BREAKABLE_CUDAGRAPH"
    assert newest.missing_env("CUDA_VISIBLE_DEVICES") is None  # only VLLM_ names are vLLM's to judge
    ok = cli("--package", str(vllm_newest), "has-env", "VLLM_USE_BREAKABLE_CUDAGRAPH")
    assert ok.returncode == 0 and ok.stdout.strip().endswith("reads VLLM_USE_BREAKABLE_CUDAGRAPH")
    no = cli("has-env", "VLLM_USE_BREAKABLE_CUDAGRAPH", ORCHESTRATOR_ROOT_VLLM=str(vllm_pinned))
    assert no.returncode == 1 and "reads no environment variable VLLM_USE_BREAKABLE_CUDAGRAPH" in no.stderr
    env = tmp_path / "serve-env.yaml"
    assert cli("--package", str(vllm_newest), "check-env", str(env)).returncode == 0  # none: sets nothing
    env.write_text("VLLM_USE_BREAKABLE_CUDAGRAF: '0'\nNCCL_MIN_NCHANNELS: 4\n")
    typo = cli("--package", str(vllm_newest), "check-env", str(env))
    assert typo.returncode == 1
    assert "reads no environment variable VLLM_USE_BREAKABLE_CUDAGRAF (it reads VLLM_USE_BREAKABLE_CUDAGRAPH)" in \
        typo.stderr
    env.write_text("VLLM_USE_BREAKABLE_CUDAGRAPH: false\n")
    bad = cli("--package", str(vllm_newest), "check-env", str(env))
    assert bad.returncode == 1 and f"{env}: VLLM_USE_BREAKABLE_CUDAGRAPH: the value must be a string" in bad.stderr
    env.write_text("VLLM_USE_BREAKABLE_CUDAGRAPH: '0'\n")
    assert cli("--package", str(vllm_newest), "check-env", str(env)).returncode == 0
    assert "VLLM_USE_BREAKABLE_CUDAGRAPH" in json.loads(cli("--package", str(vllm_newest), "list").stdout)["env_vars"]
