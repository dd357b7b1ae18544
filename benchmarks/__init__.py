"""Benchmark scripts of the orchestrator core, run from the repository root (`python -m benchmarks.NAME`); each
one's results are in the Markdown file of the same name beside it."""
