"""A plugin's unexpected error fails that plugin only, with a one-line reason, and the run goes on; what the
history stores of it is bounded."""
from __future__ import annotations

import os

import pytest

from core_project import add_plugin, make_project, tree

BAD = {
    "binary-replace": ({"apply": [{"replace": {"path": "blob.bin", "old": "binary", "new": "text"}}]},
                       "apply_failed", "replace: blob.bin is not UTF-8 text (byte 0xff at offset 8)"),
    "binary-yaml": ({"apply": [{"yaml_set": {"path": "big.bin", "key": "a.b", "value": 1}}]},
                    "apply_failed", "yaml_set: big.bin is not UTF-8 text (byte 0xff at offset 0)"),
    "huge-binary": ({"apply": [{"replace": {"path": "big.bin", "old": "x", "new": "y"}}]},
                    "apply_failed", "replace: big.bin is not UTF-8 text"),
    "missing-tool": ({"apply": [{"command": {"run": ["no-such-tool-xyz", "--now"]}}]},
                     "apply_failed", "command: executable not found: no-such-tool-xyz"),
    "missing-verifier": ({"apply": [{"replace": {"path": "app.txt", "old": "MODE = plain", "new": "MODE = calm"}}],
                          "verify": [{"command": {"run": ["no-such-verifier"]}}]},
                         "verify_failed", "command: executable not found: no-such-verifier"),
    "deploy-under-file": ({"apply": [{"deploy": {"src": "files/x.txt", "dest": "app.txt/inner.txt"}}]},
                          "apply_failed", "app.txt/inner.txt: app.txt is a file, not a folder"),
    "odd-name": ({"apply": [{"command": {"run": ["python", "-c", "open(b'caf\\xe9.txt', 'w').write('x')"]}}]},
                 "apply_failed", "b'caf\\xe9.txt': a file name that is not UTF-8 text"),
}


def test_each_bad_plugin_fails_alone_and_the_run_goes_on(tmp_path):
    project = make_project(tmp_path / "p", plugins=["speedup"])
    (project.target / "big.bin").write_bytes(b"\xff" + os.urandom(10 << 20))
    for plugin_id, (manifest, _, _) in BAD.items():
        add_plugin(project, {"id": plugin_id, **manifest})
    (project.path / "plugins" / "deploy-under-file" / "files").mkdir()
    (project.path / "plugins" / "deploy-under-file" / "files" / "x.txt").write_text("x")
    original = tree(project.target)
    proc = project.cli("run", timeout=300)
    assert proc.returncode == 0 and "Traceback" not in proc.stdout + proc.stderr, proc.stdout + proc.stderr
    steps = {s["plugin"]: s for s in project.status()["steps"]}
    assert (steps["speedup"]["outcome"], steps["speedup"]["reason"]) == ("kept", None)
    for plugin_id, (_, reason, says) in BAD.items():
        step = steps[plugin_id]
        assert (step["outcome"], step["reason"]) == ("rolled_back", reason), (plugin_id, step)
        assert says in step["detail"] and "\n" not in step["detail"], (plugin_id, step["detail"])
    expected = dict(original)
    expected["app.txt"] = original["app.txt"].replace(b"SPEED = 1", b"SPEED = 2")
    assert tree(project.target) == expected
    longest = max(len(value) for table in ("runs", "steps", "measurements", "events", "decisions")
                  for row in project.db().execute(f"SELECT * FROM {table}") for value in row if isinstance(value, str))
    assert longest <= 16000


PHASES = {"apply": ("orchestrator.steps.compute", "apply_failed", "applying"),
          "verify": ("orchestrator.stage.check", "verify_failed", "verifying"),
          "probe": ("orchestrator.prober.judge_output", "probe_failed", "checking")}


@pytest.mark.parametrize("phase", sorted(PHASES))
def test_an_error_nothing_foresaw_fails_only_its_plugin(tmp_path, monkeypatch, phase):
    """An internal error (a bug) while one plugin is staged: that plugin is rolled back with its phase's reason."""
    import importlib

    from test_stage import outcomes, stage
    where, reason, state = PHASES[phase]
    module, name = where.rsplit(".", 1)
    real = getattr(importlib.import_module(module), name)
    project = make_project(tmp_path / "p", plugins=["not-for-me", "speedup"])
    manifest = project.path / "plugins" / "not-for-me" / "plugin.yaml"  # staged after speedup, verified
    manifest.write_text("id: not-for-me\norder: 100\napply:\n  - replace: {path: app.txt, old: MODE = plain, "
                        "new: MODE = x}\nverify:\n  - contains: {path: app.txt, text: MODE = x}\n")

    def broken(*args, **kwargs):  # breaks only while not-for-me is being staged
        if b"MODE = x" in (project.target / "app.txt").read_bytes() or (
                phase == "apply" and getattr(args[0].body, "new", None) == "MODE = x"):
            raise KeyError("a bug")
        return real(*args, **kwargs)
    monkeypatch.setattr(where, broken)
    original = tree(project.target)
    store, run_id = stage(project)
    assert outcomes(store, run_id) == [("speedup", "kept", None), ("not-for-me", "rolled_back", reason)]
    step = [s for s in store.steps(run_id) if s["plugin"] == "not-for-me"][0]
    assert step["detail"] == f"unexpected error while {state}: KeyError: 'a bug'"
    assert store.run(run_id)["status"] == "finished"
    assert tree(project.target) == {**original, "app.txt": original["app.txt"].replace(b"SPEED = 1", b"SPEED = 2")}
