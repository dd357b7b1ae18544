"""A stand-in live server whose speed is fixed at start: the state's speed (`speed.txt` in the folder it serves,
read once) times the machine's (MACHINE) times a factor drawn for this start (uniform in 1 ± SPREAD), times a little
noise per sample, slower by AGING for each sample it served before, up to AGED samples. Start k of a run (counted in $STANDIN_STARTS, a file) draws its factor
from seed k, so runs repeat exactly.

    python server.py --port P     # GET /health, GET /sample -> {"ops": ...}
"""
import argparse
import fcntl
import json
import os
import random
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

SPREAD = float(os.environ.get("STANDIN_SPREAD", "0.10"))  # per-start factor: uniform in 1 +- SPREAD
WITHIN = float(os.environ.get("STANDIN_WITHIN", "0.01"))  # per-sample noise: sd of a normal factor
AGING = float(os.environ.get("STANDIN_AGING", "0"))  # each sample served slows the next ones by this fraction,
MACHINE = float(os.environ.get("STANDIN_MACHINE", "1"))  # the machine's speed: another machine of the same kind
AGED = 4  # up to this many: a long-lived server settles slower than a fresh one


def start_index() -> int:
    path = Path(os.environ["STANDIN_STARTS"])
    with open(path, "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        f.seek(0)
        k = len(f.read().split())
        f.write(f"{os.getpid()}\n")
    return k


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    args = p.parse_args()
    speed = float(Path("speed.txt").read_text().split()[0]) * MACHINE
    rng = random.Random(start_index())
    factor = 1 + rng.uniform(-SPREAD, SPREAD)
    served = [0]

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            if self.path == "/health":
                body = b""
            elif self.path == "/sample":
                body = json.dumps({"ops": speed * factor * (1 - AGING) ** min(served[0], AGED) * rng.gauss(1, WITHIN)}).encode()
                served[0] += 1
            else:
                self.send_error(404)
                return
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    ThreadingHTTPServer(("127.0.0.1", args.port), Handler).serve_forever()


if __name__ == "__main__":
    main()
