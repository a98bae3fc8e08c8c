# cython: language_level=3
"""Python stack keys for memory history: the calling thread's frames read in C (see stack_key)."""
from libcpp.vector cimport vector
from libc.stdint cimport uintptr_t


cdef extern from *:
    """
    #if PY_VERSION_HEX < 0x030B0000
    #include "frameobject.h"
    #endif
    /* The frame a stack walk starts from, and the last instruction of a frame, on every
       supported Python (PyFrame_GetLasti is 3.11+; 3.10 exposes the field). */
    static inline PyFrameObject* pyalloc_current_frame(void) {
        PyFrameObject* f = PyEval_GetFrame();   /* borrowed */
        Py_XINCREF(f);
        return f;
    }
    static inline int pyalloc_frame_lasti(PyFrameObject* f) {
    #if PY_VERSION_HEX >= 0x030B0000
        return PyFrame_GetLasti(f);
    #else
        return f->f_lasti;
    #endif
    }
    """
    ctypedef struct PyFrameObject
    ctypedef struct PyCodeObject
    PyFrameObject* pyalloc_current_frame()                 # new reference or NULL
    int pyalloc_frame_lasti(PyFrameObject*)
    PyFrameObject* PyFrame_GetBack(PyFrameObject*)         # new reference or NULL
    PyCodeObject* PyFrame_GetCode(PyFrameObject*)          # new reference
    void Py_DECREF(void*)
    object PyBytes_FromStringAndSize(const char*, Py_ssize_t)


def stack_key(int skip=0):
    """Bytes naming the calling thread's Python stack: (code object address, last instruction)
    of every frame, innermost first, after dropping `skip` frames (the caller's own is the first).

    Walking frames in C costs a few nanoseconds a frame, against ~200 ns for f_back/f_lineno in
    Python, so capturing a stack on every malloc stays cheap. A key only identifies a stack
    while its code objects are alive: pyalloc.snapshot.StackTable keeps them alive.
    """
    cdef PyFrameObject* f = pyalloc_current_frame()
    cdef PyFrameObject* back
    cdef PyCodeObject* code
    cdef vector[uintptr_t] key
    while f != NULL:
        if skip > 0:
            skip -= 1
        else:
            code = PyFrame_GetCode(f)
            key.push_back(<uintptr_t>code)
            key.push_back(<uintptr_t>pyalloc_frame_lasti(f))
            Py_DECREF(code)
        back = PyFrame_GetBack(f)
        Py_DECREF(f)
        f = back
    return PyBytes_FromStringAndSize(<const char*>key.data(), key.size() * sizeof(uintptr_t))
