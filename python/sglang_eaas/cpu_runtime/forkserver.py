"""SGLang's processes forked from one that has imported SGLang, instead of each importing it anew.

SGLang starts its ranks and detokenizer with ``multiprocessing``'s ``spawn``: each is a fresh
interpreter that imports torch, transformers, triton, SGLang with every model it has, and has its
plugins' hooks patch SGLang (which reads every module's namespace). That is some 450-600 MiB of
Python objects per process before it does any work: a ``--tp 2`` server of a 21 MB model cost the
host 2.3 GiB (docs/cpu-runtime.md, "Memory of a server").

On the CPU runtime the start method becomes ``forkserver``: a server process, started at the
first ``Process.start()``, does all of that once (``forkserver_preload``), freezes those objects
out of the garbage collector's reach (a collection would otherwise write to every page of them)
and forks each child from that state. The children share those pages until they write to them.

What a spawned child had and a forked one must have too:

* **The environment of its own start.** A forkserver child inherits the forkserver's
  environment, that of the first start. ``_Process`` carries the parent's ``os.environ`` at each
  start to the child (``run_in_environ``) before SGLang's process function runs.
* **Its parent's signals.** SGLang's ranks and detokenizer send SIGQUIT to their parent process
  when they fail, for the launcher to end the server; their parent is now the forkserver, which
  passes SIGQUIT on to the launcher (``forkserver_preload``).
* **Its death with the launcher.** They die with their parent (``PR_SET_PDEATHSIG``); the
  forkserver dies with the launcher the same way.

Where a setting of SGLang starts its children differently, ``spawn`` stays: NUMA binding
(``SGLANG_NUMA_BIND_V2`` runs each child under ``numactl``) and one visible device per process
(``SGLANG_ONE_VISIBLE_DEVICE_PER_PROCESS``). ``SGLANG_EAAS_FORKSERVER=off`` keeps ``spawn`` too.
"""

from __future__ import annotations

import functools
import multiprocessing
import multiprocessing.context
import os
from typing import Any, Callable

from sglang_eaas import cpu_runtime, envs

# What a forkserver child would import anyway, imported once in the forkserver.
PRELOAD_MODULE = "sglang_eaas.cpu_runtime.forkserver_preload"
# SGLang settings under which its children start in a way a forkserver cannot give them.
SPAWN_ONLY_ENV = ("SGLANG_NUMA_BIND_V2", "SGLANG_ONE_VISIBLE_DEVICE_PER_PROCESS")


def applies() -> bool:
    """Whether SGLang's children are forked from a forkserver in this process (module docstring)."""
    if not cpu_runtime.is_active() or envs.FORKSERVER.get().strip().lower() == "off":
        return False
    return not any(os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")
                   for name in SPAWN_ONLY_ENV)


def run_in_environ(environ: dict[str, str], target: Callable[..., Any], *args: Any,
                   **kwargs: Any) -> Any:
    """A forkserver child's process function: ``target`` in the environment its parent had when
    it started the child (not the forkserver's, which is the first child's). Only what differs
    is changed: rewriting the whole environment moves it, and ``setproctitle`` (SGLang names its
    processes with it) then finds no room for a process's title."""
    for name in [name for name in os.environ if name not in environ]:
        del os.environ[name]
    for name, value in environ.items():
        if os.environ.get(name) != value:
            os.environ[name] = value
    return target(*args, **kwargs)


class _Process(multiprocessing.context.ForkServerProcess):
    """A forkserver process whose target runs in the starting process's environment."""

    @staticmethod
    def _Popen(process_obj: Any) -> Any:
        target = process_obj._target
        if target is not None:  # pickled with the process object as the forkserver is asked
            process_obj._target = functools.partial(run_in_environ, dict(os.environ), target)
        try:
            return multiprocessing.context.ForkServerProcess._Popen(process_obj)
        finally:
            process_obj._target = target


class ForkServerContext(multiprocessing.context.ForkServerContext):
    """``multiprocessing``'s forkserver context with ``_Process``."""

    Process = _Process


def set_start_method(set_envs_and_config: Callable[[Any], None], server_args: Any) -> None:
    """AROUND hook of SGLang's ``_set_envs_and_config``, which sets the start method ``spawn``:
    the forkserver with the preload instead, where it ``applies``."""
    set_envs_and_config(server_args)
    if applies():
        use_forkserver()


def use_forkserver() -> None:
    """Make ``multiprocessing.Process`` (which SGLang's ``mp.Process`` is) start through
    ``ForkServerContext``, its forkserver importing ``PRELOAD_MODULE``."""
    multiprocessing.set_start_method("forkserver", force=True)
    multiprocessing.set_forkserver_preload([PRELOAD_MODULE])
    # set_start_method can only pick the stdlib's contexts; the default context's choice is
    # where multiprocessing.Process looks up how to start a process.
    multiprocessing.context._default_context._actual_context = ForkServerContext()
