"""The vllm target's configuration probe (orchestrator.probes.vllm_config): what a live server resolved its options
to, read from the stand-in `vllm` (standin/vllm serves GET /server_info in development mode, with an instance id,
ports, a cache folder, a compile time, the KV cache's blocks, an object address, a set's order and a shared-memory
buffer's name that change at every start), the engine arguments from the real 0.10.2
source; and a staged run in which a plugin that sets a default is rolled back unmeasured."""
from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from orchestrator.probes import vllm_config
from orchestrator.probes.live_server import LiveServer
from test_vllm_live import STANDIN, measurements, server_starts, standin_env
from test_vllm_sleep import SERVE, project, run, serve_set
from vllm_source import linked

SERVER = [str(STANDIN), "serve", "--config", "{config}", "--host", "{host}", "--port", "{port}"]


def probe(folder: Path, package: Path, serve: str, *source: str) -> tuple[int, dict]:
    """The probe's exit code and result line for `serve` (a serve config's text), reading from its own stand-in
    server unless `source` names one."""
    config = folder / f"serve-{abs(hash(serve))}.yaml"
    config.write_text(serve)
    source = source or ("--server-cmd", shlex.join(SERVER).replace("{config}", str(config)))
    out = subprocess.run([sys.executable, "-m", "orchestrator.probes.vllm_config", *source, "--serve-config",
                          str(config), "--package", str(package), "--startup-timeout", "60"],
                         env=standin_env(folder), capture_output=True, text=True, timeout=180)
    return out.returncode, json.loads(out.stdout.strip().splitlines()[-1])


def test_two_starts_of_one_config_read_the_same_and_a_default_set_reads_as_unset(tmp_path, vllm_pinned):
    code, first = probe(tmp_path, vllm_pinned, SERVE)
    assert code == 0, first
    _, again = probe(tmp_path, vllm_pinned, SERVE + "# the same options\n")
    assert again["configuration"] == first["configuration"]
    engine = first["configuration"]["engine"]
    assert engine["scheduler_config.max_num_seqs"] == 8 and engine["scheduler_config.async_scheduling"] is True
    assert not any("instance_id" in k or "port" in k or "cache_dir" in k for k in engine), sorted(engine)
    assert engine["model_config.hf_config"] == "<HFConfig object at 0x…>"
    assert engine["compilation_config.traced_files"] == '["a.py", "b.py", "c.py"]'
    assert not any(k.endswith(("compilation_time", "num_gpu_blocks")) for k in engine)
    assert first["configuration"]["env"] == {"VLLM_SERVER_DEV_MODE": True}  # VLLM_PORT, the shm buffer's name left out
    # the stand-in's own option is no engine argument of vLLM 0.10.2: it counts as the frontend's
    assert first["configuration"]["frontend"] == {"standin-speed": 0.5}

    _, default = probe(tmp_path, vllm_pinned, SERVE + "async-scheduling: true\n")
    assert default["configuration"] == first["configuration"]


@pytest.mark.parametrize("serve, section", [(SERVE.replace("max-num-seqs: 8", "max-num-seqs: 4"), "engine"),
                                            (SERVE + "api-server-count: 2\n", "frontend")])
def test_a_changed_option_reads_differently(tmp_path, vllm_pinned, serve, section):
    """An engine option shows in the resolved config; the API server's own (`api-server-count`, which vLLM's
    engine config does not hold) in the serve config's frontend keys."""
    _, before = probe(tmp_path, vllm_pinned, SERVE)
    _, after = probe(tmp_path, vllm_pinned, serve)
    changed = [k for k in before["configuration"] if before["configuration"][k] != after["configuration"][k]]
    assert changed == [section], (before, after)


def test_a_server_out_of_development_mode_is_a_clear_failure(tmp_path, vllm_pinned):
    config = tmp_path / "serve.yaml"
    config.write_text(SERVE)
    env = {k: v for k, v in standin_env(tmp_path).items() if k != "VLLM_SERVER_DEV_MODE"}
    argv = [a.replace("{config}", str(config)) for a in SERVER]
    with LiveServer(argv, env=env, stop_timeout=5) as server:
        server.wait_healthy(60)
        code, out = probe(tmp_path, vllm_pinned, SERVE, "--base-url", server.url)
    assert code == 1 and "answered 404" in out["error"] and "VLLM_SERVER_DEV_MODE=1" in out["error"], out


@pytest.mark.parametrize("text", ["- max-num-seqs\n", "max-num-seqs: 4\nmax-num-seqs: 8\n"])
def test_a_serve_config_it_cannot_read_is_named(tmp_path, text):
    bad = tmp_path / "bad.yaml"
    bad.write_text(text)
    with pytest.raises(vllm_config.ProbeFailure, match=str(bad)):
        vllm_config.frontend_reading(bad, frozenset())


def test_the_package_digest_sees_a_patch_and_not_a_cache(tmp_path, vllm_pinned):
    package = linked(vllm_pinned, tmp_path / "vllm")
    before = vllm_config.package_digest(package)
    (package / "__pycache__").mkdir(exist_ok=True)
    (package / "__pycache__" / "x.cpython-311.pyc").write_bytes(b"\0" * 16)
    assert vllm_config.package_digest(package) == before
    target = package / "engine" / "arg_utils.py"
    text = target.read_text()
    target.unlink()  # a link to the shared tree: replaced by a file of its own
    target.write_text(text + "\n# patched\n")
    patched = vllm_config.package_digest(package)
    assert patched != before
    (package / "note.txt").write_text("a file the package never had\n")
    assert vllm_config.package_digest(package) != patched


def test_a_plugin_that_sets_the_default_is_rolled_back_unmeasured(tmp_path, vllm_pinned):
    """On the sleeping pairing: `async-scheduling: true` resolves to the kept state's config, so it is rolled back
    as no_gain by rule `configuration` after one server start and no sample; a real change is measured."""
    plugins = {"async-default": serve_set("async-scheduling", True), "fewer-seqs": serve_set("max-num-seqs", 4)}
    policy = {"repeats": 1, "min_gain": 0.03, "min_pairs": 1, "max_pairs": 1}
    folder = project(tmp_path, linked(vllm_pinned, tmp_path / "vllm"), plugins, policy)
    run(folder, "run")
    from test_vllm_live import cli
    steps = {s["plugin"]: s for s in json.loads(cli(folder, "status", "--json").stdout)["steps"]}
    noop = steps["async-default"]
    assert (noop["outcome"], noop["reason"], noop["decision"]["rule"]) == ("rolled_back", "no_gain", "configuration")
    probes = [m["probe"] for m in measurements(folder, "async-default")]
    assert "serving" not in probes and probes.count("vllm-config") == 1, probes
    starts = server_starts(folder)
    assert starts["async-default"] == ["live server (candidate)"], starts
    assert steps["fewer-seqs"]["decision"]["rule"] != "configuration", steps["fewer-seqs"]
    assert "serving" in [m["probe"] for m in measurements(folder, "fewer-seqs")]
