"""A peer process for test_ibgda: connects to a region and acts one-sidedly on it.

    python ibgda_peer.py BACKEND HANDLE_JSON echo    # put a request, wait for the answer, check it
    python ibgda_peer.py BACKEND HANDLE_JSON flood   # publish rounds of a uniform payload forever,
                                                     # written in CHUNKS writes, then the flag

Layout used by both sides: request flag at 0, answer flag at 64, request payload at 4096,
answer payload at 4096 + PAYLOAD.
"""

from __future__ import annotations

import json
import os
import sys

import torch

REQUEST_FLAG, ANSWER_FLAG, DATA = 0, 64, 4096
CHUNKS = 64


def payload_bytes(backend: str) -> int:
    """Small for the interpreted device kernels, large enough elsewhere to be killed mid-copy."""
    return 64 << 10 if backend == "device" else 8 << 20


def main() -> None:
    backend, handle, mode = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
    if backend == "device":
        os.environ["TRITON_INTERPRET"] = "1"
    import ibgda

    peer = ibgda.create_transport(backend).connect(ibgda.RegionHandle.from_dict(handle))
    n = payload_bytes(backend)
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
            peer.store_flag(REQUEST_FLAG, round_)
            while peer.load_flag(REQUEST_FLAG) != 0:
                pass
    peer.close()


if __name__ == "__main__":
    main()
