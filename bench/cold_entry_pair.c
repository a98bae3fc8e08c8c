/* The torch entry points' cache-hit pair (pyalloc_torch_malloc + pyalloc_torch_free of 1 MiB,
 * libpyalloc_torch.so) with cold caches, as inside PyTorch, whose own work between two
 * allocations evicts pyalloc's code and data. Built and run by bench/cold_entry_pair.py.
 *
 * Before each timed pair: reads POLLUTE_KIB of a buffer (evicting data and, through the shared
 * L2, code) and runs 100 KB of straight-line code (evicting the instruction cache). Times one
 * pair with rdtscp, then an empty timed region after the same eviction; prints the trimmed mean
 * (10 % off each end) of (pair - empty) in ns and the median pair, as
 *     cold pair: <ns> ns (median pair <ns>, empty <ns>)
 *
 * POLLUTE_KIB < 0: no eviction; times PAIRS pairs in a tight loop instead (median of 7 loops):
 *     hot pair: <ns> ns
 *
 * usage: cold_entry_pair PAIRS POLLUTE_KIB
 * The embedded interpreter imports pyalloc from its PYTHONPATH (and from the site directories in
 * PYALLOC_SITEDIRS, .pth files processed) and uses a simulated device.
 */
#include <Python.h>
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <x86intrin.h>

typedef void* (*malloc_fn)(ssize_t, int, void*);
typedef void (*free_fn)(void*, ssize_t, int, void*);

static double now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1e9 + t.tv_nsec;
}

static int by_value(const void* a, const void* b) {
    double x = *(const double*)a, y = *(const double*)b;
    return x < y ? -1 : x > y;
}

__attribute__((noinline)) static void evict_code(void) {
    __asm__ volatile(".rept 20000\n nopl 0(%rax,%rax,1)\n .endr");
}

static volatile long sink;

static void evict_data(const volatile char* buf, size_t bytes) {
    long s = 0;
    for (size_t k = 0; k < bytes; k += 64) s += buf[k];
    sink = s;
}

int main(int argc, char** argv) {
    if (argc != 3) {
        fprintf(stderr, "usage: %s PAIRS POLLUTE_KIB\n", argv[0]);
        return 2;
    }
    long pairs = atol(argv[1]);
    size_t bytes = (size_t)atol(argv[2]) << 10;
    const ssize_t size = 1 << 20;
    /* No site import: an interpreter started from a virtual environment would process its .pth
       files, and an editable install's finder would take precedence over PYTHONPATH's build. */
    PyConfig config;
    PyConfig_InitPythonConfig(&config);
    config.site_import = 0;
    PyStatus status = Py_InitializeFromConfig(&config);
    PyConfig_Clear(&config);
    if (PyStatus_Exception(status)) Py_ExitStatusException(status);
    PyObject* main_module = PyImport_AddModule("__main__");
    PyObject* globals = PyModule_GetDict(main_module);
    /* PYALLOC_SITEDIRS: site directories to process (.pth files: an editable install). */
    PyObject* done = PyRun_String(
        "import os, site\n"
        "for d in os.environ.get('PYALLOC_SITEDIRS', '').split(os.pathsep):\n"
        "    if d: site.addsitedir(d)\n"
        "import pyalloc, pyalloc.torch as pt\n"
        "pyalloc.set_default_backend(lambda d: pyalloc.SimDevice(1 << 34, device=d))\n"
        "pt.library()\n"
        "import sys\n"
        "print('pyalloc from', os.path.dirname(pyalloc.__file__), file=sys.stderr)\n",
        Py_file_input, globals, globals);
    if (done == NULL) {
        PyErr_Print();
        return 1;
    }
    Py_DECREF(done);
    PyObject* lib_path = PyRun_String("pt.library_path()", Py_eval_input, globals, globals);
    void* lib = lib_path ? dlopen(PyUnicode_AsUTF8(lib_path), RTLD_NOW | RTLD_NOLOAD) : NULL;
    if (lib == NULL) {
        fprintf(stderr, "libpyalloc_torch is not loaded: %s\n", dlerror());
        return 1;
    }
    malloc_fn pm = (malloc_fn)dlsym(lib, "pyalloc_torch_malloc");
    free_fn pf = (free_fn)dlsym(lib, "pyalloc_torch_free");
    PyThreadState* saved = PyEval_SaveThread();      /* PyTorch calls without the GIL */
    pf(pm(size, 0, NULL), size, 0, NULL);             /* the segment: the one slow call */

    if (atol(argv[2]) < 0) {
        /* Hot: the same pair in a tight loop, nothing evicted (the median of 7 loops). */
        double loops[7];
        for (int r = 0; r < 7; r++) {
            double start = now_ns();
            for (long i = 0; i < pairs; i++) pf(pm(size, 0, NULL), size, 0, NULL);
            loops[r] = (now_ns() - start) / pairs;
        }
        qsort(loops, 7, sizeof(double), by_value);
        printf("hot pair: %.1f ns\n", loops[3]);
        PyEval_RestoreThread(saved);
        return 0;
    }
    volatile char* buf = malloc(bytes + 64);
    memset((void*)buf, 1, bytes + 64);
    double t0 = now_ns();
    unsigned long long c0 = __rdtsc();
    while (now_ns() - t0 < 2e7) {}
    double ticks_per_ns = (__rdtsc() - c0) / (now_ns() - t0);
    double* pair = malloc(sizeof(double) * pairs);
    double* empty = malloc(sizeof(double) * pairs);
    unsigned aux;
    for (long i = 0; i < pairs; i++) {
        evict_data(buf, bytes);
        evict_code();
        unsigned long long s = __rdtscp(&aux);
        pf(pm(size, 0, NULL), size, 0, NULL);
        pair[i] = (__rdtscp(&aux) - s) / ticks_per_ns;
        evict_data(buf, bytes);
        evict_code();
        s = __rdtscp(&aux);
        empty[i] = (__rdtscp(&aux) - s) / ticks_per_ns;
    }
    qsort(pair, pairs, sizeof(double), by_value);
    qsort(empty, pairs, sizeof(double), by_value);
    double sum_pair = 0, sum_empty = 0;
    long kept = 0;
    for (long i = pairs / 10; i < pairs - pairs / 10; i++, kept++) {
        sum_pair += pair[i];
        sum_empty += empty[i];
    }
    printf("cold pair: %.1f ns (median pair %.0f, empty %.1f)\n", (sum_pair - sum_empty) / kept,
           pair[pairs / 2], sum_empty / kept);
    PyEval_RestoreThread(saved);
    return 0;
}
