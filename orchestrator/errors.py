"""Errors the CLI reports as a plain message with exit status 1 (bad input is loading.ConfigError, exit 2)."""


class UserError(Exception):
    """Something the user can act on: a run in progress, a refused rollback, nothing recorded yet."""
