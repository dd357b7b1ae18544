"""Fixtures of the serving tests: the tiny engine config, the offline engine, a running server."""
from __future__ import annotations

import uuid
from pathlib import Path

import pytest

import kernels
from serving_support import start_server, write_config


@pytest.fixture
def marker() -> str:
    """A unique word to find a test's server processes by (and only them)."""
    return f"marker{uuid.uuid4().hex[:12]}"


@pytest.fixture(scope="session")
def tiny_config(tmp_path_factory) -> Path:
    return write_config(tmp_path_factory.mktemp("engine"))


@pytest.fixture(scope="session")
def llm(tiny_config):
    """The offline engine on the same config: what the server's answers must equal."""
    from engine import LLM

    return LLM(str(tiny_config))


@pytest.fixture(scope="module")
def server(tiny_config):
    proc, url = start_server(tiny_config)
    yield url
    proc.stop()


@pytest.fixture
def wrong_kernels(monkeypatch):
    """Registers the wrong decode variants of wrong_kernels.py for this test only."""
    monkeypatch.setitem(kernels._REGISTRY, "paged_decode", {
        **kernels._REGISTRY["paged_decode"],
        "off_by_constant": "wrong_kernels:off_by_constant_when_long",
        "crash": "wrong_kernels:crash_when_long",
    })
