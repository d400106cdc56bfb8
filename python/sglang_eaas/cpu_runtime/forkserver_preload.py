"""Imported by the forkserver of SGLang's processes (``forkserver``), once, before its first fork.

It makes the forkserver a child of the launcher as SGLang's own children are (it dies with the
launcher; the SIGQUIT that a failing rank or detokenizer sends its parent goes on to the
launcher), then does what every rank and detokenizer does first anyway: imports their process
functions' modules and SGLang's model registry (every model module SGLang has), and loads SGLang's
plugins (``load_plugins``: the hooks patch SGLang, reading every module's namespace). A child's own
``load_plugins`` then finds them loaded, as a second call in one process does. Last, ``gc.freeze``:
no collection in a child writes to the pages of these objects.

Anything that fails to import here is left for the child to import, and report, itself.
"""

import ctypes
import gc
import importlib
import os
import signal
import sys

PROCESS_MODULES = (
    "sglang.srt.managers.detokenizer_manager",
    "sglang.srt.managers.scheduler",
    "sglang.srt.model_executor.model_runner",
    "sglang.srt.models.registry",
)
PR_SET_PDEATHSIG = 1

_launcher = os.getppid()


def _to_launcher(signum: int, _frame: object) -> None:
    """SIGQUIT from a child: what it meant for its parent, it means for the launcher."""
    if os.getppid() == _launcher:
        os.kill(_launcher, signum)


def _as_spawned() -> None:
    """In each forked child: SIGQUIT as a spawned process has it."""
    signal.signal(signal.SIGQUIT, signal.SIG_DFL)


if sys.platform == "linux":
    ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != _launcher:  # the launcher died before prctl took
        os._exit(1)
signal.signal(signal.SIGQUIT, _to_launcher)
os.register_at_fork(after_in_child=_as_spawned)

try:
    for _name in PROCESS_MODULES:
        importlib.import_module(_name)
    from sglang.srt.plugins import load_plugins

    load_plugins()
except Exception:  # noqa: BLE001 - a child imports it again and reports what fails
    pass
gc.freeze()
