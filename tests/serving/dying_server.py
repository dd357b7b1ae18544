"""The engine server, made to die (exit 7) once it has finished a given number of requests:
how a server that crashes mid-benchmark looks to the serving probe.

    python dying_server.py N --config SERVE.yaml --port PORT
"""
import os
import sys
import threading
import time

from engine import server as serve

LIMIT = int(sys.argv[1])
build_app = serve.build_app


def build_dying_app(*args, **kwargs):
    app = build_app(*args, **kwargs)
    worker = app.state.worker

    def watch():
        while worker.stats["requests_finished"] < LIMIT:
            time.sleep(0.005)
        os._exit(7)

    threading.Thread(target=watch, daemon=True).start()
    return app


serve.build_app = build_dying_app
sys.exit(serve.main(sys.argv[2:]))
