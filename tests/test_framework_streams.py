"""Specification of pyalloc._streams: the int handles of framework stream objects (the Numba and
cuda.core hooks' stream arguments), read by the same rule as the allocator's own stream arguments,
and the folding of CU_STREAM_LEGACY into stream 0 on the GPU."""
import ctypes

import pytest

import pyalloc
from pyalloc import _streams


class Proto:
    def __init__(self, answer):
        self.answer = answer

    def __cuda_stream__(self):
        return self.answer


class WithAttribute:
    def __init__(self, **attrs):
        self.__dict__.update(attrs)


class FakeCudaBackend:
    kind = "cuda"


def test_none_is_the_default_stream():
    assert _streams.stream_handle(None) == 0


def test_an_int_is_its_own_handle():
    assert _streams.stream_handle(12345) == 12345


def test_cuda_stream_protocol_answers_are_read_through_int():
    class Enumish(int):           # Numba's default stream answers with a cuda.bindings enum
        pass
    assert _streams.stream_handle(Proto((0, Enumish(0)))) == 0
    assert _streams.stream_handle(Proto((0, 0xABC))) == 0xABC


def test_a_malformed_cuda_stream_answer_is_refused():
    with pytest.raises(TypeError, match=r"expected a \(version, handle\) tuple"):
        _streams.stream_handle(Proto(7))


def test_pytorch_and_cupy_stream_attributes_are_read():
    assert _streams.stream_handle(WithAttribute(cuda_stream=0x10)) == 0x10
    assert _streams.stream_handle(WithAttribute(ptr=0x20)) == 0x20


def test_a_numba_ctypes_handle_is_read_and_the_null_one_is_stream_zero():
    assert _streams.stream_handle(WithAttribute(handle=ctypes.c_void_p(0x30))) == 0x30
    assert _streams.stream_handle(WithAttribute(handle=ctypes.c_void_p(None))) == 0


def test_a_numba_cuda_python_handle_is_read_through_int():
    class CUstreamLike:
        def __int__(self):
            return 0x40
    assert _streams.stream_handle(WithAttribute(handle=CUstreamLike())) == 0x40


@pytest.mark.parametrize("bad", [True, "stream", 1.5, object()])
def test_anything_else_is_refused_with_a_type_error(bad):
    with pytest.raises(TypeError, match="expected a stream"):
        _streams.stream_handle(bad)


# ------------------------------------------------------------------ one rule with the allocator
#
# Before, the allocator (malloc's stream argument) and the hooks (this module) read streams by two
# rules: the allocator refused .handle and protocol answers that are not exact ints; the hooks
# took anything int() takes (floats, strings, bools) and no range. Each input either accepted is
# read here both ways.

class IntSubclass(int):
    pass


class IndexLike:                    # a numpy integer, or a cuda.bindings CUstream (__index__)
    def __init__(self, value):
        self.value_ = value

    def __index__(self):
        return self.value_


class IntLike:                      # a cuda-python handle with only __int__
    def __int__(self):
        return 0x40


ACCEPTED = [
    (None, 0), (7, 7), (2 ** 64 - 1, 2 ** 64 - 1), (IntSubclass(9), 9), (IndexLike(11), 11),
    (Proto((0, 0xABC)), 0xABC), (Proto((0, IntSubclass(3))), 3), (Proto((0, IndexLike(4))), 4),
    (WithAttribute(cuda_stream=0x10), 0x10), (WithAttribute(ptr=0x20), 0x20),
    (WithAttribute(ptr=IntSubclass(0x21)), 0x21),
    (WithAttribute(handle=ctypes.c_void_p(0x30)), 0x30), (WithAttribute(handle=ctypes.c_void_p(None)), 0),
    (WithAttribute(handle=IntLike()), 0x40), (WithAttribute(handle=IndexLike(0x50)), 0x50),
]


def allocation_stream(stream):
    """The stream of the block malloc(stream=stream) hands out, as the allocator records it."""
    # any_stream: the handles here are made up; the allocator refuses a handle the device never made
    alloc = pyalloc.CachingAllocator(backend=pyalloc.SimDevice(64 << 20, any_stream=True))
    ptr = alloc.malloc(4096, stream=stream)
    return [seg["stream"] for seg in alloc._segments() if seg["address"] <= ptr < seg["address"] + seg["total_size"]][0]


@pytest.mark.parametrize("stream, handle", ACCEPTED)
def test_the_hooks_read_each_accepted_stream(stream, handle):
    assert _streams.stream_handle(stream) == handle


@pytest.mark.parametrize("stream, handle", ACCEPTED)
def test_malloc_reads_each_accepted_stream_as_the_hooks_do(stream, handle):
    assert allocation_stream(stream) == handle


REFUSED = [
    (True, TypeError, "got bool True"),
    ("s1", TypeError, "got str 's1'"),
    (1.5, TypeError, "got float 1.5"),
    (-1, ValueError, "got -1"),
    (2 ** 64, ValueError, f"got {2 ** 64}"),
    (Proto(7), TypeError, "Proto.__cuda_stream__() returned 7, expected a (version, handle) tuple"),
    (Proto((0, 2 ** 64)), ValueError, f"got {2 ** 64} (in Proto.__cuda_stream__()[1] of "),
    (WithAttribute(ptr=1.5), TypeError, "in WithAttribute.ptr of "),
    (WithAttribute(ptr="5"), TypeError, "got str '5'"),
    (WithAttribute(cuda_stream=True), TypeError, "got bool True"),
    (WithAttribute(ptr=-3), ValueError, "got -3 (in WithAttribute.ptr of "),
    (WithAttribute(handle=object()), TypeError, "in WithAttribute.handle of "),
]


@pytest.mark.parametrize("stream, exc, text", REFUSED)
def test_the_hooks_refuse_each_bad_stream_naming_it(stream, exc, text):
    with pytest.raises(exc) as info:
        _streams.stream_handle(stream)
    assert text in str(info.value)


@pytest.mark.parametrize("stream, exc, text", REFUSED)
def test_malloc_refuses_each_bad_stream_as_the_hooks_do(stream, exc, text):
    alloc = pyalloc.CachingAllocator(backend=pyalloc.SimDevice(64 << 20))
    with pytest.raises(exc) as info:
        alloc.malloc(4096, stream=stream)
    assert text in str(info.value)


def test_a_bad_handle_in_a_stream_says_what_was_expected():
    with pytest.raises(TypeError, match=r"expected a stream handle \(an int in \[0, 2\*\*64\)\)"):
        _streams.stream_handle(WithAttribute(ptr=1.5))


def test_the_legacy_stream_folds_into_zero_on_the_gpu(monkeypatch):
    monkeypatch.setattr(_streams, "LEGACY_IS_STREAM_ZERO", True)
    assert _streams.fold_legacy(_streams.CU_STREAM_LEGACY, FakeCudaBackend()) == 0


def test_the_legacy_stream_stays_apart_in_per_thread_default_stream_mode(monkeypatch):
    monkeypatch.setattr(_streams, "LEGACY_IS_STREAM_ZERO", False)
    assert _streams.fold_legacy(_streams.CU_STREAM_LEGACY, FakeCudaBackend()) == 1


def test_handle_one_is_an_ordinary_stream_on_the_simulated_device():
    assert _streams.fold_legacy(1, pyalloc.SimDevice(1 << 30)) == 1
