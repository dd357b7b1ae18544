"""Runs the orchestrator's CLI with a fault injected: `python fault_run.py WHERE N CLI-ARGS...` makes the N-th
blob written (`blob`), target file written (`target`) or measurement stored (`db`) fail as on a full disk; `clock`
gives every target file written the modification time N (seconds), as when all writes fall within one second; `slow`
makes the N-th target file written take long, as on a slow disk: half its bytes, 1.5 s, the rest, then it hangs
(marker-slow-half and marker-slow-written in $TEST_MARKER_DIR say where it is)."""
import errno
import os
import sqlite3
import sys
import time
from pathlib import Path


def main() -> None:
    where, n, args = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
    from orchestrator import journal, steps, store
    calls = [0]

    def hit() -> bool:
        calls[0] += 1
        return calls[0] == n

    if where == "blob":
        put_file = journal.Journal.put_file

        def full_blob(self, path):
            if hit():
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self.blobs / ".incoming.orch-tmp"))
            return put_file(self, path)
        journal.Journal.put_file = full_blob
    elif where == "target":
        write_image = journal.write_image

        def full_target(path, data, mode=None):
            if hit():
                with open(path, "r+b" if os.path.exists(path) else "wb") as f:  # half the bytes, then no space
                    f.write(data[:len(data) // 2])
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
            return write_image(path, data, mode)
        journal.write_image = steps.write_image = full_target
    elif where == "clock":
        write_image = journal.write_image

        def one_second(path, data, mode=None):
            write_image(path, data, mode)
            os.utime(path, (n, n))
        journal.write_image = steps.write_image = one_second
    elif where == "slow":
        write_image = journal.write_image
        marker = Path(os.environ["TEST_MARKER_DIR"])

        def slow_target(path, data, mode=None):
            if not hit():
                return write_image(path, data, mode)
            with open(path, "r+b" if os.path.exists(path) else "wb") as f:  # rewritten in place, as write_image does
                f.write(data[:len(data) // 2])
                f.flush()
                (marker / "marker-slow-half").write_text("x")
                time.sleep(1.5)
                f.write(data[len(data) // 2:])
                f.flush()
                (marker / "marker-slow-written").write_text("x")
                time.sleep(120)
        journal.write_image = steps.write_image = slow_target
    elif where == "db":
        add_measurement = store.Store.add_measurement

        def full_db(self, **row):
            if hit():
                e = sqlite3.OperationalError("database or disk is full")
                e.sqlite_errorcode, e.sqlite_errorname = 13, "SQLITE_FULL"
                raise e
            return add_measurement(self, **row)
        store.Store.add_measurement = full_db
    from orchestrator.cli import app
    sys.argv = ["orchestrator", *args]
    app()


if __name__ == "__main__":
    main()
