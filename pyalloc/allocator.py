"""The public allocator class: configuration, backend choice, summaries and owning buffers.

Every allocation decision is made by DeviceCachingAllocator in _core.pyx; this module only wires it
to its settings and backend and formats what it reports.
"""
import logging

from pyalloc import config as _config
from pyalloc import pools as _pools
from pyalloc import snapshot as _snapshot
from pyalloc._buffer import Buffer
from pyalloc._core import DeviceCachingAllocator
from pyalloc._metadata import metadata_string
from pyalloc._backend import Backend
from pyalloc.errors import format_bytes

_log = logging.getLogger("pyalloc")


_SIM_BASE = 0x7F0000000000              # device 0's simulated address range starts here
_SIM_RANGE = 1 << 40                     # 1 TiB per simulated device
MAX_DEVICE = 2**31 - 1                   # a CUDA ordinal is a C int
MAX_SIM_DEVICE = (2**64 - _SIM_BASE) // _SIM_RANGE - 2    # the last whose range ends below 2**64


def _sim_device(device):
    # Each simulated device gets its own 1 TiB address range, so that (as with CUDA's unified
    # addressing) no two devices ever hand out the same pointer and a pointer names its device.
    if device > MAX_SIM_DEVICE:
        raise ValueError(f"device {device} has no simulated address range: the simulated devices' "
                         f"1 TiB ranges fit 64-bit addresses up to device {MAX_SIM_DEVICE}")
    from pyalloc._sim import SimDevice
    return SimDevice(device=device, base_address=_SIM_BASE + device * _SIM_RANGE)


def make_backend(backend, device):
    """A Backend for `device`: "sim", "cuda", None (cuda when a GPU is there, else sim) or an object."""
    if isinstance(backend, Backend):
        if backend.device != device:
            raise ValueError(f"backend serves device {backend.device}, but device={device} was asked for")
        return backend
    if backend == "sim":
        return _sim_device(device)
    if backend == "cuda" or backend is None:
        from pyalloc import cuda_backend
        if backend is None and not cuda_backend.is_available():
            _log.info("pyalloc: backend=None chose the simulated device ('sim') for device %d: %s",
                      device, cuda_backend.unavailable_reason())
            return _sim_device(device)
        chosen = cuda_backend.open_device(device)
        if backend is None:
            _log.info("pyalloc: backend=None chose the GPU ('cuda') for device %d", device)
        return chosen
    raise ValueError(f"backend must be 'sim', 'cuda', None or a Backend object, got {backend!r}")


class CachingAllocator(DeviceCachingAllocator):
    """PyTorch's CUDA caching allocator for one device.

    Args:
        device: device ordinal (default 0).
        backend: "sim" (the simulated device, default), "cuda" (the real GPU), None (the GPU when
            one is present, else the simulated device) or a Backend object such as a SimDevice.
            The default differs from the module-level default allocators' (pyalloc.malloc,
            pyalloc.get_allocator, ...), which use the GPU when one is present: an allocator
            made by hand is a simulation unless asked for the GPU; the process-wide ones serve
            real programs (pyalloc.set_default_backend chooses theirs).
        config: settings string in PyTorch's format (e.g. "max_split_size_mb:128"), a
            pyalloc.config.CudaAllocatorConfig, or None. With None the allocator follows the
            process-wide settings (PYALLOC_CONF / PYTORCH_CUDA_ALLOC_CONF, and later
            pyalloc.set_allocator_settings calls); an explicit config is this allocator's own.

    Sizes are bytes; pointers and streams are ints (streams may also be stream objects).
    """

    def __init__(self, device=0, *, backend="sim", config=None):
        if isinstance(device, bool) or not isinstance(device, int) or not 0 <= device <= MAX_DEVICE:
            raise ValueError(f"device must be an int ordinal in [0, 2**31), got {device!r}")
        settings = _config.current_settings().copy() if config is None else _config.resolve_config(config)
        super().__init__(make_backend(backend, device))
        self._settings = settings
        self._history = None          # HistorySettings while memory history is on
        self._stacks = None           # StackTable, made when stacks are first asked for
        # Set by pyalloc.defaults when set_default_backend() drops this allocator as its device's
        # default: a MemPool made on it may no longer be routed (pools.use_mem_pool).
        self.retired_default = False
        self._apply_settings(settings)
        self._init_stat_max_split_size()
        if settings.per_process_memory_fraction < 1.0:
            self.set_memory_fraction(settings.per_process_memory_fraction)
        self.follows_process_settings = config is None
        if self.follows_process_settings:
            _config.add_settings_listener(self._on_process_settings)

    def _on_process_settings(self, settings):
        self._apply_settings(settings)
        self._settings = settings

    @property
    def device(self):
        """Device ordinal."""
        return self.backend.device

    @property
    def settings(self):
        """A copy of the settings in force (pyalloc.config.CudaAllocatorConfig)."""
        return self._settings.copy()

    def allocate(self, nbytes, stream=0):
        """Allocate `nbytes` bytes on `stream` as a Buffer, freed by close(), `with` or collection."""
        return Buffer(self, nbytes, stream)

    # ------------------------------------------------------------------ private pools

    def mem_pool(self, use_on_oom=False, no_split=False):
        """A new private pool on this allocator (pyalloc.MemPool; see pyalloc.pools)."""
        return _pools.MemPool(use_on_oom=use_on_oom, no_split=no_split, allocator=self)

    def use_mem_pool(self, pool):
        """Context manager: this thread's allocations here go to `pool` (pyalloc.use_mem_pool).

        Raises TypeError for something that is not a MemPool (as pyalloc.use_mem_pool does),
        ValueError for a MemPool of another allocator.
        """
        if not isinstance(pool, _pools.MemPool):
            raise TypeError(f"use_mem_pool expects a pyalloc MemPool, got {type(pool).__name__} {pool!r}")
        if pool.allocator is not self:
            raise ValueError(f"{pool!r} is not a MemPool of this allocator (device {self.device})")
        return _pools.use_mem_pool(pool)

    def graph(self, stream, pool=None, capture_error_mode="global"):
        """A pyalloc.graphs.Graph: `with a.graph(stream) as g:` captures the work queued on
        `stream` into a CUDA graph whose allocations come from a private pool (see pyalloc.graphs).
        `pool`: share a pool (graph_pool_handle(), another graph's pool() or a MemPool)."""
        from pyalloc.graphs import Graph
        return Graph(self, stream, pool=pool, capture_error_mode=capture_error_mode)

    def graph_pool_handle(self):
        """A fresh pool id (0, n) for captures to share a pool (torch.cuda.graph_pool_handle)."""
        return _pools.graph_pool_handle()

    # ------------------------------------------------------------------ memory history

    def record_memory_history(self, enabled="all", context="all", stacks="python",
                              max_entries=_snapshot.DEFAULT_MAX_ENTRIES, clear_history=False,
                              skip_actions=None):
        """Start, change or stop recording allocator events, as torch.cuda.memory._record_memory_history.

        Args:
            enabled: "all" keeps a trace of events in a ring buffer; "state" tracks only live
                blocks (the trace keeps one entry); None stops recording and clears the trace.
            context: when Python stacks are captured: None never; "state" for live blocks
                only; "alloc" also on trace entries; "all" also the stack of each free() call.
            stacks: "python" (Python frames). "all" is accepted for PyTorch compatibility and
                records the same frames: pyalloc has no C++ callers worth unwinding.
            max_entries: ring buffer capacity in entries (default 1,000,000; PyTorch's is
                sys.maxsize). The core stores 48 bytes per entry. When full, the oldest entry
                is overwritten. Changing it while recording keeps the newest entries that fit.
            clear_history: empty the ring buffer first.
            skip_actions: actions not to record, from "alloc", "free_requested",
                "free_completed", "segment_alloc", "segment_free", "oom", "snapshot".

        Raises TypeError/ValueError naming the bad value; history is then left as it was.
        Capturing a stack costs a few microseconds per malloc (and per free with "all"); with
        context=None recording costs one ring-buffer write per event.
        """
        history, capacity, mask = _snapshot.check_history_args(
            enabled, context, stacks, max_entries, clear_history, skip_actions)
        if history is None:
            # Stop capturing before the ring is cleared; the recorder stays set, so a malloc
            # that already saw the flag on in another thread can still call it.
            self.capture_alloc_stacks = False
            self.capture_free_stacks = False
            self._set_history(False, 0, 0, False)
            self._history = None
            return
        if history.context is not None and self._stacks is None:
            self._stacks = _snapshot.StackTable()
            self.context_recorder = self._stacks.record
        self._set_history(True, capacity, mask, clear_history)
        self.capture_alloc_stacks = history.context is not None
        self.capture_free_stacks = history.context == "all"
        self._history = history

    @property
    def history_settings(self):
        """The HistorySettings record_memory_history switched on, or None while history is off."""
        return self._history

    def snapshot(self):
        """This allocator's memory snapshot as a dict in PyTorch's format (torch.cuda.memory._snapshot()).

        Keys: segments, device_traces, allocator_settings, external_annotations; see
        pyalloc.snapshot. Blocks also carry `user_metadata`, the metadata current when they
        were allocated. Taking a snapshot while history is on records a `snapshot` event.
        """
        return _snapshot.build_snapshot(self, self._history, self._stacks)

    def dump_snapshot(self, path="dump_snapshot.pickle"):
        """Write snapshot() to `path` as a pickle (protocol 4; gzip when the name ends in ".gz").

        pytorch.org/memory_viz and `python -m torch.cuda._memory_viz` read the uncompressed file.
        """
        _snapshot.dump(self.snapshot(), path)

    def memory_by_metadata(self, requested=False):
        """Live bytes per metadata string: {metadata: bytes}, largest first.

        Counts blocks handed out and not freed, under the metadata current in the allocating
        thread when they were allocated ("" for none). Bytes are block sizes (what the
        allocator holds for them; the values sum to memory_allocated()), or the sizes the
        callers asked for when `requested` is True. Blocks freed but still waiting for other
        streams are not counted.
        """
        sums = self._live_bytes_by_metadata(bool(requested))
        out = {metadata_string(mid): nbytes for mid, nbytes in sums.items()}
        return dict(sorted(out.items(), key=lambda kv: (-kv[1], kv[0])))

    def memory_summary(self, abbreviated=False):
        """A readable table of the statistics, laid out like torch.cuda.memory_summary().

        abbreviated=True leaves out the large-pool and small-pool rows (as PyTorch's does).
        """
        if not isinstance(abbreviated, bool):
            raise TypeError(f"abbreviated must be a bool, got {type(abbreviated).__name__} {abbreviated!r}")
        return format_memory_summary(self.memory_stats(), self.device, self.private_pool_bytes(),
                                     abbreviated=abbreviated)

    def __repr__(self):
        return (f"CachingAllocator(device={self.device}, backend={self.backend.kind!r}, "
                f"allocated={self.memory_allocated()}, reserved={self.memory_reserved()})")


def format_memory_summary(stats, device=0, private_pools=None, abbreviated=False):
    """Format a memory_stats() dict as PyTorch's summary table (rows per pool, bytes humanised).

    `private_pools`: (reserved, cached) bytes of private pools (private_pool_bytes()), shown
    under the header line of counts when given. `abbreviated`: only the "all" row of each metric.

    Every line, borders included, has the same width: the four value columns are 10 characters
    wide, or as wide as the longest value (totals of a long run, such as "12345.67 GiB").
    """
    metrics = (("Allocated memory", "allocated_bytes", True), ("Active memory", "active_bytes", True),
               ("Requested memory", "requested_bytes", True),
               ("GPU reserved memory", "reserved_bytes", True),
               ("Non-releasable memory", "inactive_split_bytes", True),
               ("Allocations", "allocation", False), ("Active allocs", "active", False),
               ("GPU reserved segments", "segment", False),
               ("Non-releasable allocs", "inactive_split", False))
    fields = ("current", "peak", "allocated", "freed")
    sections = []                 # lists of (label, four value strings), a thin rule after each
    for title, key, as_bytes in metrics:
        fmt = format_bytes if as_bytes else str
        pools = (("all", title),) if abbreviated else (
            ("all", title), ("large_pool", "      from large pool"), ("small_pool", "      from small pool"))
        sections.append([(label, [fmt(stats[f"{key}.{pool}.{f}"]) for f in fields])
                         for pool, label in pools])
    sections.append([(title, [str(stats[f"{key}.{f}"]) for f in fields])
                     for title, key in (("Oversize allocations", "oversize_allocations"),
                                        ("Oversize GPU segments", "oversize_segments"))])
    col = max([10] + [len(v) for rows in sections for _, values in rows for v in values])

    def row(label, values):
        return f"| {label:<25}| " + " | ".join(f"{v:>{col}}" for v in values) + " |"

    header = row("Metric", ["Cur Usage", "Peak Usage", "Tot Alloc", "Tot Freed"])
    width = len(header)
    rule = "=" * width
    thin = "-" * width
    counts = f"|  CUDA OOMs: {stats['num_ooms']:<13d}|  cudaMalloc retries: {stats['num_alloc_retries']:<10d}"
    lines = [rule, f"|{'pyalloc memory summary, device ID ' + str(device):^{width - 2}}|", thin,
             counts.ljust(width - 1) + "|"]
    if private_pools is not None:
        reserved, cached = private_pools
        lines.append(f"|  Private pools (MemPool, CUDA graphs): {format_bytes(reserved)} reserved, "
                     f"{format_bytes(cached)} cached free".ljust(width - 1) + "|")
    lines += [rule, header, thin]
    for i, rows in enumerate(sections):
        lines += [row(label, values) for label, values in rows]
        lines.append(thin if i < len(sections) - 1 else rule)
    return "\n".join(lines) + "\n"
