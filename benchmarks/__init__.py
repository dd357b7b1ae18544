"""Benchmark and measurement scripts, run from the repository root (`python -m benchmarks.NAME`); their results
are the Markdown files beside them (overhead.md for overhead.py, decisions.md for decisions.py, ...)."""
