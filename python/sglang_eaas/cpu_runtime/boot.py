"""Imported by ``sglang_eaas_cpu_runtime.pth`` at interpreter start-up: activates the CPU runtime
where it applies, and has SGLang's offline benchmarks load the plugin (``benchmark_plugins``).

A failure here must never break the interpreter, so it is reported on stderr and swallowed.
"""

import sys

try:
    from sglang_eaas.cpu_runtime import activate

    activate()
except Exception as exc:  # noqa: BLE001 - start-up hook: report, never raise
    sys.stderr.write(f"sglang-eaas: CPU runtime not activated: {exc!r}\n")

try:
    from sglang_eaas import benchmark_plugins

    benchmark_plugins.install()
except Exception as exc:  # noqa: BLE001 - start-up hook: report, never raise
    sys.stderr.write(f"sglang-eaas: SGLang's benchmarks will not load the plugin: {exc!r}\n")
