"""Specification of pyalloc._streams: the int handles of framework stream objects (the Numba and
cuda.core hooks' stream arguments) and the folding of CU_STREAM_LEGACY into stream 0 on the GPU."""
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


def test_the_legacy_stream_folds_into_zero_on_the_gpu(monkeypatch):
    monkeypatch.setattr(_streams, "LEGACY_IS_STREAM_ZERO", True)
    assert _streams.fold_legacy(_streams.CU_STREAM_LEGACY, FakeCudaBackend()) == 0


def test_the_legacy_stream_stays_apart_in_per_thread_default_stream_mode(monkeypatch):
    monkeypatch.setattr(_streams, "LEGACY_IS_STREAM_ZERO", False)
    assert _streams.fold_legacy(_streams.CU_STREAM_LEGACY, FakeCudaBackend()) == 1


def test_handle_one_is_an_ordinary_stream_on_the_simulated_device():
    assert _streams.fold_legacy(1, pyalloc.SimDevice(1 << 30)) == 1
