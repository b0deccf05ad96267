"""The fake llama.cpp programs the bench tests run where the real ones are not built: a
llama-server that streams `n` tokens per request (never EOS: it honours ignore_eos) and counts
them, a llama-bench that prints one run's figures, and a llama-batched-bench that prints one
batch's. Each writes the arguments it got beside
itself, for the tests to check."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

FAKE_SERVER = r'''
import json, os, sys, threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

HERE = Path(__file__).parent
if "--version" in sys.argv:
    print("version: 42 (fake)", file=sys.stderr)
    sys.exit(0)
(HERE / "server-args.json").write_text(json.dumps(sys.argv[1:]))
written = []
lock = threading.Lock()


class Handler(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def _json(self, body):
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        self._json({"status": "ok"} if self.path == "/health" else {"data": [{"id": "fake"}]})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        # llama-server honours ignore_eos; without it this one stops after two tokens, as at an EOS
        n = body["max_tokens"] if body.get("ignore_eos") else min(2, body["max_tokens"])
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for _ in range(n):
            self.wfile.write(b'data: {"choices": [{"delta": {"content": "x"}}]}\n\n')
        # counted before the stream ends, in a file swapped in whole: the bench stops this server
        # as soon as the last stream is done, which may be mid-write of a file written in place
        with lock:
            written.append(n)
            (HERE / "written.tmp").write_text(json.dumps(written))
            os.replace(HERE / "written.tmp", HERE / "written.json")
        usage = {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": n}}
        self.wfile.write(b"data: " + json.dumps(usage).encode() + b"\n\ndata: [DONE]\n\n")


ThreadingHTTPServer(("127.0.0.1", int(sys.argv[sys.argv.index("--port") + 1])), Handler).serve_forever()
'''

FAKE_BENCH = r'''
import json, sys
from pathlib import Path

(Path(__file__).parent / "bench-args.json").write_text(json.dumps(sys.argv[1:]))
print(json.dumps([{"avg_ts": 123.4, "stddev_ts": 1.5, "samples_ts": [126.8, 120.0, 123.4]}]))
'''


FAKE_BATCHED_BENCH = r'''
import json, sys
from pathlib import Path

(Path(__file__).parent / "batched-args.json").write_text(json.dumps(sys.argv[1:]))
print("a log line")
print(json.dumps({"pp": 16, "tg": 8, "pl": 4, "t": 2.0, "speed": 48.0, "speed_pp": 64.0, "speed_tg": 32.0}))
'''


@pytest.fixture
def fake_llama_cpp(tmp_path) -> Path:
    for name, source in (("llama-server", FAKE_SERVER), ("llama-bench", FAKE_BENCH),
                         ("llama-batched-bench", FAKE_BATCHED_BENCH)):
        program = tmp_path / name
        program.write_text(f"#!{sys.executable}\n{source}")
        program.chmod(0o755)
    return tmp_path
