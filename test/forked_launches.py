"""``python -m sglang.launch_server ARGS`` for many ARGS with SGLang imported once.

``python forked_launches.py CASES.json OUT.json PARALLEL``: CASES.json is a list of argument
lists; OUT.json gets, per case, ``{"returncode", "stdout", "stderr"}``. This process imports
``sglang.launch_server`` and loads the plugins (SGLang's and torch's imports: about 10 s of a
core, most of a failing launch), then forks a child per case, at most PARALLEL at a time, that
runs the module as ``-m`` would (``runpy``, ``__main__``) with its own stdout and stderr and
exits as the interpreter would: ``SystemExit``'s code, its message on stderr, or a traceback
and 1. What the launch does after its imports is the launch's own code, unchanged; what the
imports do is the same for every case (test_plugin starts the real command for that).
"""

from __future__ import annotations

import json
import os
import runpy
import sys
import tempfile
import traceback


def _child(args: list[str], out: str, err: str) -> None:
    """In the forked child: the launch, then ``os._exit`` with the interpreter's status."""
    for fd, path in ((1, out), (2, err)):
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(target, fd)
        os.close(target)
    code = 0
    try:
        sys.argv = [sys.argv[0], *args]
        runpy.run_module("sglang.launch_server", run_name="__main__", alter_sys=True)
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            code = exc.code or 0
        else:
            print(exc.code, file=sys.stderr)
            code = 1
    except BaseException:  # noqa: BLE001 - as the interpreter: the traceback, status 1
        traceback.print_exc()
        code = 1
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code)


def main() -> None:
    cases_path, out_path, parallel = sys.argv[1], sys.argv[2], int(sys.argv[3])
    cases = json.loads(open(cases_path).read())
    import sglang.launch_server  # noqa: F401 - the imports every case shares
    from sglang.srt.plugins import load_plugins

    load_plugins()
    sys.stdout.flush()
    sys.stderr.flush()
    work = tempfile.mkdtemp(prefix="forked-launches-")
    running: dict[int, int] = {}  # pid -> case
    codes: dict[int, int] = {}
    pending = list(range(len(cases)))
    while pending or running:
        while pending and len(running) < parallel:
            case = pending.pop(0)
            pid = os.fork()
            if pid == 0:
                _child(cases[case], f"{work}/{case}.out", f"{work}/{case}.err")
            running[pid] = case
        pid, status = os.wait()
        if pid in running:
            codes[running.pop(pid)] = os.waitstatus_to_exitcode(status)
    results = [{"returncode": codes[i], "stdout": open(f"{work}/{i}.out").read(),
                "stderr": open(f"{work}/{i}.err").read()} for i in range(len(cases))]
    with open(out_path, "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main()
