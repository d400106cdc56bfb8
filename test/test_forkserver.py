"""The CPU runtime's forkserver (``cpu_runtime.forkserver``): a child forked from it starts as a
spawned one would, in its parent's environment of the moment, with its SIGQUIT reaching the
launcher and its death tied to the launcher's. Each case runs ``forkserver_run.py`` as the
launcher; its forkserver imports SGLang as a server's does (some seconds)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from sglang_eaas import cpu_runtime

pytestmark = pytest.mark.skipif(not cpu_runtime.is_active(), reason="the CPU runtime is off")
RUN = Path(__file__).resolve().parent / "forkserver_run.py"


def launch(mode: str, out: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(RUN), mode, str(out)], stdout=subprocess.PIPE,
                            text=True)


def result(process: subprocess.Popen) -> dict:
    stdout, _ = process.communicate(timeout=180)
    assert process.returncode == 0, stdout
    return json.loads(stdout.strip().splitlines()[-1])


def test_a_child_has_the_environment_of_its_own_start_and_its_own_title(tmp_path):
    process = launch("environ", tmp_path)
    assert result(process) == {"exitcodes": [0, 0]}
    first, second = (json.loads((tmp_path / f"{tag}.json").read_text())
                     for tag in ("first", "second"))
    # the forkserver started with the first child, in the environment of that moment
    assert (first["early"], first["late"]) == ("early", None)
    assert (second["early"], second["late"]) == (None, "late")
    assert (first["title"], second["title"]) == ("forkserver-test::first",
                                                 "forkserver-test::second")
    # forked from the forkserver, not from the launcher
    assert first["parent"] == second["parent"] != process.pid


def test_a_childs_sigquit_to_its_parent_reaches_the_launcher(tmp_path):
    assert result(launch("sigquit", tmp_path)) == {"got_sigquit": True, "exitcode": 0}


def test_the_children_die_with_the_launcher(tmp_path):
    process = launch("orphan", tmp_path)
    marker = tmp_path / "orphan.json"
    deadline = time.monotonic() + 120
    while not marker.exists():
        assert process.poll() is None and time.monotonic() < deadline, "no child started"
        time.sleep(0.2)
    child = json.loads(marker.read_text())
    started = [psutil.Process(child["parent"]), psutil.Process(child["pid"])]
    try:
        assert started[0].ppid() == process.pid  # the forkserver
        os.kill(process.pid, signal.SIGKILL)
        process.wait()
        _, alive = psutil.wait_procs(started, timeout=10)
        assert not alive, alive
    finally:
        for left in started:
            if left.is_running():
                left.kill()
