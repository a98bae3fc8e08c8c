// PyTorch's pluggable-allocator entry points over pyalloc's C table (pyalloc_capi.h).
//
// torch.cuda.memory.CUDAPluggableAllocator(path, "pyalloc_torch_malloc", "pyalloc_torch_free")
// loads this library; pyalloc.torch.install() first calls pyalloc_torch_bind with the table from
// the capsule pyalloc._capi.table. Nothing here links Python or CUDA: the table's functions take
// the GIL where they need it, and a cudaStream_t is a pointer-sized handle.
//
// Errors. torch 2.x's CUDAPluggableAllocator::malloc does not check what the alloc function
// returns: a null pointer would become the data pointer of a tensor (later kernels fault on it).
// An exception thrown from the alloc function propagates out of the operator to its Python
// binding (HANDLE_TH_ERRORS / translate_exception_to_python in torch/csrc/Exceptions.h), which
// turns a `python_error` back into the Python exception it carries (python_error::restore:
// PyErr_Restore of its type, value, traceback) and any other std::exception into a RuntimeError.
// So a failed allocation throws PythonError below: a class with python_error's name and layout
// (std::exception, then PyObject* type, value, traceback, then std::string message), carrying the
// exception pyalloc raised (torch.OutOfMemoryError subclass for OOM, see pyalloc/torch.py). The
// C++ runtime matches catch clauses by the type's mangled name ("13python_error") across shared
// libraries, so torch's `catch (python_error& e)` takes it; should a future torch not match, it
// still is a std::exception, and torch raises a RuntimeError with the same message. Free cannot
// throw (torch calls it from a deleter): a failed free is reported on stderr.
#include <atomic>
#include <cstdio>
#include <cstring>
#include <exception>
#include <stdexcept>
#include <string>
#include <sys/types.h>

#include "pyalloc_capi.h"

#define PYALLOC_EXPORT extern "C" __attribute__((visibility("default")))

namespace {
// The table, and its malloc and free copied at bind (before the release store of the table), in
// one cache line: an allocation loads one line of this library's data, not that and the table's
// (torch's own work between two allocations evicts both).
struct alignas(64) Bound {
    std::atomic<const pyalloc_capi*> table{nullptr};
    std::atomic<int (*)(int, size_t, uintptr_t, uintptr_t*)> malloc{nullptr};
    std::atomic<int (*)(int, uintptr_t)> free{nullptr};
};
Bound bound;
// Whether a failed allocation throws python_error (1) or a plain std::runtime_error (0, a
// RuntimeError in Python). pyalloc.torch turns it on only for the torch versions whose
// python_error it was checked against: a torch whose class had another layout would read the
// wrong fields of ours, so an unknown version gets the plain error.
std::atomic<int> carry_python_errors{0};
}

// Global namespace, this exact name and default visibility (its type_info is compared by name with
// torch's, as for any type shared between shared libraries): see the file comment.
struct __attribute__((visibility("default"))) python_error : public std::exception {
    void* type;
    void* value;
    void* traceback;
    std::string message;

    python_error(void* t, void* v, void* tb, const char* text)
        : type(t), value(v), traceback(tb), message(text) {}
    python_error(python_error&& other) noexcept
        : type(other.type), value(other.value), traceback(other.traceback),
          message(std::move(other.message)) {
        other.type = other.value = other.traceback = nullptr;
    }
    python_error(const python_error&) = delete;
    ~python_error() override {
        const pyalloc_capi* t = bound.table.load(std::memory_order_acquire);
        if (t != nullptr && (type || value || traceback)) t->release_error(type, value, traceback);
    }
    const char* what() const noexcept override { return message.c_str(); }
};

[[noreturn]] static void throw_last_error(const pyalloc_capi* t, const char* what) {
    std::string text = std::string("pyalloc: ") + what + ": " + t->error_message();
    void *type = nullptr, *value = nullptr, *traceback = nullptr;
    t->take_error(&type, &value, &traceback);
    if (type != nullptr && carry_python_errors.load(std::memory_order_acquire))
        throw python_error(type, value, traceback, text.c_str());
    if (type != nullptr) t->release_error(type, value, traceback);
    throw std::runtime_error(text);
}

static const pyalloc_capi* table_or_throw() {
    const pyalloc_capi* t = bound.table.load(std::memory_order_acquire);
    if (t == nullptr)
        throw std::runtime_error(
            "pyalloc: the PyTorch allocator library is not bound to pyalloc; use "
            "pyalloc.torch.install() or pyalloc.torch.allocator(), not the library directly");
    return t;
}

// Binds the library to pyalloc's table; 0 on success, -1 for a table of another version.
PYALLOC_EXPORT int pyalloc_torch_bind(const pyalloc_capi* table) {
    if (table == nullptr || table->version != PYALLOC_CAPI_VERSION ||
        table->size < sizeof(pyalloc_capi))
        return -1;
    bound.malloc.store(table->malloc, std::memory_order_relaxed);
    bound.free.store(table->free, std::memory_order_relaxed);
    bound.table.store(table, std::memory_order_release);
    return 0;
}

// on = 1: failed allocations carry pyalloc's exception to torch's Python binding (python_error);
// 0: they throw std::runtime_error with the same message.
PYALLOC_EXPORT void pyalloc_torch_carry_python_errors(int on) {
    carry_python_errors.store(on ? 1 : 0, std::memory_order_release);
}

// Whether pyalloc_torch_bind succeeded (1) or not (0).
PYALLOC_EXPORT int pyalloc_torch_is_bound(void) {
    return bound.table.load(std::memory_order_acquire) != nullptr;
}

// CUDAPluggableAllocator's alloc: `size` bytes on `device` for `stream` (a cudaStream_t).
PYALLOC_EXPORT void* pyalloc_torch_malloc(ssize_t size, int device, void* stream) {
    const pyalloc_capi* t = table_or_throw();
    uintptr_t ptr = 0;
    if (size < 0) throw std::invalid_argument("pyalloc: negative allocation size");
    int status = bound.malloc.load(std::memory_order_relaxed)(device, (size_t)size,
                                                              (uintptr_t)stream, &ptr);
    if (status != PYALLOC_OK) throw_last_error(t, "allocation failed");
    return (void*)ptr;
}

// CUDAPluggableAllocator's free. `size` and `stream` are the allocation's (pyalloc knows both).
PYALLOC_EXPORT void pyalloc_torch_free(void* ptr, ssize_t size, int device, void* stream) {
    (void)size;
    (void)stream;
    const pyalloc_capi* t = bound.table.load(std::memory_order_acquire);
    if (t == nullptr) {
        std::fprintf(stderr, "pyalloc: free of %p by an unbound PyTorch allocator library\n", ptr);
        return;
    }
    if (bound.free.load(std::memory_order_relaxed)(device, (uintptr_t)ptr) != PYALLOC_OK)
        std::fprintf(stderr, "pyalloc: free of %p on device %d failed: %s\n", ptr, device,
                     t->error_message());
}

// CUDAPluggableAllocator's record_stream_fn (tensor.record_stream): `stream` is a cudaStream_t.
// The device is not passed: the default allocator that owns ptr takes it.
PYALLOC_EXPORT void pyalloc_torch_record_stream(void* ptr, void* stream) {
    const pyalloc_capi* t = table_or_throw();
    if (t->record_stream(-1, (uintptr_t)ptr, (uintptr_t)stream) != PYALLOC_OK)
        throw_last_error(t, "record_stream failed");
}

// CUDAPluggableAllocator's reset_fn (torch.cuda.empty_cache): every default allocator's cache.
PYALLOC_EXPORT void pyalloc_torch_empty_cache(void) {
    const pyalloc_capi* t = table_or_throw();
    if (t->empty_cache(-1) != PYALLOC_OK) throw_last_error(t, "empty_cache failed");
}

// A one-slot cache over pyalloc with nothing else (no lock, no statistics, one size): the floor
// that bench/bench_torch_hook.py measures PyTorch's pluggable path itself with, so that pyalloc's
// own share of an allocation is (pyalloc - this). Not for use: one thread, one size.
namespace {
void* one_slot_ptr = nullptr;
ssize_t one_slot_size = -1;
}

PYALLOC_EXPORT void* pyalloc_torch_one_slot_malloc(ssize_t size, int device, void* stream) {
    if (one_slot_ptr != nullptr && size == one_slot_size) {
        void* p = one_slot_ptr;
        one_slot_ptr = nullptr;
        return p;
    }
    return pyalloc_torch_malloc(size, device, stream);
}

PYALLOC_EXPORT void pyalloc_torch_one_slot_free(void* ptr, ssize_t size, int device, void* stream) {
    if (one_slot_ptr == nullptr) {
        one_slot_ptr = ptr;
        one_slot_size = size;
        return;
    }
    pyalloc_torch_free(ptr, size, device, stream);
}

// The benchmark's switch between the two pairs above within one process: bench/bench_torch_hook.py
// installs pyalloc_torch_bench_malloc/free as the pluggable allocator and selects pyalloc or the
// one-slot floor between timed loops, so that pyalloc's share is measured interleaved in one
// process (times of separate processes differ by more than that share). Selecting pyalloc gives
// the slot's block back, so that pyalloc's pools are as in a process without the floor. Not for
// use: one thread, switched only while no allocation made through it is live.
namespace {
std::atomic<int> bench_one_slot{0};
}

PYALLOC_EXPORT void pyalloc_torch_bench_select(int one_slot) {
    bench_one_slot.store(one_slot ? 1 : 0, std::memory_order_relaxed);
    if (!one_slot && one_slot_ptr != nullptr) {
        void* p = one_slot_ptr;
        one_slot_ptr = nullptr;
        pyalloc_torch_free(p, one_slot_size, 0, nullptr);
    }
}

PYALLOC_EXPORT void* pyalloc_torch_bench_malloc(ssize_t size, int device, void* stream) {
    if (bench_one_slot.load(std::memory_order_relaxed))
        return pyalloc_torch_one_slot_malloc(size, device, stream);
    return pyalloc_torch_malloc(size, device, stream);
}

PYALLOC_EXPORT void pyalloc_torch_bench_free(void* ptr, ssize_t size, int device, void* stream) {
    if (bench_one_slot.load(std::memory_order_relaxed))
        pyalloc_torch_one_slot_free(ptr, size, device, stream);
    else
        pyalloc_torch_free(ptr, size, device, stream);
}
