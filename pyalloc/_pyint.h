// Python int -> unsigned 64-bit value for the hot path's argument checks.
//
// Cython's own conversion raises OverflowError, and catching it to raise pyalloc's ValueError
// costs an exception-state save on every call even when nothing fails (~40 instructions per
// argument). This helper reports "out of range" by its return value instead, so the caller's
// success path is one call and one test; the error path clears CPython's OverflowError and the
// caller raises its own exception naming the value.
#pragma once
#include <Python.h>

namespace pyalloc {

// `o` must be an exact int. Returns 0 and stores o in *out when 0 <= o < 2**64; returns -1 with
// no Python error set otherwise.
inline int exact_int_to_u64(PyObject* o, unsigned long long* out) {
    // PyLong_AsUnsignedLong, not ...LongLong: CPython 3.11's LongLong variant handles only 0 and
    // 1-digit ints inline and sends device addresses (3 digits of 30 bits) through the generic
    // byte-array conversion (~200 instructions); the Long variant shifts the digits in a loop.
    static_assert(sizeof(unsigned long) == sizeof(unsigned long long), "LP64 platforms only");
    unsigned long long value = PyLong_AsUnsignedLong(o);
    if (value == (unsigned long long)(unsigned long)-1 && PyErr_Occurred()) {
        PyErr_Clear();
        return -1;
    }
    *out = value;
    return 0;
}

}  // namespace pyalloc
