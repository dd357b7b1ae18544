"""Small parts: steps, substitution, confinement, ordering, the journal's tree snapshots, the embedded default."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from core_project import REPO, tree
from orchestrator.journal import Journal
from orchestrator.loading import ConfigError
from orchestrator.plugin import Check, Manifest, Plugin, Step, confine, order, substitute
from orchestrator.recovery import undo
from orchestrator.steps import StepContext, StepFailed, apply_all, check, compute, read_disk, yaml_set
from orchestrator.store import Store


def test_yaml_set_keeps_comments_order_and_quotes():
    text = "# header\nb: 1  # keep\na:\n  x: 'q'  # quoted\n"
    out = yaml_set(text, "a.x", 256, "f.yaml").decode()
    assert out == "# header\nb: 1  # keep\na:\n  x: 256  # quoted\n"
    assert yaml_set(out, "a.new.deep", "v", "f.yaml").decode().endswith("  new:\n    deep: v\n")
    with pytest.raises(StepFailed, match="b is not a mapping"):
        yaml_set(text, "b.c", 1, "f.yaml")


def test_yaml_has_reads_the_value_whatever_the_layout(tmp_path):
    """yaml_set into a flow mapping writes no `key: value` line, so `contains` would call it missing."""
    serve = tmp_path / "serve.yaml"
    serve.write_text("kernel-config: {enable_flashinfer_autotune: false}\nseqs: [1, 256]\nflag: 1\n")
    serve.write_bytes(yaml_set(serve.read_text(), "kernel-config.moe_backend", "flashinfer_cutlass", "serve.yaml"))
    assert serve.read_text().startswith("kernel-config: {enable_flashinfer_autotune: false, moe_backend: ")
    ctx = StepContext({"target": tmp_path}, "files", tmp_path, {})

    def has(key, value, path="serve.yaml"):
        return check(Check.model_validate({"yaml_has": {"path": path, "key": key, "value": value}}), ctx)

    assert has("kernel-config.moe_backend", "flashinfer_cutlass") == (
        True, "serve.yaml: kernel-config.moe_backend is 'flashinfer_cutlass'")
    assert has("kernel-config.enable_flashinfer_autotune", False)[0]
    assert has("seqs.1", 256)[0]
    assert has("kernel-config.moe_backend", "triton") == (
        False, "serve.yaml: kernel-config.moe_backend is 'flashinfer_cutlass', not 'triton'")
    assert has("flag", True) == (False, "serve.yaml: flag is 1, not True")  # YAML's 1 is not true
    assert has("kernel-config.monokernel", True) == (False, "serve.yaml has no kernel-config.monokernel")
    assert has("seqs.2", 1) == (False, "serve.yaml has no seqs.2")
    assert has("x", 1, "other.yaml") == (False, "other.yaml does not exist")
    (tmp_path / "bad.yaml").write_text("a: [1,\n")
    ok, why = has("a", 1, "bad.yaml")
    assert not ok and why.startswith("yaml_has: cannot parse bad.yaml")
    (tmp_path / "bin.yaml").write_bytes(b"\xff")
    assert has("a", 1, "bin.yaml") == (False, "yaml_has: bin.yaml is not UTF-8 text (byte 0xff at offset 0); "
                                              "it works on text files only")


def test_replace_needs_exactly_count_matches(tmp_path):
    (tmp_path / "f.txt").write_text("a a b")
    ctx = StepContext({"target": tmp_path}, "files", tmp_path, {})
    step = Step.model_validate({"replace": {"path": "f.txt", "old": "a", "new": "c", "count": 2}})
    assert compute(step, ctx, read_disk)[3] == b"c c b"
    one = Step.model_validate({"replace": {"path": "f.txt", "old": "a", "new": "c"}})
    with pytest.raises(StepFailed, match="expected 1 match"):
        compute(one, ctx, read_disk)


def test_substitution():
    assert substitute({"v": "${n}", "s": "x${n}y", "d": "$${n}", "l": ["${n}"]}, {"n": 256}) == \
        {"v": 256, "s": "x256y", "d": "${n}", "l": [256]}


def test_confine(tmp_path):
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "ok").symlink_to(tmp_path / "in")
    (tmp_path / "in" / "out").symlink_to(tmp_path)
    assert confine(tmp_path / "in", "ok/x") == tmp_path / "in" / "ok" / "x"
    for bad in ("../x", "/etc/x", "out/x", ""):
        with pytest.raises(ConfigError):
            confine(tmp_path / "in", bad)


def test_order_respects_after_requires_then_order_and_id(tmp_path):
    def plugin(pid, order_=100, after=(), requires=()):
        return Plugin(Manifest.model_validate({"id": pid, "order": order_, "after": list(after),
                                               "requires": list(requires),
                                               "apply": [{"command": {"run": ["true"]}}]}), tmp_path)
    plugins = [plugin("z", 1, after=["b"]), plugin("b", 50), plugin("a", 50), plugin("c", 5, requires=["a"]),
               plugin("x", 0, after=["missing"])]
    assert [p.id for p in order(plugins)] == ["x", "a", "c", "b", "z"]


def test_command_step_tree_snapshot_restores_everything(tmp_path):
    root = tmp_path / "root"
    (root / "d").mkdir(parents=True)
    (root / "d" / "f.txt").write_text("f")
    (root / "keep.sh").write_text("#!/bin/sh\n")
    os.chmod(root / "keep.sh", 0o755)
    (root / "link").symlink_to("d/f.txt")
    before = tree(root)
    store = Store(tmp_path / "state" / "db.sqlite")
    journal = Journal(store, tmp_path / "state", {"target": root})
    run_id = store.start_run("run", None, "files")
    step_id = store.new_step(run_id, "p", "applying")
    ctx = StepContext({"target": root}, "files", tmp_path, dict(os.environ), journal, step_id)
    script = ("import os, pathlib, shutil; pathlib.Path('d/f.txt').write_text('changed'); os.remove('link'); "
              "os.chmod('keep.sh', 0o600); pathlib.Path('new/deeper').mkdir(parents=True); "
              "pathlib.Path('new/deeper/n.txt').write_text('n')")
    apply_all([Step.model_validate({"command": {"run": ["python", "-c", script]}}),
               Step.model_validate({"replace": {"path": "d/f.txt", "old": "changed", "new": "again"}})], ctx)
    journal.seal(step_id)
    changed = {r["path"]: (r["before"] is None, r["after"] is None) for r in store.file_rows(step_id)}
    assert changed["new/deeper/n.txt"] == (True, False) and "d/f.txt" in changed
    journal.show(step_id, "pre")
    journal.show(step_id, "post")
    assert (root / "d" / "f.txt").read_text() == "again"
    assert undo(store, journal, step_id) == []
    assert tree(root) == before
    assert os.readlink(root / "link") == "d/f.txt" and (root / "keep.sh").stat().st_mode & 0o777 == 0o755


def test_shipped_files_example_runs(tmp_path):
    shutil.copytree(REPO / "orchestrator" / "examples", tmp_path / "example")
    env = {**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "200"}
    proc = subprocess.run([sys.executable, "-m", "orchestrator.cli", "run"], cwd=tmp_path / "example", env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "raise-max-num-seqs" in proc.stdout and "kept" in proc.stdout
    state = tmp_path / "example" / "state"
    assert "max-num-seqs: 256" in (state / "example-target" / "serve.yaml").read_text()
    assert (state / "orchestrator.db").exists()


def test_engine_flags_are_refused_with_a_users_config(tmp_path):
    from orchestrator.config import load
    from orchestrator.loading import ConfigError
    (tmp_path / "orchestrator.yaml").write_text("target: {kind: files, root: t}\n")
    with pytest.raises(ConfigError, match="--device apply to the embedded default only"):
        load(cwd=tmp_path, engine={"device": "cuda"})
    assert load(cwd=tmp_path / "nowhere", engine={"device": "cpu"}).target.kind == "engine"


def test_the_arms_flag_names_its_field_when_wrong_and_writes_nothing(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "200"}

    def calibrate(folder, *args):
        return subprocess.run([sys.executable, "-m", "orchestrator.cli", "calibrate", *args], cwd=folder, env=env,
                              capture_output=True, text=True, timeout=120)
    bare = tmp_path / "bare"
    bare.mkdir()
    proc = calibrate(bare, "--device", "cpu", "--arms", "sideways")
    assert proc.returncode != 0 and "target.arms" in proc.stderr and "simultaneous" in proc.stderr, proc.stderr
    assert list(bare.iterdir()) == []
    own = tmp_path / "own"
    own.mkdir()
    text = "target: {kind: files, root: t}\n"
    (own / "orchestrator.yaml").write_text(text)
    proc = calibrate(own, "--arms", "simultaneous")
    assert proc.returncode != 0 and "--arms apply to the embedded default only" in proc.stderr, proc.stderr
    assert [p.name for p in own.iterdir()] == ["orchestrator.yaml"]
    assert (own / "orchestrator.yaml").read_bytes() == text.encode()


def test_target_variables_and_params_are_substituted(tmp_path):
    from orchestrator.plugin import load_plugin
    folder = tmp_path / "p"
    folder.mkdir()
    (folder / "plugin.yaml").write_text(
        "id: p\nparams: {n: [1, 2]}\napply:\n"
        "  - yaml_set: {path: '${serve_config}', key: max-num-seqs, value: '${n}'}\n"
        "  - command: {run: [echo, '$${serve_config}', 'n=${n}']}\n")
    plugin = load_plugin(folder, {"serve": tmp_path}, {"serve_config": "serve.yaml"})
    assert [v.params for v in plugin.variants] == [{"n": 1}, {"n": 2}]
    step, cmd = plugin.variants[1].apply
    assert (step.body.path, step.body.value) == ("serve.yaml", 2)
    assert cmd.body.run == ["echo", "${serve_config}", "n=2"]
