"""Processes for the ibgda tests: a peer that connects to a region and acts one-sidedly on it,
and a region owner that answers it.

    python ibgda_peer.py BACKEND HANDLE_JSON echo    # put a request, wait for the answer, check it
    python ibgda_peer.py BACKEND HANDLE_JSON flood   # publish rounds of a uniform payload forever,
                                                     # written in CHUNKS writes, then the flag
    python ibgda_peer.py BACKEND - owner             # create a region, print its handle, answer
                                                     # one echo request, exit on stdin's EOF
    IBGDA_TEST_HOST=10.0.0.1 ...                     # mooncake: the address peers reach us at

Layout used by both sides: request flag at 0, answer flag at 64, request payload at 4096,
answer payload at 4096 + PAYLOAD.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch

REQUEST_FLAG, ANSWER_FLAG, DATA = 0, 64, 4096
CHUNKS = 64
CHUNK_PAUSE = 200e-6  # seconds between chunks: a whole round takes > 13 ms even on shm


def payload_bytes(backend: str) -> int:
    """Small for the interpreted device kernels, large enough elsewhere to be killed mid-copy."""
    return 64 << 10 if backend == "device" else 8 << 20


def main() -> None:
    backend, handle, mode = sys.argv[1], sys.argv[2], sys.argv[3]
    if backend == "device" and not torch.cuda.is_available():  # the CPU twin
        os.environ["TRITON_INTERPRET"] = "1"
    import ibgda

    host = os.environ.get("IBGDA_TEST_HOST")
    transport = ibgda.create_transport(backend, **({"host": host} if host else {}))
    n = payload_bytes(backend)
    if mode == "owner":
        answer_one_echo(transport, n)
        return
    peer = transport.connect(ibgda.RegionHandle.from_dict(json.loads(handle)))
    if mode == "echo":
        request = torch.arange(n // 4, dtype=torch.int32)
        peer.put_signal([(DATA, request)], REQUEST_FLAG, 1)
        assert peer.wait_flag(ANSWER_FLAG, 2, timeout=60.0), "no answer"
        answer = torch.empty_like(request)
        peer.read(DATA + n, answer)
        print("ok" if torch.equal(answer, request * 3) else "wrong answer", flush=True)
    elif mode == "flood":
        round_, chunk = 0, n // CHUNKS
        print("flooding", flush=True)
        while True:  # until killed; the owner consumes each round by zeroing the flag
            round_ = round_ % 255 + 1
            data = torch.full((chunk,), round_, dtype=torch.uint8)
            for c in range(CHUNKS):  # a multi-part request, as a client slot writes one
                peer.write(DATA + c * chunk, data)
                time.sleep(CHUNK_PAUSE)  # a wide window for the owner's kill to land in
            peer.store_flag(REQUEST_FLAG, round_)
            while peer.load_flag(REQUEST_FLAG) != 0:
                pass
    peer.close()


def answer_one_echo(transport, n: int) -> None:
    """The owner's side of ``echo``: the request must arrive whole; answer it times 3."""
    region = transport.create_region(DATA + 2 * n)
    print(json.dumps(region.handle.to_dict()), flush=True)
    while region.load_flag(REQUEST_FLAG) != 1:
        time.sleep(1e-4)
    request = region.view(DATA, n).view(torch.int32)  # device memory on a GPU node
    whole = torch.equal(request.cpu(), torch.arange(n // 4, dtype=torch.int32))
    region.view(DATA + n, n).view(torch.int32).copy_(request * 3)
    region.store_flag(ANSWER_FLAG, 2)
    region.notify(ANSWER_FLAG + 4)
    print("request whole" if whole else "request torn", flush=True)
    sys.stdin.read()  # the peer has read the answer
    region.close()


if __name__ == "__main__":
    main()
