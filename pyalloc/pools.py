"""Private memory pools: MemPool and use_mem_pool, as torch.cuda.MemPool / torch.cuda.use_mem_pool.

A private pool has its own small and large block pools: memory allocated into it is cached for it
alone, never handed to allocations outside it, and kept (its high-water mark) until the pool is
released and emptied. Allocations reach a pool through a route: `use_mem_pool(pool)` routes the
calling thread's allocations on the pool's allocator (other threads are not routed, as in PyTorch).
Graph capture routes the streams of a capture (the graph issue builds on begin_allocate_to_pool).

Semantics, as PyTorch's (c10/cuda/CUDACachingAllocator.cpp: PrivatePool, beginAllocateToPool,
releasePool, emptyCache):
  * ids: (0, n) for user-created pools (MemPool, graph_pool_handle), (n, 0) for pools a capture
    creates; (0, 0) is the default pool.
  * use_count: 1 for the MemPool object, +1 while a use_mem_pool scope routes to it.
  * empty_cache() while a route is active leaves the default pools alone (no error), and an out of
    memory inside a route does not flush the default pools; a use_on_oom pool's cached blocks are
    tried before an out-of-memory error.
  * MemPool.release() (or collection of the MemPool) drops its use; the pool's cached segments are
    freed then, and the pool itself once its last block is freed and emptied.
"""
import contextlib

from pyalloc._core import current_thread_key, new_mempool_id

# device ordinal or None -> that device's default CachingAllocator. pyalloc.defaults, which builds
# on this module (its allocators make MemPools), sets it when imported, so that this module never
# imports it: a MemPool made without an allocator goes on its device's default allocator.
default_allocator_for = None


def graph_pool_handle():
    """A fresh user-created pool id (0, n), to share one private pool between graph captures
    (torch.cuda.graph_pool_handle). No pool exists until a capture uses the id."""
    return new_mempool_id(True)


class MemPool:
    """A private memory pool on one device allocator (torch.cuda.MemPool).

    Args:
        device: ordinal of the default allocator to create the pool on (None: the current
            device); ignored when `allocator` is given.
        use_on_oom: when an allocation outside any pool runs out of memory, its cached free
            blocks may serve it (PyTorch's use_on_oom: cached blocks only, never a new segment).
        no_split: never split a block of this pool (a request takes a whole cached block).
        allocator: the CachingAllocator to create the pool on (CachingAllocator.mem_pool()
            passes itself).

    Attributes: id (the pool id tuple), allocator, use_on_oom, no_split.
    """

    def __init__(self, device=None, use_on_oom=False, no_split=False, *, allocator=None):
        self._default_device = None     # the device whose default allocator it was made on
        if allocator is None:
            allocator = default_allocator_for(device)
            self._default_device = allocator.device
        for name, value in (("use_on_oom", use_on_oom), ("no_split", no_split)):
            if not isinstance(value, bool):
                raise TypeError(f"{name} must be a bool, got {type(value).__name__} {value!r}")
        self._id = new_mempool_id(True)
        allocator._create_or_incref_pool(self._id, use_on_oom=use_on_oom, no_split=no_split)
        self.allocator = allocator
        self.use_on_oom = use_on_oom
        self.no_split = no_split
        self._released = False

    @property
    def id(self):
        """The pool id, (0, n)."""
        return self._id

    def use_count(self):
        """How many holders the pool has: 1 for this object, +1 per active use_mem_pool scope."""
        info = self.allocator._pool_info(self._id)
        return info["use_count"] if info is not None else 0

    def snapshot(self):
        """The allocator's snapshot segments that belong to this pool (torch's MemPool.snapshot())."""
        return [seg for seg in self.allocator.snapshot()["segments"]
                if tuple(seg["segment_pool_id"]) == self._id]

    def memory_reserved(self):
        """Bytes of device memory the pool's segments hold now."""
        info = self.allocator._pool_info(self._id)
        return info["reserved_bytes"] if info is not None else 0

    def release(self):
        """Give the pool up: no more use_on_oom, its use dropped, its cached segments freed.
        Blocks still allocated from it stay valid; their segments are freed once they are freed
        and the cache is emptied. Releasing twice does nothing."""
        if self._released:
            return
        self._released = True
        self.allocator._set_pool_use_on_oom(self._id, False)
        self.allocator.release_pool(self._id)
        self.allocator.empty_cache(self._id)

    def __del__(self):
        # Not after a failed __init__ (no pool was made) or an explicit release().
        if getattr(self, "_released", True) is False:
            self.release()

    def __repr__(self):
        return (f"MemPool(id={self._id}, device={self.allocator.device}, use_on_oom={self.use_on_oom}, "
                f"no_split={self.no_split})")


@contextlib.contextmanager
def use_mem_pool(pool, device=None):
    """Route this thread's allocations on the pool's allocator into `pool` inside the block
    (torch.cuda.use_mem_pool). Other threads, and other devices' allocators, are not routed.

    Raises TypeError for something that is not a MemPool, ValueError when `device` names another
    device than the pool's, RuntimeError when the pool is routed already (nested twice).
    """
    if not isinstance(pool, MemPool):
        raise TypeError(f"use_mem_pool expects a pyalloc MemPool, got {type(pool).__name__} {pool!r}")
    if pool._released:
        raise ValueError(f"MemPool {pool.id} was released")
    allocator = pool.allocator
    if pool._default_device is not None and allocator.retired_default:
        # Routing the retired allocator would leave pyalloc.malloc, which uses the new one,
        # outside the pool without a word.
        raise RuntimeError(
            f"MemPool {pool.id} was made on device {pool._default_device}'s default allocator, "
            f"which set_default_backend() has since replaced; make a new MemPool")
    if device is not None and device != allocator.device:
        raise ValueError(f"MemPool {pool.id} belongs to device {allocator.device}, not device {device}")
    allocator.begin_allocate_to_pool(pool.id, ("thread", current_thread_key()))
    try:
        yield pool
    finally:
        allocator.end_allocate_to_pool(pool.id)
        allocator.release_pool(pool.id)
