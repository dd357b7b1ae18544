"""Stages optimizations of an LLM inference deployment: apply, verify, measure, keep or roll back."""
__version__ = "0.1.0"
