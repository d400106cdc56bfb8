"""Linux futex wait/wake on a u32 in shared memory, through ``syscall(2)`` via ctypes.

Shared (not ``FUTEX_PRIVATE``) operations, so processes mapping the same file meet on the same
word. ``wait`` returns when the word differs from ``expected``, on a wake, on a signal or at
``timeout``; callers always re-check their condition.
"""

from __future__ import annotations

import ctypes
import platform

_SYS_FUTEX = {"x86_64": 202, "aarch64": 98}.get(platform.machine())
_FUTEX_WAIT, _FUTEX_WAKE = 0, 1
_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def wait(address: int, expected: int, timeout: float) -> None:
    ts = _Timespec(int(timeout), int((timeout % 1) * 1e9))
    _libc.syscall(_SYS_FUTEX, ctypes.c_void_p(address), _FUTEX_WAIT,
                  ctypes.c_uint32(expected), ctypes.byref(ts), None, 0)


def wake(address: int) -> None:
    _libc.syscall(_SYS_FUTEX, ctypes.c_void_p(address), _FUTEX_WAKE, 0x7FFFFFFF, None, None, 0)
