"""The test and benchmark harness's SGLang process: a port taken before SGLang binds it.

SGLang binds its HTTP port only once the model is loaded, and when the port was taken meanwhile
it logs ``address already in use`` and hangs instead of exiting. ``SGLangServer.start`` must
notice and start again on another port. A stand-in process plays SGLang here: the first one
only logs the bind error and hangs, the next one serves ``/health_generate``.
"""

from __future__ import annotations

import sys

import requests

from sglang_eaas.tools.server_process import SGLangServer

STAND_IN = r"""
import http.server, os, sys, time
port, marker = int(sys.argv[1]), sys.argv[2]
if not os.path.exists(marker):  # the first start: the port is taken
    open(marker, "w").close()
    print(f"ERROR:    [Errno 98] error while attempting to bind on address ('127.0.0.1', {port}):"
          " address already in use", flush=True)
    time.sleep(3600)


class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()
        self.wfile.write(b"ok")


http.server.HTTPServer(("127.0.0.1", port), Health).serve_forever()
"""


class StandIn(SGLangServer):
    def __init__(self, marker, **kwargs):
        self.marker, self.ports = marker, []
        super().__init__("unused", log_path=kwargs["log_path"], startup_timeout=30)

    def _pick_port(self) -> None:
        super()._pick_port()
        self.ports.append(self.port)
        self.command = [sys.executable, "-c", STAND_IN, str(self.port), str(self.marker)]


def test_a_port_taken_before_sglang_binds_it_is_replaced(tmp_path):
    server = StandIn(tmp_path / "first-start-done", log_path=tmp_path / "server.log")
    with server:
        assert len(server.ports) == 2 and server.ports[0] != server.ports[1]
        assert server.url.endswith(f":{server.ports[1]}")
        assert requests.get(f"{server.url}/health_generate", timeout=5).status_code == 200
