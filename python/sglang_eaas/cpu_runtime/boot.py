"""Imported by ``sglang_eaas_cpu_runtime.pth`` at interpreter start-up: activates the CPU runtime.

A failure here must never break the interpreter, so it is reported on stderr and swallowed.
"""

import sys

try:
    from sglang_eaas.cpu_runtime import activate

    activate()
except Exception as exc:  # noqa: BLE001 - start-up hook: report, never raise
    sys.stderr.write(f"sglang-eaas: CPU runtime not activated: {exc!r}\n")
