"""The intent log (state/intents.jsonl): every change a step is about to make, written and fsync'd before the
database row that records it, in a file of its own.

SQLite keeps the last transactions in its write-ahead log until a checkpoint copies them into the database
file; damage to that log loses them, and with them the record of what a step changed. The intent log is a second
witness: recovery reads it, finds the changes the database has no row for, restores them and says so. Once no
step is open and a checkpoint has moved everything into the database file, the log is emptied.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

NAME = "intents.jsonl"


class Intents:
    def __init__(self, state_dir: Path):
        self.path = Path(state_dir) / NAME

    def add(self, records: list[dict]) -> None:
        """Append records durably: a record is on disk before the change it announces is recorded or made."""
        if not records:
            return
        created = not self.path.exists()
        data = "".join(json.dumps(r, sort_keys=True) + "\n" for r in records).encode()
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        if created:
            dir_fd = os.open(self.path.parent, os.O_RDONLY)
            try:
                os.fsync(dir_fd)
            finally:
                os.close(dir_fd)

    def read(self) -> list[dict]:
        """Every whole record, oldest first; a line torn by a crash while it was written is skipped."""
        try:
            text = self.path.read_bytes().decode("utf-8", "replace")
        except FileNotFoundError:
            return []
        out = []
        for line in text.split("\n"):
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict) and isinstance(record.get("step"), int):
                out.append(record)
        return out

    def clear(self) -> None:
        self.path.unlink(missing_ok=True)
