"""SGLang's offline benchmarks with the plugin's options.

``python -m sglang.benchmark.one_batch``, ``...one_batch_server`` and ``...offline_throughput``
build their parser from ``ServerArgs.add_cli_args`` without calling SGLang's ``load_plugins()``
first (``launch_server`` and the engine do), so the plugin's hooks are not applied there and
``--eaas`` is an unknown argument. The start-up hook (``cpu_runtime/boot.py``, imported by the
``.pth`` file that ``python -m sglang_eaas.cpu_runtime install`` writes) puts ``LoadPluginsFirst``
on ``sys.meta_path``: when one of those modules is about to be imported (``python -m`` looks it
up before running it), SGLang's ``load_plugins()`` runs, once, and the import goes on as usual.
Nothing else is imported at start-up. docs/plugin.md, "SGLang's benchmarks", says what each
benchmark does with ``--eaas``.
"""

from __future__ import annotations

import sys

BENCHMARKS = frozenset({"sglang.benchmark.one_batch", "sglang.benchmark.one_batch_server",
                        "sglang.benchmark.offline_throughput"})


class LoadPluginsFirst:
    """A meta path finder that finds nothing: it loads SGLang's plugins before a benchmark
    module is looked up, then leaves ``sys.meta_path``."""

    def find_spec(self, name, path=None, target=None):
        if name in BENCHMARKS:
            uninstall()
            from sglang.srt.plugins import load_plugins

            load_plugins()
        return None


def install() -> None:
    if not any(isinstance(f, LoadPluginsFirst) for f in sys.meta_path):
        sys.meta_path.insert(0, LoadPluginsFirst())


def uninstall() -> None:
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, LoadPluginsFirst)]
