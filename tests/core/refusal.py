"""Helpers for tests of refused input: change a test project's config; check that commands exit 2 and change nothing."""
from __future__ import annotations

import yaml

from core_project import tree


def configure(project, **changes) -> None:
    config = yaml.safe_load(project.config.read_text())
    for key, value in changes.items():
        if isinstance(value, dict) and isinstance(config.get(key), dict):
            config[key].update(value)
        else:
            config[key] = value
    project.config.write_text(yaml.safe_dump(config))


def refused(project, expected: list[str], commands=(("run",), ("rollback", "--all"), ("recover",), ("status",)),
            timeout: float = 120):
    """Every command exits 2 with all of `expected` in its message and leaves the whole project as it was."""
    before = tree(project.path)
    for command in commands:
        proc = project.cli(*command, timeout=timeout)
        message = " ".join(proc.stderr.split())
        assert proc.returncode == 2, (command, proc.stdout, proc.stderr)
        assert "Traceback" not in proc.stderr
        for fragment in expected:
            assert fragment in message, (command, message)
    assert tree(project.path) == before
