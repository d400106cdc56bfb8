/* ibgda._host_atomics: release/acquire flag and word operations on raw host addresses, plus
 * futex sleep/wake, for regions shared between processes (shared memory, registered buffers).
 *
 * Python's own stores carry no ordering guarantee on weakly ordered CPUs; these use the C11
 * atomics so the slot protocol's "payload, then flag (release)" / "flag (acquire), then payload"
 * rule holds on every architecture, not only x86-64. Addresses are Python ints; the caller
 * (ibgda.host_memory) bounds-checks them against the region first.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <linux/futex.h>
#include <stdatomic.h>
#include <stdint.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

/* Checks the argument count and converts args[0] to a pointer; on failure sets the error. */
static int parse_address(PyObject *const *args, Py_ssize_t n, Py_ssize_t expected,
                         const char *signature, void **out) {
  if (n != expected) {
    PyErr_Format(PyExc_TypeError, "expected %s", signature);
    return -1;
  }
  *out = PyLong_AsVoidPtr(args[0]);
  return (*out == NULL && PyErr_Occurred()) ? -1 : 0;
}

static PyObject *load_u8_acquire(PyObject *self, PyObject *const *args, Py_ssize_t n) {
  void *p;
  if (parse_address(args, n, 1, "load_u8_acquire(address)", &p)) return NULL;
  return PyLong_FromUnsignedLong(atomic_load_explicit((_Atomic uint8_t *)p, memory_order_acquire));
}

static PyObject *store_u8_release(PyObject *self, PyObject *const *args, Py_ssize_t n) {
  void *p;
  if (parse_address(args, n, 2, "store_u8_release(address, value)", &p)) return NULL;
  unsigned long v = PyLong_AsUnsignedLong(args[1]);
  if (PyErr_Occurred()) return NULL;
  atomic_store_explicit((_Atomic uint8_t *)p, (uint8_t)v, memory_order_release);
  Py_RETURN_NONE;
}

static PyObject *load_u32_acquire(PyObject *self, PyObject *const *args, Py_ssize_t n) {
  void *p;
  if (parse_address(args, n, 1, "load_u32_acquire(address)", &p)) return NULL;
  return PyLong_FromUnsignedLong(atomic_load_explicit((_Atomic uint32_t *)p, memory_order_acquire));
}

static PyObject *store_u32_release(PyObject *self, PyObject *const *args, Py_ssize_t n) {
  void *p;
  if (parse_address(args, n, 2, "store_u32_release(address, value)", &p)) return NULL;
  unsigned long v = PyLong_AsUnsignedLong(args[1]);
  if (PyErr_Occurred()) return NULL;
  atomic_store_explicit((_Atomic uint32_t *)p, (uint32_t)v, memory_order_release);
  Py_RETURN_NONE;
}

static PyObject *fetch_add_u32(PyObject *self, PyObject *const *args, Py_ssize_t n) {
  void *p;
  if (parse_address(args, n, 2, "fetch_add_u32(address, value)", &p)) return NULL;
  unsigned long v = PyLong_AsUnsignedLong(args[1]);
  if (PyErr_Occurred()) return NULL;
  return PyLong_FromUnsignedLong(atomic_fetch_add_explicit((_Atomic uint32_t *)p, (uint32_t)v, memory_order_acq_rel));
}

/* futex_wait(address, expected, timeout_seconds): sleep while *address == expected, at most
 * timeout; returns early on a wake, a signal or a changed value. Releases the GIL. */
static PyObject *futex_wait(PyObject *self, PyObject *const *args, Py_ssize_t n) {
  void *p;
  if (parse_address(args, n, 3, "futex_wait(address, expected, timeout)", &p)) return NULL;
  unsigned long expected = PyLong_AsUnsignedLong(args[1]);
  double timeout = PyFloat_AsDouble(args[2]);
  if (PyErr_Occurred()) return NULL;
  if (timeout < 0) timeout = 0;
  struct timespec ts = {(time_t)timeout, (long)((timeout - (double)(time_t)timeout) * 1e9)};
  Py_BEGIN_ALLOW_THREADS
  syscall(SYS_futex, p, FUTEX_WAIT, (uint32_t)expected, &ts, NULL, 0);
  Py_END_ALLOW_THREADS
  Py_RETURN_NONE;
}

static PyObject *futex_wake(PyObject *self, PyObject *const *args, Py_ssize_t n) {
  void *p;
  if (parse_address(args, n, 1, "futex_wake(address)", &p)) return NULL;
  long woken = syscall(SYS_futex, p, FUTEX_WAKE, INT32_MAX, NULL, NULL, 0);
  return PyLong_FromLong(woken < 0 ? 0 : woken);
}

static PyMethodDef methods[] = {
    {"load_u8_acquire", (PyCFunction)(void (*)(void))load_u8_acquire, METH_FASTCALL, "Acquire-load the byte at address."},
    {"store_u8_release", (PyCFunction)(void (*)(void))store_u8_release, METH_FASTCALL, "Release-store a byte at address."},
    {"load_u32_acquire", (PyCFunction)(void (*)(void))load_u32_acquire, METH_FASTCALL, "Acquire-load the u32 at address."},
    {"store_u32_release", (PyCFunction)(void (*)(void))store_u32_release, METH_FASTCALL, "Release-store a u32 at address."},
    {"fetch_add_u32", (PyCFunction)(void (*)(void))fetch_add_u32, METH_FASTCALL, "Atomically add to the u32 at address; returns the old value."},
    {"futex_wait", (PyCFunction)(void (*)(void))futex_wait, METH_FASTCALL, "Sleep while the u32 at address equals expected (at most timeout s)."},
    {"futex_wake", (PyCFunction)(void (*)(void))futex_wake, METH_FASTCALL, "Wake every sleeper on address."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "ibgda._host_atomics",
                                    "Release/acquire host atomics and futexes.", -1, methods};

PyMODINIT_FUNC PyInit__host_atomics(void) { return PyModule_Create(&module); }
