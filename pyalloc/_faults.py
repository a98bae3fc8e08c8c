"""Injected failures of the simulated backends (SimDevice.fail_next, SimHost.fail_next): one table
of armed failures per backend, so that every operation of the simulator can be made to fail as
its driver call would, and the caller's error path tested without a GPU."""
from pyalloc.errors import CudaError


class InjectedFailures:
    """Armed failures by operation: after `skip` calls that succeed, the next `count` raise
    CudaError(driver call, result) before the operation does anything.

    `owner` names the backend in messages ("SimDevice"); `calls` maps each operation to its
    driver call's name ("segment_alloc" -> "cuMemAlloc"); `result_names` maps CUresults to their
    names."""

    def __init__(self, owner, calls, result_names):
        self.owner = owner
        self.calls = calls
        self.operation_of = {call: op for op, call in calls.items()}
        self.result_names = result_names
        self.armed = {}             # operation -> [calls let through, calls to fail, CUresult]

    def arm(self, call, count, skip, result):
        """fail_next's arguments, checked; `call` is an operation or its driver call. count 0 disarms."""
        op = call if call in self.calls else self.operation_of.get(call)
        if op is None:
            raise ValueError(f"{self.owner}.fail_next: unknown call {call!r}; one of "
                             f"{', '.join(sorted(self.calls))} or their driver calls")
        if count < 0 or skip < 0:
            raise ValueError(f"{self.owner}.fail_next: count and skip must be >= 0, got {count}, {skip}")
        if count == 0:
            self.armed.pop(op, None)
        else:
            self.armed[op] = [skip, count, result]

    def take(self, op):
        """Called as operation `op` starts: None to go on, or the CudaError it must raise now
        (that failure is used up)."""
        f = self.armed.get(op)
        if f is None:
            return None
        if f[0] > 0:
            f[0] -= 1
            return None
        f[1] -= 1
        if f[1] == 0:
            del self.armed[op]
        return CudaError(self.calls[op], f[2], self.result_names.get(f[2], ""),
                         f"{self.owner}: injected failure of {op} (fail_next)")
