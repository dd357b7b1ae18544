"""Session fixtures: the unpacked vllm package trees of the pinned and the newest release."""
from __future__ import annotations

from pathlib import Path

import pytest

from vllm_source import PINNED, newest_version, unpack, wheel


@pytest.fixture(scope="session")
def vllm_pinned(tmp_path_factory) -> Path:
    return unpack(wheel(PINNED), tmp_path_factory.mktemp(f"vllm-{PINNED}"))


@pytest.fixture(scope="session")
def vllm_newest(tmp_path_factory) -> Path:
    version = newest_version()
    return unpack(wheel(version), tmp_path_factory.mktemp(f"vllm-{version}"))
