"""Run by test_forkserver in a process of its own (it is the "launcher"): children started the
way SGLang starts its ranks (``multiprocessing.Process``) once the CPU runtime's forkserver is
the start method (``sglang_eaas.cpu_runtime.forkserver``).

    python forkserver_run.py environ|sigquit|orphan OUT_DIR

- ``environ``: a child, then the environment changed, then another child; each writes what it
  sees of it and names itself with setproctitle, as SGLang does.
- ``sigquit``: a child sends SIGQUIT to its parent, as a failing SGLang rank does; this process
  writes that it got it.
- ``orphan``: a child that asks to die with its parent (SGLang's ``kill_itself_when_parent_died``)
  writes its pid and the forkserver's; this process then waits to be killed.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import sys
import time
from pathlib import Path

import psutil

from sglang_eaas.cpu_runtime import forkserver


def environ_child(out: str, tag: str) -> None:
    import setproctitle

    setproctitle.setproctitle(f"forkserver-test::{tag}")
    seen = {"late": os.environ.get("FORKSERVER_TEST_LATE"),
            "early": os.environ.get("FORKSERVER_TEST_EARLY"),
            "title": psutil.Process().cmdline()[0], "parent": os.getppid()}
    Path(out, f"{tag}.json").write_text(json.dumps(seen))


def sigquit_child() -> None:
    psutil.Process().parent().send_signal(signal.SIGQUIT)


def orphan_child(out: str) -> None:
    from sglang.srt.utils.common import kill_itself_when_parent_died

    kill_itself_when_parent_died()
    Path(out, "orphan.json").write_text(json.dumps({"pid": os.getpid(), "parent": os.getppid()}))
    time.sleep(600)


def main() -> int:
    mode, out = sys.argv[1], sys.argv[2]
    os.environ["FORKSERVER_TEST_EARLY"] = "early"
    forkserver.use_forkserver()
    if mode == "environ":
        first = multiprocessing.Process(target=environ_child, args=(out, "first"))
        first.start()
        first.join()
        os.environ["FORKSERVER_TEST_LATE"] = "late"
        del os.environ["FORKSERVER_TEST_EARLY"]
        second = multiprocessing.Process(target=environ_child, args=(out, "second"))
        second.start()
        second.join()
        print(json.dumps({"exitcodes": [first.exitcode, second.exitcode]}), flush=True)
    elif mode == "sigquit":
        got = []
        signal.signal(signal.SIGQUIT, lambda *_: got.append(True))
        child = multiprocessing.Process(target=sigquit_child)
        child.start()
        child.join()
        deadline = time.monotonic() + 10
        while not got and time.monotonic() < deadline:
            time.sleep(0.05)
        print(json.dumps({"got_sigquit": bool(got), "exitcode": child.exitcode}), flush=True)
    elif mode == "orphan":
        multiprocessing.Process(target=orphan_child, args=(out,)).start()
        time.sleep(600)
    return 0


if __name__ == "__main__":
    sys.exit(main())
