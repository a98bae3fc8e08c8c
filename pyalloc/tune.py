"""Search allocator settings for a recorded trace: replay it under a grid of settings, in parallel.

`tune(trace)` replays one allocation stream under many PYTORCH_CUDA_ALLOC_CONF settings on the
simulated device and ranks them by peak reserved memory (bytes), the figure that decides whether a
run fits on its GPU; settings that ran out of memory on the simulated device rank below every one
that fits (rank_key).

Placement, and why the table compares fresh replays:
  * The trace's own setting is replayed twice. With *recorded placement* (new segments at the
    addresses of the trace's segment_alloc entries) a faithful replay reproduces PyTorch's own
    figures exactly; that run checks the replay and is reported as the baseline "as recorded".
  * Every setting, the trace's own included, is also replayed with *fresh placement* (segments
    where the simulated device puts them, top-down as the CUDA driver tends to). Recorded
    placement is meaningless for other settings: they ask for a different sequence of segment
    sizes, so the recorded addresses would be handed out to unrelated segments (or collide with
    live ones). But placement is not neutral: best fit breaks ties between equal free blocks by
    address, so where segments sit changes which block gets split, and with it fragmentation.
    Comparing a recorded baseline with fresh candidates would mix that placement effect into every
    saving, so the table, and each saving, compares settings on the same footing: all fresh,
    savings against the trace's own setting replayed fresh. The recorded baseline is reported
    beside it, and the gap between the two (the placement effect) is the noise floor below which
    a saving says little.
  * How good fresh placement is, measured on the H200 traces in tests/data: replaying the default runs
    under the settings of the other runs of the same workload (same requests) gives PyTorch's
    peak reserved bytes for those runs exactly in 7 of 8 cases, 4 MiB (0.03%) off in the eighth.
    Bottom-up first fit, the simulated device's other mode, missed by up to 2.9%.

Parallelism: a ProcessPoolExecutor whose workers inherit the loaded trace by fork (or, where
processes cannot fork, load it once each in the pool initializer) and then replay one setting per
task; results do not depend on the number of workers.
"""
from __future__ import annotations

import math
import multiprocessing
import os
import re
import shlex
import signal
import textwrap
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass, field

from pyalloc.config import PYALLOC_ONLY_KEYS, CudaAllocatorConfig
from pyalloc.errors import format_bytes
from pyalloc.replay import (DEFAULT_DEVICE_MEMORY, RecordedOom, ReplayResult, check_memory_fraction,
                            classify_releases, fit_device_memory, recorded_oom, replay, settings_key)
from pyalloc.replay import fraction_in_force, gc_without_fraction, implied_device_memory
from pyalloc.trace import Trace, as_trace
from pyalloc.snapshot import load

GRIDS = ("default", "wide")
ENV_NAME = "PYTORCH_CUDA_ALLOC_CONF"

# roundup_power2_divisions list forms. The first is the example of PyTorch's documentation (coarse
# rounding for requests below 256 MiB, finer above); the others round small requests finely and
# large ones more coarsely. None leaves a bucket at 0 between entries (PyTorch would not round it).
_ROUNDUP_LISTS = ("[256:1,512:2,1024:4,>:8]", "[128:4,>:8]")
_ROUNDUP_LISTS_WIDE = _ROUNDUP_LISTS + ("[64:8,>:16]", "[32:2,256:4,>:8]")

# garbage_collection_threshold acts only while a per-process memory fraction below 1 is in force
# (reference 1.9): the threshold is a share of fraction x device memory. 0.99 switches collection
# on while giving up almost none of the device.
_GC_FRACTIONS = (0.99,)
_GC_FRACTIONS_WIDE = (0.9, 0.99)


def grid_settings(grid: str = "default") -> list[str]:
    """The candidate setting strings of the named grid ("default" or "wide"), in a fixed order."""
    if grid not in GRIDS:
        raise ValueError(f"grid must be one of {', '.join(map(repr, GRIDS))}, got {grid!r}")
    wide = grid == "wide"
    out = []
    split_mb = (32, 64, 128, 256, 512, 1024, 2048) if wide else (64, 128, 256, 512)
    out += [f"max_split_size_mb:{mb}" for mb in split_mb]
    divisions = (2, 4, 8, 16, 32) if wide else (2, 4, 8, 16)
    out += [f"roundup_power2_divisions:{d}" for d in divisions]
    out += [f"roundup_power2_divisions:{r}" for r in (_ROUNDUP_LISTS_WIDE if wide else _ROUNDUP_LISTS)]
    # max_non_split_rounding_mb matters only for blocks at least max_split_size big (oversize
    # blocks), so it is always paired with a max_split_size_mb.
    pairs = ((128, 256, 512), (64, 256, 1024)) if wide else ((128, 512), (64, 512))
    out += [f"max_split_size_mb:{s},max_non_split_rounding_mb:{r}" for s in pairs[0] for r in pairs[1]]
    thresholds = (0.5, 0.6, 0.7, 0.8, 0.9) if wide else (0.6, 0.8)
    out += [f"garbage_collection_threshold:{t},per_process_memory_fraction:{f}"
            for f in (_GC_FRACTIONS_WIDE if wide else _GC_FRACTIONS) for t in thresholds]
    if wide:
        out += [f"max_split_size_mb:{s},roundup_power2_divisions:{d}" for s in (128, 512) for d in (4, 8)]
    out.append("expandable_segments:True")
    # pyalloc's own: physical pages recycled between expandable segments (docs/recycle_pages.md).
    out.append("expandable_segments:True,recycle_pages:True")
    if wide:
        out.append("expandable_segments:True,roundup_power2_divisions:4")
    return out


@dataclass
class TuneRow:
    """One setting's replay. `result` is None when it was skipped or failed (see `error`).
    saving: bytes of peak reserved saved against the trace's own setting replayed the same way
    (negative: it reserves more); None when the own setting could not be replayed."""
    config: str
    placement: str
    own: bool                      # the trace's own setting
    result: ReplayResult | None = None
    error: str | None = None       # why it was skipped or failed
    skipped: bool = False          # True: the own setting does not parse here (not a failure)
    saving: int | None = None
    fit_memory: int | None = None  # --fit: smallest device memory (bytes) with no OOM; None: none
                                   # up to roomy_device, or not asked

    @property
    def recorded_oom_request(self):
        """The replay of the trace's first oom request under this setting (OomRequest), or None."""
        if self.result is None or not self.result.oom_requests:
            return None
        return self.result.oom_requests[0]

    @property
    def saving_fraction(self):
        """saving / (the own setting's peak reserved), or None."""
        if self.saving is None or self.result is None:
            return None
        own_peak = self.result.peak_reserved + self.saving
        return self.saving / own_peak if own_peak else None

    def saving_words(self):
        """The "vs the trace's own setting" cell of the table and the page: '(reference)' for
        the own setting, '-' without a saving, else change_words ('2.29 GiB more (16.6%)', not
        a signed number that reads as a saving of minus 2.29 GiB)."""
        if self.own:
            return "(reference)"
        if self.saving is None:
            return "-"
        return change_words(self.saving, self.saving_fraction)

    def as_dict(self):
        out = {"config": self.config, "placement": self.placement, "own": self.own}
        if self.result is not None:
            out.update(self.result.as_dict())
            out["config"] = self.config
        out.update(saving=self.saving, saving_fraction=self.saving_fraction, error=self.error,
                   skipped=self.skipped, fit_memory=self.fit_memory)
        return out


@dataclass
class TuneResult:
    """What tune() found. rows: the fresh-placement replays that ran, ranked (see rank_key):
    the settings that fit the device first, by peak reserved, then those that ran out of memory,
    by fewest out-of-memory events (with fit, by the device they need); baseline: the trace's own setting at the recorded addresses;
    skipped / failed: rows that did not run; best: the row to recommend (the first row)."""
    trace: str
    device: int
    device_memory: int             # bytes of the simulated device
    events: int
    allocations: int
    wrapped: bool
    own_config: str
    baseline: TuneRow
    rows: list[TuneRow] = field(default_factory=list)
    skipped: list[TuneRow] = field(default_factory=list)
    failed: list[TuneRow] = field(default_factory=list)
    best: TuneRow | None = None
    recorded_oom: RecordedOom | None = None   # the trace's first recorded OOM, if it has one
    device_memory_derived: bool = False       # device_memory is the limit the OOM implies
    memory_fraction: float | None = None
    fit: bool = False                         # rows carry fit_memory
    # Which of the trace's segment-free runs the replays took as empty_cache() calls (replay's
    # empty_cache_calls), so that a later replay of a row (tune --html's curves) repeats them.
    empty_cache_calls: list | None = None

    @property
    def own_fresh(self) -> TuneRow | None:
        """The trace's own setting replayed with fresh placement (the savings' reference)."""
        return next((r for r in self.rows if r.own), None)

    @property
    def best_avoids_oom(self) -> bool:
        return self.best is not None and self.best.result.num_ooms == 0

    @property
    def placement_effect(self) -> int | None:
        """Peak reserved (bytes) of the own setting under fresh minus recorded placement."""
        fresh = self.own_fresh
        if fresh is None or self.baseline.result is None:
            return None
        return fresh.result.peak_reserved - self.baseline.result.peak_reserved

    @property
    def allowed_memory(self) -> int | None:
        """floor(memory_fraction x device_memory) when a memory fraction below 1 was given."""
        if self.memory_fraction is None or self.memory_fraction >= 1.0:
            return None
        return int(self.memory_fraction * float(self.device_memory))

    def device_words(self) -> str:
        """'the 80.00 GiB device', or with a fraction 'the 139.80 GiB device (849.00 MiB allowed)'."""
        allowed = self.allowed_memory
        text = f"the {format_bytes(self.device_memory)} device"
        return text + (f" ({format_bytes(allowed)} allowed)" if allowed is not None else "")

    def best_line(self) -> str | None:
        """`PYTORCH_CUDA_ALLOC_CONF=...` for the best setting, quoted for a POSIX shell
        (`PYALLOC_CONF=...` when it has a key of pyalloc's own, which PyTorch rejects)."""
        if self.best is None:
            return None
        keys = {part.split(":", 1)[0].strip() for part in self.best.config.split(",")}
        env = "PYALLOC_CONF" if keys & set(PYALLOC_ONLY_KEYS) else ENV_NAME
        return f"{env}={shlex.quote(self.best.config)}"

    def as_dict(self):
        """A JSON-ready dict (no NaN or infinity: those become None)."""
        out = {
            "trace": self.trace, "device": self.device, "device_memory": self.device_memory,
            "events": self.events, "allocations": self.allocations, "wrapped": self.wrapped,
            "own_config": self.own_config, "baseline": self.baseline.as_dict(),
            "recorded_oom": self.recorded_oom.as_dict() if self.recorded_oom else None,
            "device_memory_derived": self.device_memory_derived,
            "memory_fraction": self.memory_fraction, "fit": self.fit,
            "placement_effect": self.placement_effect,
            "results": [dict(r.as_dict(), fit_allowed=(
                None if r.fit_memory is None or self.allowed_memory is None
                else int(self.memory_fraction * float(r.fit_memory)))) for r in self.rows],
            "skipped": [{"config": r.config, "reason": r.error} for r in self.skipped],
            "failed": [{"config": r.config, "error": r.error} for r in self.failed],
            "best": self.best.config if self.best else None,
            "best_avoids_oom": self.best_avoids_oom,
            "best_line": self.best_line(),
        }
        return _json_safe(out)


def _json_safe(value):
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_json_safe(v) for v in value]
    return value


# -- workers ----------------------------------------------------------------------------------------

# The Trace this process replays jobs on (a worker's, or tune's own while it runs jobs itself).
_worker_trace = None


def _ignore_interrupts():
    """Pool initializer: a worker ignores SIGINT. Ctrl-C reaches the whole process group; the
    main process alone handles it, by terminating the workers (_collect), so that none prints
    a KeyboardInterrupt traceback of its own or finishes its replay first."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _init_worker(source, device):
    """Pool initializer: ignore SIGINT, and read the trace of `device` once per worker (a path,
    or a snapshot dict)."""
    global _worker_trace
    _ignore_interrupts()
    # No size limit: tune's own process has loaded this very file within the caller's limit;
    # and no check: it has checked it too.
    snapshot = load(source, max_bytes=None) if not isinstance(source, dict) else source
    _worker_trace = Trace(snapshot, device, check=False).slim()


def _replay_job(job):
    """Replay one setting on the worker's trace: (index, ReplayResult or None, skipped, error,
    fit_memory), fit_memory with job's fit flag (else None)."""
    index, config, placement, device_memory, fraction, calls, fit = job
    trace = _worker_trace
    fit_memory = None
    try:
        # tune() checked the trace once before handing out the jobs.
        result = replay(trace, config=config, placement=placement, device_memory=device_memory,
                        device=trace.device, check=False, memory_fraction=fraction,
                        empty_cache_calls=calls)
        if fit:
            fit_memory = fit_device_memory(trace, config=config, device=trace.device,
                                           memory_fraction=fraction, empty_cache_calls=calls,
                                           check=False)
    except Exception as err:  # noqa: BLE001 -- one failing setting must not lose the others
        return index, None, False, f"{type(err).__name__}: {err}", None
    return index, result, False, None, fit_memory


def _run_one(job, trace):
    """_replay_job(job) in this process, on the Trace `trace`."""
    global _worker_trace
    saved, _worker_trace = _worker_trace, trace
    try:
        return _replay_job(job)
    finally:
        _worker_trace = saved


def _run_jobs(jobs, trace, source, workers, progress):
    """Run the jobs on the Trace `trace` in `workers` processes (in this one for 1) and return
    results by index. `source`: what a worker that cannot fork reads the trace from (its path,
    or a snapshot dict)."""
    global _worker_trace
    results = {}
    total = len(jobs)
    if progress is not None:
        progress(0, total)
    if workers <= 1 or total <= 1:
        saved, _worker_trace = _worker_trace, trace
        try:
            for job in jobs:
                out = _replay_job(job)
                results[out[0]] = out
                if progress is not None:
                    progress(len(results), total)
        finally:
            _worker_trace = saved
        return results
    # Where processes can fork, workers inherit the trace this process already read (no copy
    # until written, and a replay only reads it), checked and classified. Elsewhere they load
    # it themselves from its path: passing the loaded dict would pickle the whole trace to
    # every worker, which costs about as much as loading it.
    if "fork" in multiprocessing.get_all_start_methods():
        saved, _worker_trace = _worker_trace, trace.slim()
        pool_args = dict(mp_context=multiprocessing.get_context("fork"), initializer=_ignore_interrupts)
    else:
        saved = _worker_trace
        pool_args = dict(initializer=_init_worker, initargs=(source, trace.device))
    try:
        return _collect(jobs, workers, total, progress, pool_args, results)
    finally:
        _worker_trace = saved


def _collect(jobs, workers, total, progress, pool_args, results):
    """Run `jobs` on a pool of `workers` processes, filling `results` by index as they finish.
    On any exception here (Ctrl-C above all) the workers are terminated at once: leaving the
    pool's `with` block would otherwise wait for every running replay (a --fit bisection takes
    seconds), so Ctrl-C took as long as the slowest job to act."""
    pool = ProcessPoolExecutor(max_workers=min(workers, total), **pool_args)
    try:
        futures = [pool.submit(_replay_job, job) for job in jobs]
        for future in as_completed(futures):
            out = future.result()
            results[out[0]] = out
            if progress is not None:
                progress(len(results), total)
    except BaseException:
        _terminate(pool)
        raise
    pool.shutdown()
    return results


def _terminate(pool):
    """Stop a ProcessPoolExecutor now: drop the queued jobs, kill the running ones, reap the
    workers (so that none is left behind). Python 3.14 has pool.terminate_workers(); before it,
    the worker processes are only reachable as the private `_processes`."""
    processes = list((getattr(pool, "_processes", None) or {}).values())
    # Taken before shutdown(wait=False), which drops the pool's reference to it.
    manager = getattr(pool, "_executor_manager_thread", None)
    pool.shutdown(wait=False, cancel_futures=True)
    for process in processes:
        process.terminate()
    for process in processes:
        process.join(timeout=5)
    # The pool's manager thread sees its workers die and closes its wakeup pipe; interpreter
    # exit wakes every pool's pipe (concurrent.futures' atexit hook), and racing that close it
    # printed "Exception ignored ... Bad file descriptor" after "pyalloc: interrupted". Wait for
    # the thread here, so that it is done before exit begins.
    if manager is not None:
        manager.join(timeout=5)


# -- the search -------------------------------------------------------------------------------------

def rank_key(result: ReplayResult, order: int = 0, *, fit: bool = False,
             fit_memory: int | None = None):
    """How tune ranks replays: every setting that fits the device (no out-of-memory event) above
    every one that does not; those that fit by peak reserved, then device allocations; those that
    ran out of memory by fewest out-of-memory events, then peak reserved (their failed allocations
    were skipped, so their peaks undercount what they would need); then `order` (grid order).
    With `fit` (tune --fit), those that ran out of memory rank first by the device they need,
    `fit_memory` bytes (None: more than any device tried, so last), smallest first: the figure
    that says how far each is from fitting."""
    if result.num_ooms == 0:
        return (0, 0, 0, result.peak_reserved, result.num_device_alloc, order)
    need = (math.inf if fit_memory is None else fit_memory) if fit else 0
    return (1, need, result.num_ooms, result.peak_reserved, result.num_device_alloc, order)


def tune(trace, *, grid="default", configs=(), jobs=None, device_memory=None, device=0,
         progress=None, snapshot=None, memory_fraction=None, fit=False) -> TuneResult:
    """Replay a trace under a grid of allocator settings and rank them (rank_key: the settings
    that fit the device by peak reserved bytes, then those that ran out of memory).

    Args:
        trace: path to a snapshot (.pickle / .pickle.gz), a snapshot dict, or a
            pyalloc.trace.Trace of `device` (its checks and recorded OOM are then reused).
        grid: "default", "wide" or None (no grid: only `configs`).
        configs: more setting strings to try (PyTorch's syntax); ConfigError if one is malformed.
        jobs: worker processes (default os.cpu_count()); 1 replays in this process.
        device_memory: simulated device size in bytes. per_process_memory_fraction and
            garbage_collection_threshold are relative to it. Default: for a trace with a
            recorded OOM, the limit that OOM implies (RecordedOom.device_memory; the result says
            so in device_memory_derived), else 80 GiB.
        memory_fraction: the per-process memory fraction the run had (replay's memory_fraction),
            applied to every setting; None: each setting's own.
        fit: True adds per setting the smallest device memory on which the whole trace runs
            without an out-of-memory (TuneRow.fit_memory; fit_device_memory).
        device: which device's trace to replay.
        progress: optional callable(done_settings, total_settings).
        snapshot: the already-loaded dict (or Trace) of `trace` (a path), so that this process
            does not load it again; worker processes that cannot fork load it from the path.
    The trace's own setting is the baseline, replayed at the recorded addresses and fresh; every
    other setting is replayed fresh (see the module docstring for why). Raises SnapshotError for
    a file that is not a snapshot, holds no trace for `device` or has a corrupt trace entry
    (checked once here, before any replay).
    """
    if jobs is None:
        jobs = os.cpu_count() or 1
    if isinstance(jobs, bool) or not isinstance(jobs, int) or jobs < 1:
        raise ValueError(f"jobs must be an int >= 1, got {jobs!r}")
    memory_fraction = check_memory_fraction(memory_fraction)
    if isinstance(configs, str):
        raise TypeError("configs must be a list of setting strings, not one string")
    candidates = (grid_settings(grid) if grid is not None else []) + list(configs)
    parsed = [CudaAllocatorConfig(c) for c in candidates]   # ConfigError before any work
    if snapshot is not None and not isinstance(trace, (dict, Trace)):
        read = snapshot if isinstance(snapshot, Trace) else Trace(snapshot, device, path=trace)
    else:
        read = as_trace(trace, device)
    read.check()
    own = read.own_config
    # The device a recorded OOM implies is the one whose fraction gives its limit: the run's
    # fraction, given here or in its own setting (per_process_memory_fraction).
    oom = (recorded_oom(read, device=device, memory_fraction=fraction_in_force(own, memory_fraction),
                        check=False)
           if read.has_ooms else None)
    derived = device_memory is None and oom is not None
    if device_memory is None:
        device_memory = implied_device_memory(oom) if oom is not None else DEFAULT_DEVICE_MEMORY

    rows: list[TuneRow] = []
    baseline = TuneRow(own, "recorded", own=True)
    own_fresh = TuneRow(own, "fresh", own=True)
    try:
        own_key = settings_key(CudaAllocatorConfig(own))
    except ValueError as err:   # a setting pyalloc cannot parse (ConfigError is a ValueError)
        own_key = None
        for row in (baseline, own_fresh):
            reason = str(err).splitlines()[0]   # ConfigError adds the string and a caret below
            row.error, row.skipped = f"the trace's own setting is not valid here: {reason}", True
    seen = {own_key}
    for text, settings in zip(candidates, parsed):
        key = settings_key(settings)
        if key in seen:      # the own setting, or a repeat of an earlier candidate
            continue
        seen.add(key)
        rows.append(TuneRow(text, "fresh", own=False))

    # The baseline runs first, here: its replay (the own setting at the trace's addresses and
    # limit) decides which segment frees were empty_cache() calls, for every other replay.
    # (A trace without segment frees has nothing to classify: the baseline then runs with the
    # others, in parallel.)
    calls = None if read.has_releases else []
    if baseline.error is None and calls is None:
        _, baseline.result, baseline.skipped, baseline.error, _ = _run_one(
            (0, own, "recorded", device_memory, memory_fraction, None, False), read)
        if baseline.result is not None:
            calls = baseline.result.release_calls
    if calls is None and own_fresh.error is None:
        calls = classify_releases(read, device=device, device_memory=device_memory,
                                  memory_fraction=memory_fraction)
    to_run = [row for row in [baseline] if row.error is None and row.result is None]
    to_run += [row for row in [own_fresh] + rows if row.error is None]
    job_list = [(i, row.config, row.placement, device_memory, memory_fraction, calls,
                 fit and row is not baseline) for i, row in enumerate(to_run)]
    source = read.path if read.path is not None else read.slim().snapshot
    outcomes = _run_jobs(job_list, read, source, jobs, progress)
    for i, row in enumerate(to_run):
        _, row.result, row.skipped, row.error, row.fit_memory = outcomes[i]

    ran = [r for r in [own_fresh] + rows if r.result is not None]
    # Every replay notices a wrapped trace (frees of blocks it never saw); ask one that ran.
    replayed = [r.result for r in [baseline] + ran if r.result is not None]
    wrapped = replayed[0].wrapped if replayed else read.wrapped
    reference = own_fresh.result
    if reference is not None:
        for row in ran:
            row.saving = reference.peak_reserved - row.result.peak_reserved
    order = {id(r): i for i, r in enumerate([own_fresh] + rows)}
    ran.sort(key=lambda r: rank_key(r.result, order[id(r)], fit=fit, fit_memory=r.fit_memory))
    best = ran[0] if ran else None
    not_run = [r for r in [baseline, own_fresh] + rows if r.result is None]
    return TuneResult(
        trace=read.path if read.path is not None else "<snapshot>", device=device,
        device_memory=device_memory, events=len(read.entries), allocations=read.allocations,
        wrapped=wrapped, own_config=own, baseline=baseline, rows=ran,
        # The own setting's fresh row repeats the baseline's reason when both were skipped.
        skipped=[r for r in not_run if r.skipped and not (r is own_fresh and baseline.skipped)],
        failed=[r for r in not_run if not r.skipped], best=best, recorded_oom=oom,
        device_memory_derived=derived, memory_fraction=memory_fraction, fit=fit,
        empty_cache_calls=calls)


# -- the table --------------------------------------------------------------------------------------

WIDTH = 100      # the report's lines fit this many columns (the final PYTORCH_CUDA_ALLOC_CONF line
                 # and an unbreakable trace path excepted)


def _label(config: str) -> str:
    return config if config else "(defaults)"


def count_words(n: int, singular: str, plural: str | None = None) -> str:
    """'1 event', '2 events', '1,200 entries' (plural given): a count and its noun, agreeing."""
    return f"{n:,} {singular if n == 1 else (plural or singular + 's')}"


def bytes_words(nbytes: int) -> str:
    """format_bytes(nbytes), except that a single byte is '1 byte' (format_bytes says '1 bytes')."""
    return "1 byte" if abs(int(nbytes)) == 1 else format_bytes(nbytes)


def change_words(delta: int, fraction: float | None = None) -> str:
    """A difference in bytes (positive: less than the reference) in words: '284.00 MiB less
    (2.1%)', '5.51 GiB more (96.7%)', 'the same'."""
    if delta == 0:
        return "the same"
    text = f"{bytes_words(abs(delta))} {'less' if delta > 0 else 'more'}"
    if fraction is not None:
        text += f" ({abs(fraction):.1%})"
    return text


def _setting_pieces(text: str) -> list[str]:
    """A setting string cut after each comma: the pieces a line may break between (a key and its
    value, 'max_split_size_mb:128,', are never broken)."""
    return [piece for piece in re.split(r"(?<=,)", text) if piece]


def _wrap_setting(text: str, width: int, indent: int = 2) -> list[str]:
    """A setting string in lines of at most `width` columns, broken only after commas;
    continuation lines leave room for an `indent`-space indent. A piece longer than a line has
    one to itself (a key is never broken, even where it overflows)."""
    lines = []
    for piece in _setting_pieces(text):
        if lines and len(lines[-1]) + len(piece) <= (width if len(lines) == 1 else width - indent):
            lines[-1] += piece
        else:
            lines.append(piece)
    return lines or [""]


def report_width() -> int:
    """The columns tune's report fits: $COLUMNS when it is a positive integer, else WIDTH (100);
    not the terminal's own width, so that output piped to a file reads the same."""
    try:
        columns = int(os.environ.get("COLUMNS", ""))
    except ValueError:
        return WIDTH
    return columns if columns > 0 else WIDTH


def format_table(result: TuneResult, width: int = WIDTH) -> str:
    """The ranking as text, in lines of at most `width` columns: one row per setting, numbered,
    the settings that fit the device first; the ones that ran out of memory under a divider,
    marked '!'; the trace's own setting marked '*'; notes on both under the table.

    The setting is a column, wrapped at commas, when the room the figures leave it holds its
    longest key:value piece; otherwise it goes under each row's figures, indented, so that no
    key is ever broken. (Only the figures themselves, about 90 columns with --fit and a recorded
    OOM, cannot be made narrower.)"""
    headers = (("", "#"), ("", "setting"), ("peak", "reserved"), ("vs the trace's", "own setting"),
               ("reserved/", "requested"), ("device", "allocs"), ("", "OOMs"))
    extra = []              # (header, cell(row)) of the columns only some reports have
    if result.recorded_oom is not None:
        extra.append((("recorded OOM", "fits? spare"), lambda row: oom_request_words(row)))
    if result.fit:
        # Under a memory fraction the limit it gives is the figure to read (the device is the
        # limit over the fraction).
        fraction = result.allowed_memory is not None
        extra.append((("--fit:", "fits under" if fraction else "fits on"),
                      lambda row: "none" if row.fit_memory is None else format_bytes(
                          int(result.memory_fraction * float(row.fit_memory)) if fraction
                          else row.fit_memory)))
    headers = headers + tuple(h for h, _ in extra)
    body = []
    for rank, row in enumerate(result.rows, 1):
        r = row.result
        mark = ("*" if row.own else "") + ("!" if r.num_ooms else "")
        ratio = f"{r.reserved_over_requested:.3f}" if r.peak_requested else "-"
        body.append((f"{rank}{mark}", _label(row.config), format_bytes(r.peak_reserved), row.saving_words(),
                     ratio, f"{r.num_device_alloc:,}", f"{r.num_ooms:,}",
                     *(cell(row) for _, cell in extra), r.num_ooms > 0))
    widths = [max([len(h[0]), len(h[1])] + [len(b[i]) for b in body]) for i, h in enumerate(headers)]
    # One space after the rank, two between the other columns.
    fixed = sum(widths) - widths[1] + 1 + 2 * (len(headers) - 2)
    # A column when every setting wraps into the room left (continuation lines are indented by 2;
    # a setting of one piece needs no continuation line, so no room for the indent).
    room = width - fixed
    as_column = room >= len("setting") and all(
        len(line) + (2 if i else 0) <= room
        for b in body for i, line in enumerate(_wrap_setting(b[1], room)))
    if as_column:
        widths[1] = min(widths[1], width - fixed)
        columns = list(range(len(headers)))
    else:
        columns = [0] + list(range(2, len(headers)))      # the setting goes under the figures

    def fmt(cells):
        cells = [cells[i] for i in columns]
        out = [c.rjust(widths[i]) if i > 1 else c.ljust(widths[i]) for c, i in zip(cells[1:], columns[1:])]
        return (cells[0].ljust(widths[0]) + " " + "  ".join(out)).rstrip()

    lines = [fmt([h[0] for h in headers]), fmt([h[1] for h in headers])]
    total = max(len(lines[0]), len(lines[1]))
    lines.append("-" * total)
    ooms = [b for b in body if b[-1]]
    indent = " " * (widths[0] + 1)
    for cells in body:
        if cells is (ooms[0] if ooms else None):
            note = f" these ran out of memory on {result.device_words()} (see ! below) "
            side = max(total - len(note), 4)
            lines.append("-" * (side // 2) + note + "-" * (side - side // 2))
        if as_column:
            setting = _wrap_setting(cells[1], widths[1])
            lines.append(fmt([cells[0], setting[0], *cells[2:-1]]))
            lines += [fmt(["", "  " + more, *[""] * (len(headers) - 2)]) for more in setting[1:]]
        else:
            lines.append(fmt(list(cells[:-1])))
            setting = _wrap_setting(cells[1], width - len(indent))
            lines += [indent + setting[0]] + [indent + "  " + more for more in setting[1:]]
    lines.append("-" * total)
    notes = []
    if not as_column:
        notes.append(" setting: on the line(s) under each row's figures")
    if any(r.own for r in result.rows):
        notes.append(" *  the trace's own setting, replayed fresh like the others: the reference "
                     "of \"vs the trace's own setting\"")
    if result.recorded_oom is not None:
        notes.append(" recorded OOM: whether the request of the trace's first oom entry fits under "
                     "the setting, and the bytes a new segment could still have taken after it "
                     "(+) or was short of (-).")
    if result.fit:
        notes.append(" --fit: the smallest device memory (to 2 MiB) on which the whole trace, its "
                     "oom requests included, runs without an out-of-memory, found by bisection "
                     "over fresh-placement replays"
                     + (f"; under the memory fraction {result.memory_fraction:g}, the limit that "
                        "device gives (the JSON has both)." if result.allowed_memory is not None
                        else "."))
    if ooms:
        notes.append(f" !  OUT OF MEMORY: {len(ooms)} of {count_words(len(body), 'setting')} ran out of memory on "
                     f"{result.device_words()}. Each failed allocation was "
                     "skipped, so their peaks undercount what they would need: they rank below "
                     "every setting that fits, "
                     + ("the smallest device they need (--fit) first." if result.fit
                        else "fewest out-of-memory events first."))
    for note in notes:
        lines.append(textwrap.fill(note, width, subsequent_indent="    ", break_long_words=False,
                                   break_on_hyphens=False))
    return "\n".join(lines)


def oom_request_words(row: TuneRow) -> str:
    """The recorded OOM's request under a row's setting: 'yes +1.20 GiB' (fits, with that much to
    spare) or 'no -20.00 MiB' (out of memory, short by that much)."""
    req = row.recorded_oom_request
    if req is None or req.fits is None:
        return "-"
    if req.fits:
        return f"yes +{bytes_words(req.margin)}"
    return f"no -{bytes_words(-req.margin)}"


def recorded_oom_lines(oom: RecordedOom, events: int, device_memory: int, derived: bool,
                       memory_fraction: float | None, width: int = WIDTH) -> list[str]:
    """The paragraphs that open a report on a trace with a recorded out-of-memory, in lines of
    at most `width` columns."""
    out = [_para(
        f"RECORDED OUT OF MEMORY at event {oom.index:,} of {events:,}: a request of "
        f"{format_bytes(oom.size)} (a {format_bytes(oom.segment_size)} segment) on stream "
        f"{oom.stream} could not be served. Reserved then, after the out-of-memory ladder: "
        f"{format_bytes(oom.reserved)} ({oom.reserved:,} bytes), of which "
        f"{format_bytes(oom.cached_free)} sat free in the cache (fragmentation); the device had "
        f"{format_bytes(oom.device_free)} free. The trace holds {oom.count:,} such "
        f"out-of-memory entr{'y' if oom.count == 1 else 'ies'}.", width)]
    if derived:
        fraction = (f" with memory fraction {memory_fraction:g}"
                    if memory_fraction is not None and memory_fraction < 1.0 else "")
        out.append(_para(
            f"No --device-memory given: the OOM bounds the limit the run had to at most "
            f"{format_bytes(oom.limit)} ({oom.limit:,} bytes: reserved after the ladder plus the "
            f"segment it could not get, less one byte, or reserved plus the device's free bytes, "
            f"whichever is less, over every OOM); the replays use a device of "
            f"{format_bytes(device_memory)}{fraction}. Give --device-memory (and "
            "--memory-fraction) for the run's own figures.", width))
        if not oom.consistent:
            out.append(_para(
                f"Note: the run held {format_bytes(oom.peak_reserved)} at its peak, more than that "
                "bound: its limit changed during the run, or other processes took memory.", width))
    return out


def _para(text: str, width: int = WIDTH) -> str:
    return textwrap.fill(text, width, break_long_words=False, break_on_hyphens=False)


def format_report(result: TuneResult, width: int = WIDTH) -> str:
    """The whole human-readable report of `pyalloc tune`: header, table, skipped, best line, in
    lines of at most `width` columns (the final PYTORCH_CUDA_ALLOC_CONF line, pasted whole, and
    an unbreakable trace path excepted)."""
    out = []
    if result.recorded_oom is not None:
        out += recorded_oom_lines(result.recorded_oom, result.events, result.device_memory,
                                  result.device_memory_derived, result.memory_fraction, width)
    out += [_para(f"trace {result.trace}: {result.events:,} events, {result.allocations:,} "
                 f"allocations, device {result.device}; simulated device of "
                 f"{format_bytes(result.device_memory)} ({result.device_memory:,} bytes)"
                 + (f", memory fraction {result.memory_fraction:g}"
                    if result.memory_fraction is not None else ""), width)]
    if result.wrapped:
        out.append(_para("the trace starts in the middle of the run (wrapped ring buffer or late "
                         "start): the figures cover only the recorded window", width))
    base = result.baseline
    if base.result is not None:
        b = base.result
        text = (f"trace's own setting {_label(base.config)}, replayed at the trace's addresses: "
                f"peak reserved {format_bytes(b.peak_reserved)}, allocated "
                f"{format_bytes(b.peak_allocated)}, requested {format_bytes(b.peak_requested)}, "
                f"{b.num_device_alloc:,} device allocations, {b.address_matches:,} of "
                f"{b.allocations:,} allocations at PyTorch's address")
        if b.num_alloc_retries:
            text += (f", {b.num_alloc_retries:,} allocation "
                     f"retr{'y' if b.num_alloc_retries == 1 else 'ies'} (device allocations that "
                     "failed and were retried after freeing cached blocks)")
        if b.num_ooms:
            text += f", {count_words(b.num_ooms, 'OUT-OF-MEMORY event')}"
        out.append(_para(text, width))
    else:
        out.append(_para(f"trace's own setting {_label(base.config)} was not replayed: {base.error}", width))
    if gc_without_fraction(result.own_config, result.memory_fraction):
        out.append(_para("Note: the trace's own setting sets garbage_collection_threshold, which acts "
                         "only under a memory fraction below 1, and none is given: its segment frees "
                         "are taken as empty_cache() calls. If the run called "
                         "torch.cuda.set_per_process_memory_fraction, pass that fraction as "
                         "--memory-fraction.", width))
    out.append(_para("The table replays every setting with fresh placement (segments where the "
                     "simulated device puts them), the own setting included, so that the "
                     "differences come from the settings and not from where the driver put "
                     "segments.", width))
    effect = result.placement_effect
    if effect:
        out.append(_para(f"Placement alone changes the own setting's peak reserved: fresh "
                         f"placement reserves {change_words(-effect)} than at the trace's addresses; "
                         "smaller differences say little.", width))
    out.append("")
    if result.rows:
        out.append(format_table(result, width))
    for row in result.skipped:
        out.append(_para(f"skipped {_label(row.config)}: {row.error}", width))
    for row in result.failed:
        out.append(_para(f"failed  {_label(row.config)}: {row.error}", width))
    out.append("")
    if result.best is None:
        out.append("no setting could be replayed")
        return "\n".join(out)
    best = result.best
    if not result.best_avoids_oom:
        out.append(_para(f"every setting ran out of memory on {result.device_words()}; the one "
                         + ("that needs the smallest device (--fit):" if result.fit
                            else "with the fewest out-of-memory events:"), width))
    elif best.own:
        out.append("the trace's own setting is already the best of this grid:")
    else:
        out.append(_para(
            f"best: {_label(best.config)}, peak reserved {format_bytes(best.result.peak_reserved)}"
            + (f" ({change_words(best.saving)} than the own setting)" if best.saving else "")
            + ":", width))
    out.append(result.best_line())
    return "\n".join(out)
