// Python int -> unsigned 64-bit value for the hot path's argument checks.
//
// Cython's own conversion raises OverflowError, and catching it to raise pyalloc's ValueError
// costs an exception-state save on every call even when nothing fails (~40 instructions per
// argument). This helper reports "out of range" by its return value instead, so the caller's
// success path is one inlined test; the error path clears CPython's OverflowError and the
// caller raises its own exception naming the value.
//
// Sizes and device addresses fit in two 30-bit digits, and reading those directly saves a call
// into CPython per argument (PyLong_AsUnsignedLongLong on 3.11 even sends 3-digit values through
// its generic byte-array conversion). The digit layout is CPython's internal one, as Cython's own
// conversions read it; it is used only on the versions it was tested on (3.11, 3.12, 3.13), and
// every other version or case takes the public API.
#pragma once
#include <Python.h>

namespace pyalloc {

// `o` must be an int (exact or subclass). Returns 0 and stores o in *out when 0 <= o < 2**64;
// returns -1 with no Python error set otherwise.
inline int exact_int_to_u64(PyObject* o, unsigned long long* out) {
#if PYLONG_BITS_IN_DIGIT == 30 && PY_VERSION_HEX >= 0x030C0000 && PY_VERSION_HEX < 0x030E0000
    // 3.12, 3.13: lv_tag = (number of digits << 3) | sign bits (0 positive, 1 zero, 2 negative).
    uintptr_t tag = ((PyLongObject*)o)->long_value.lv_tag;
    const digit* d = ((PyLongObject*)o)->long_value.ob_digit;
    if ((tag & 3) != 2) {
        switch (tag >> 3) {
            case 0: *out = 0; return 0;
            case 1: *out = d[0]; return 0;
            case 2: *out = (unsigned long long)d[0] | ((unsigned long long)d[1] << 30); return 0;
        }
    }
#elif PYLONG_BITS_IN_DIGIT == 30 && PY_VERSION_HEX >= 0x030B0000 && PY_VERSION_HEX < 0x030C0000
    // 3.11: Py_SIZE is the signed number of digits.
    const digit* d = ((PyLongObject*)o)->ob_digit;
    switch (Py_SIZE(o)) {
        case 0: *out = 0; return 0;
        case 1: *out = d[0]; return 0;
        case 2: *out = (unsigned long long)d[0] | ((unsigned long long)d[1] << 30); return 0;
    }
#endif
    static_assert(sizeof(unsigned long) == sizeof(unsigned long long), "LP64 platforms only");
    // PyLong_AsUnsignedLong, not ...LongLong: see above.
    unsigned long long value = PyLong_AsUnsignedLong(o);
    if (value == (unsigned long long)(unsigned long)-1 && PyErr_Occurred()) {
        PyErr_Clear();
        return -1;
    }
    *out = value;
    return 0;
}

}  // namespace pyalloc
