"""``Partition``: a TCP relay that can be cut, to put a network partition between one process and
another (an expert server and its monitor) on one host, without network namespaces.

While cut it forwards nothing, not even a close (a partition drops packets; neither end sees
the other go), and new connections are accepted and wait; healed, it goes on where it stopped.
Used by ``bench_faults.py --hog`` and test_suspicion.py.
"""

from __future__ import annotations

import select
import socket
import threading
import time


class Partition:
    def __init__(self, upstream: str):
        host, port = upstream.rsplit(":", 1)
        self.upstream = (host, int(port))
        self.cut = threading.Event()  # set: partitioned
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self._listener.getsockname()[1]}"
        self._closed = False
        threading.Thread(target=self._accept, name="partition-accept", daemon=True).start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                near, _ = self._listener.accept()
                far = socket.create_connection(self.upstream)
            except OSError:
                if self._closed:
                    return
                continue
            for source, sink in ((near, far), (far, near)):
                threading.Thread(target=self._pump, args=(source, sink), name="partition-pump",
                                 daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket) -> None:
        while not self._closed:
            if self.cut.is_set():
                time.sleep(0.02)
                continue
            try:
                if not select.select([source], [], [], 0.05)[0]:
                    continue
                data = source.recv(65536)
                if not data:
                    break
                sink.sendall(data)
            except (OSError, ValueError):
                break
        for end in (source, sink):
            try:
                end.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def close(self) -> None:
        self._closed = True
        self.cut.clear()
        self._listener.close()
