"""The vllm target kind and the patch checker its plugins verify with."""
from __future__ import annotations

import importlib.metadata
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from orchestrator import patchcheck
from orchestrator.loading import ConfigError
from orchestrator.targets import target_class
from orchestrator.targets.vllm import VllmTarget, deployed_kernels
from orchestrator.targets.vllm_options import find_package
from vllm_source import OPTIMIZATIONS, REPO


def make(tmp_path: Path, **fields) -> VllmTarget:
    config = VllmTarget.Config(**{"kind": "vllm", **fields})
    return VllmTarget(config, tmp_path, tmp_path / "state")


@pytest.fixture
def deployment(tmp_path):
    (tmp_path / "site" / "vllm").mkdir(parents=True)
    (tmp_path / "site" / "vllm" / "__init__.py").write_text("raise ImportError('vllm must not be imported')\n")
    (tmp_path / "conf").mkdir()
    (tmp_path / "conf" / "serve.yaml").write_text("model: Qwen/Qwen3-30B-A3B\nmax-num-seqs: 1\n")
    return tmp_path


def test_registry_maps_the_kind_to_this_class():
    assert target_class("vllm") is VllmTarget


def test_roots_vars_and_env(deployment):
    target = make(deployment, package="site/vllm", serve_config="conf/serve.yaml", env={"VLLM_USE_V1": "0"},
                  model="my/model")
    assert target.roots == {"vllm": deployment / "site" / "vllm", "serve": deployment / "conf"}
    assert list(target.roots) == ["vllm", "serve"]  # the package is the default root
    assert target.vars == {"serve_config": "serve.yaml"}
    target.prepare()
    env = target.env()
    assert env["VLLM_USE_V1"] == "0" and env["ORCHESTRATOR_VLLM_MODEL"] == "my/model"
    assert env["PYTHONPATH"].split(os.pathsep)[0] == str(deployment / "site")


def test_default_probes_start_vllm_serve_live(deployment):
    target = make(deployment, package="site/vllm", serve_config="conf/serve.yaml", model="my/model",
                  serve_args=["--load-format", "dummy", "--additional-config", '{"a": 1}'], served_model_name="m36",
                  startup_timeout=120, stop_timeout=5)
    kernels, greedy, serving = target.default_probes()
    # the kernel check of deployed shims starts no server: the staging loop runs it with none alive
    assert (kernels["name"], kernels["role"]) == ("kernels", "correctness")
    assert kernels["command"] == ["python", "-m", "orchestrator.targets.vllm", "check-kernels"]
    assert "--check-command" not in greedy["command"]  # the kernels probe checks the shims, once, with no server
    assert (greedy["name"], greedy["role"]) == ("greedy", "correctness")
    assert (serving["name"], serving["role"], serving["objective"]) == ("serving", "throughput", "score")
    serve = ["vllm", "serve", "my/model", "--config", str(deployment / "conf" / "serve.yaml"), "--host", "{host}",
             "--port", "{port}", "--served-model-name", "m36", "--load-format", "dummy", "--additional-config",
             '{"a": 1}']
    for probe, module in ((greedy, "orchestrator.probes.greedy"), (serving, "orchestrator.probes.serving")):
        cmd = probe["command"]
        assert cmd[:3] == ["python", "-m", module]
        assert shlex.split(cmd[cmd.index("--server-cmd") + 1]) == serve
        assert cmd[cmd.index("--stop-timeout") + 1] == "5" and cmd[cmd.index("--model") + 1] == "m36"
        assert cmd[cmd.index("--server-log-dir") + 1] == str(deployment / "state" / "server-logs")
        assert probe["timeout"] > 120 + 5  # the probe reports a start-up timeout itself, with the log's tail
    assert greedy["command"][greedy["command"].index("--reference") + 1] == str(deployment / "state" / "vllm-reference.json")
    assert greedy["command"][greedy["command"].index("--startup-timeout") + 1] == "120"
    assert serving["command"][serving["command"].index("--health-timeout") + 1] == "120"
    w = dict(zip(serving["command"][::1], serving["command"][1:]))
    assert (w["--num-prompts"], w["--input-len"], w["--output-len"], w["--max-concurrency"]) == \
        ("128", "1000", "200", "128")
    assert (w["--duration"], w["--ramp"], w["--shared-prefix-fraction"]) == ("10.0", "3.0", "0.0")  # the seed's, steady


def test_probes_against_a_running_server_start_none(deployment):
    target = make(deployment, package="site/vllm", serve_config="conf/serve.yaml", objective="cpu_score")
    against = target.probes_against("http://127.0.0.1:8123")
    assert [p["name"] for p in against] == ["greedy", "serving"]  # the probes that talk to a server
    for probe in against:
        cmd = probe["command"]
        assert cmd[cmd.index("--base-url") + 1] == "http://127.0.0.1:8123"
        assert "--server-cmd" not in cmd and "--stop-timeout" not in cmd
    serving = target.probes_against("http://x", 4321)[1]
    assert serving["objective"] == "cpu_score" and serving["command"][serving["command"].index("--server-pid") + 1] == "4321"
    assert "--server-pid" not in target.default_probes()[2]["command"]
    server = target.live_server({"A": "1"}, label="shared")
    assert server.proc is None  # not started
    assert server.argv[:4] == ["vllm", "serve", "--config", str(deployment / "conf" / "serve.yaml")]
    assert server.argv[5] == "127.0.0.1" and server.argv[7] == str(server.port)
    assert server.env == {"A": "1"} and server.stop_timeout == 30 and server.log_dir == deployment / "state" / "server-logs"


@pytest.mark.parametrize("args", [["--port", "8000"], ["--host=0.0.0.0"], ["--config", "other.yaml"]])
def test_serve_args_may_not_take_what_the_probes_set(args):
    with pytest.raises(Exception, match=f"{args[0].split('=')[0]} is set by the probes"):
        VllmTarget.Config(kind="vllm", serve_args=["--max-model-len", "4096", *args])


def test_the_streamed_score_is_an_objective_of_steady_state_windows_only(deployment):
    target = make(deployment, package="site/vllm", serve_config="conf/serve.yaml", objective="score_streamed")
    serving = target.default_probes()[-1]
    assert serving["objective"] == "score_streamed"
    assert serving["command"][serving["command"].index("--best-of") + 1] == "score_streamed"
    with pytest.raises(Exception, match="score_streamed is measured over steady-state windows"):
        VllmTarget.Config(kind="vllm", objective="score_streamed", workload={"duration": None})
    from orchestrator.probes.serving import parse_args
    with pytest.raises(SystemExit):
        parse_args(["--best-of", "score_streamed", "--num-prompts", "4"])


def test_python_in_the_serve_command_is_this_interpreter(deployment):
    target = make(deployment, package="site/vllm", serve_config="conf/serve.yaml",
                  serve_command=["python3", "-m", "vllm.entrypoints.cli.main", "serve"])
    assert target.serve_argv("h", 1)[:5] == [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", "--config"]
    with pytest.raises(Exception, match="serve_command"):
        VllmTarget.Config(kind="vllm", serve_command=[])


def test_installed_package_is_found_without_importing_it(deployment, monkeypatch):
    monkeypatch.syspath_prepend(str(deployment / "site"))
    assert find_package() == deployment / "site" / "vllm"
    assert "vllm" not in sys.modules
    target = make(deployment, serve_config="conf/serve.yaml")
    assert target.roots["vllm"] == deployment / "site" / "vllm"
    assert "PYTHONPATH" not in target.env()


def test_no_vllm_anywhere_names_the_field(deployment, monkeypatch):
    def not_installed(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)
    monkeypatch.setattr("importlib.metadata.distribution", not_installed)
    with pytest.raises(ConfigError, match="target.package"):
        make(deployment, serve_config="conf/serve.yaml").roots


@pytest.mark.parametrize("fields, field, words", [
    ({"package": "nowhere/vllm", "serve_config": "conf/serve.yaml"}, "target.package", "not a vllm package"),
    ({"package": "site/vllm", "serve_config": "conf/missing.yaml"}, "target.serve_config", "does not exist"),
])
def test_prepare_names_the_bad_field(deployment, fields, field, words):
    with pytest.raises(ConfigError, match=field) as err:
        make(deployment, **fields).prepare()
    assert words in str(err.value)


def test_a_serve_config_without_model_needs_the_override(deployment):
    (deployment / "conf" / "serve.yaml").write_text("max-num-seqs: 1\n")
    with pytest.raises(ConfigError, match="names no `model:`"):
        make(deployment, package="site/vllm", serve_config="conf/serve.yaml").prepare()
    make(deployment, package="site/vllm", serve_config="conf/serve.yaml", model="m").prepare()


def test_the_serve_environment_file_reaches_every_server_start(deployment):
    """serve-env.yaml beside the serve config: read at each call (each server start), over the target's env."""
    target = make(deployment, package="site/vllm", serve_config="conf/serve.yaml",
                  env={"VLLM_USE_V1": "0", "VLLM_LOGGING_LEVEL": "INFO"})
    assert target.serve_env == deployment / "conf" / "serve-env.yaml"
    assert "VLLM_USE_BREAKABLE_CUDAGRAPH" not in target.env()
    target.serve_env.write_text("# opt out of breakable graphs\nVLLM_USE_BREAKABLE_CUDAGRAPH: '0'\n"
                                "VLLM_LOGGING_LEVEL: DEBUG\nNCCL_MIN_NCHANNELS: 4\n")
    target.prepare()
    env = target.env()
    assert (env["VLLM_USE_BREAKABLE_CUDAGRAPH"], env["VLLM_LOGGING_LEVEL"], env["NCCL_MIN_NCHANNELS"]) == \
        ("0", "DEBUG", "4")  # the state's file wins over the target's env
    assert env["VLLM_USE_V1"] == "0"
    target.serve_env.unlink()
    assert "VLLM_USE_BREAKABLE_CUDAGRAPH" not in target.env() and target.env()["VLLM_LOGGING_LEVEL"] == "INFO"


@pytest.mark.parametrize("text, field, words", [
    ("VLLM_USE_BREAKABLE_CUDAGRAPH: false\n", "VLLM_USE_BREAKABLE_CUDAGRAPH", 'not False (vLLM reads "1" and "0"'),
    ("VLLM_X: [1, 2]\n", "VLLM_X", "a string or an integer, not [1, 2]"),
    ("PYTHONPATH: /elsewhere\n", "PYTHONPATH", "set by the orchestrator"),
    ("ORCHESTRATOR_ROOT_VLLM: /x\n", "ORCHESTRATOR_ROOT_VLLM", "set by the orchestrator"),
    ("'BAD NAME': '1'\n", "BAD NAME", "not an environment variable name"),
    ("- VLLM_X\n", None, "must be a mapping"),
    ("VLLM_X: [\n", None, "cannot read the serve environment"),
])
def test_a_bad_serve_environment_names_the_file_and_key_and_changes_nothing(deployment, text, field, words):
    """At load (before anything is written), through the CLI: exit 2 naming the file and the key, every byte of
    the deployment as it was."""
    env_file = deployment / "conf" / "serve-env.yaml"
    env_file.write_text(text)
    with pytest.raises(ConfigError) as err:
        make(deployment, package="site/vllm", serve_config="conf/serve.yaml").prepare()
    assert (err.value.path, err.value.field) == (env_file, field) and words in err.value.message
    (deployment / "orchestrator.yaml").write_text(
        "target: {kind: vllm, package: site/vllm, serve_config: conf/serve.yaml}\nplugins: plugins\nstate: state\n")
    (deployment / "plugins").mkdir()
    before = {p: p.read_bytes() for p in deployment.rglob("*") if p.is_file()}
    run = subprocess.run([sys.executable, "-m", "orchestrator.cli", "run", "--config", "orchestrator.yaml"],
                         cwd=deployment, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    assert run.returncode == 2, run.stdout[-2000:] + run.stderr[-2000:]
    assert str(env_file) in run.stdout + run.stderr and words.split(" (")[0] in " ".join((run.stdout + run.stderr).split())
    assert {p: p.read_bytes() for p in deployment.rglob("*") if p.is_file()} == before
    assert not (deployment / "state").exists()


def test_unknown_config_keys_are_rejected():
    with pytest.raises(Exception, match="serve_confg"):
        VllmTarget.Config(kind="vllm", serve_confg="x.yaml")


def test_deployed_kernels_are_read_from_the_shims():
    assert deployed_kernels(OPTIMIZATIONS) == [("paged_decode", "v2_layout"), ("paged_decode", "v2_triton"),
                                               ("prefix_prefill", "triton")]


def test_check_kernels_probe_checks_what_is_deployed(tmp_path):
    package = tmp_path / "vllm"
    package.mkdir()
    env = {**os.environ, "PYTHONPATH": str(REPO), "ORCHESTRATOR_ROOT_VLLM": str(package)}
    probe = [sys.executable, "-m", "orchestrator.targets.vllm", "check-kernels"]
    nothing = subprocess.run(probe, env=env, capture_output=True, text=True, timeout=120)
    assert nothing.returncode == 0 and json.loads(nothing.stdout.splitlines()[-1]) == {"passed": True, "checked": []}
    shim = OPTIMIZATIONS / "decode-v2-triton" / "files" / "_orchestrator_decode_v2_triton.py"
    (package / shim.name).write_bytes(shim.read_bytes())
    one = subprocess.run(probe, env=env, capture_output=True, text=True, timeout=300)
    result = json.loads(one.stdout.splitlines()[-1])
    assert one.returncode == 0, one.stderr[-2000:]
    assert [(r["op"], r["variant"], r["passed"]) for r in result["checked"]] == [("paged_decode", "v2_triton", True)]


# ------------------------------------------------------------------ patchcheck


SOURCE = """
class PagedAttention:
    @staticmethod
    def forward_decode(query, key_cache, *, scale, **extra):
        return query


def op(a, b=1, /, c=2, *args):
    pass
"""


def run_check(path: Path, *functions: str) -> subprocess.CompletedProcess:
    args = [a for f in functions for a in ("--function", f)]
    return subprocess.run([sys.executable, "-m", "orchestrator.patchcheck", str(path), *args],
                          env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=60)


def test_patchcheck_accepts_matching_signatures_and_writes_nothing(tmp_path):
    path = tmp_path / "mod.py"
    path.write_text(SOURCE)
    result = run_check(path, "PagedAttention.forward_decode(query, key_cache, *, scale, **extra)",
                       "op(a, b, /, c, *args)", "op")
    assert result.returncode == 0, result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mod.py"]  # no __pycache__


@pytest.mark.parametrize("spec, message", [
    ("PagedAttention.forward_decode(query, key_cache, scale)", "has parameters (query, key_cache, *, scale, **extra)"),
    ("PagedAttention.forward_prefix", "no definition 'PagedAttention.forward_prefix'"),
    ("PagedAttention", "is not a function"),
    ("op(a, b", "must end with ')'"),
])
def test_patchcheck_failures_say_what_differs(tmp_path, spec, message):
    path = tmp_path / "mod.py"
    path.write_text(SOURCE)
    result = run_check(path, spec)
    assert result.returncode == 1
    assert message in result.stderr


def test_patchcheck_names_file_and_line_of_a_syntax_error(tmp_path):
    path = tmp_path / "mod.py"
    path.write_text(SOURCE + "    try:\n        x = 1\n")
    result = run_check(path)
    assert result.returncode == 1
    assert f"{path}:11: does not compile" in result.stderr


def test_signature_markers():
    import ast

    fn = ast.parse("def f(a, /, b, *c, d, **e): pass").body[0]
    assert patchcheck.signature(fn) == ["a", "/", "b", "*c", "d", "**e"]


def test_a_bad_live_field_is_refused_before_anything_changes(deployment):
    serve = deployment / "conf" / "serve.yaml"
    before = serve.read_bytes()
    (deployment / "orchestrator.yaml").write_text(
        "target: {kind: vllm, package: site/vllm, serve_config: conf/serve.yaml,\n"
        "         serve_args: [--max-model-len, '4096', --port, '8000'], startup_timeout: 60}\n")
    result = subprocess.run([sys.executable, "-m", "orchestrator.cli", "run", "--config", "orchestrator.yaml"],
                            cwd=deployment, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 2
    assert "orchestrator.yaml" in result.stderr and "target.serve_args" in result.stderr
    assert "--port is set by the probes" in result.stderr
    assert serve.read_bytes() == before and not (deployment / "state").exists()
