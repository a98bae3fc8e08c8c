"""Command line: `pyalloc replay TRACE` and `pyalloc tune TRACE` (also `python -m pyalloc ...`).

Both read a memory snapshot recorded by PyTorch (or pyalloc) with history on and replay its
allocation stream on the simulated device, so they need no GPU. `replay` prints the figures of one
setting; `tune` ranks a grid of settings (those that fit the device by peak reserved memory, then
those that ran out of memory) and prints the best one as a PYTORCH_CUDA_ALLOC_CONF line.

`view` shows where a trace's memory went (pyalloc.view): a terminal summary, or with -o one
self-contained HTML page (pyalloc.report_html); `tune --html` draws each setting's curve.

Exit statuses: see EXIT_STATUSES (also printed by --help).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import textwrap
from fractions import Fraction

# Units of sizes (case-insensitive): B, KB, MB, GB, TB are powers of 1000; KiB, MiB, GiB, TiB
# powers of 1024; a bare K, M, G or T means KiB, MiB, GiB, TiB (80G is 80GiB), as `ls -h` and
# `docker --memory` read them.
SIZE_UNITS = {
    "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40,
    "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40,
}
_UNIT_NAMES = "B, KB, MB, GB, TB (powers of 1000), KiB, MiB, GiB, TiB or K, M, G, T (powers of 1024)"
_SIZE = re.compile(r"\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([A-Za-z]*)\s*")
# A number without a unit counts bytes and must be at least this many: a smaller one is a
# forgotten unit (`--device-memory 80` for 80 GiB), not a device size.
MIN_BARE_BYTES = 1 << 20

EXIT_STATUSES = """\
exit statuses:
  0    success (a replay that runs out of memory still succeeds: its out-of-memory count says so)
  1    tune could replay none of its settings (each failed or was skipped: the report says why),
       or the output pipe closed early
  2    bad input, reported as one line on stderr: a usage error (a bad option or size), a file
       that is not a readable snapshot (or larger than --max-input-size), no trace for --device,
       a corrupt trace entry, a malformed setting string or one this pyalloc cannot replay; also
       an output (-o, --html, --dump or stdout) that cannot be written, e.g. on a full disk
  130  interrupted (Ctrl-C)"""

# A progress bar appears only for work still running after this many seconds, so quick runs
# print nothing extra (tests set it to 0).
PROGRESS_DELAY_S = 1.0


class CliError(Exception):
    """Bad input: printed as one line `pyalloc: error: ...` and exit status 2."""


class _StdoutError(CliError):
    """Standard output could not be written (a full disk): reported like an -o that cannot."""


def parse_size(text: str) -> int:
    """Bytes from a size: a whole number of bytes of at least MIN_BARE_BYTES ('85899345920'), or a
    number with a unit ('80GiB', '40GB', '13.7GiB', '80G' = '80GiB'; see SIZE_UNITS), rounded down
    to a whole byte. The one parser of every size the command line takes.
    ValueError naming the text for anything else: no number, an unknown unit, a bare number below
    MIN_BARE_BYTES or with decimals (it suggests a unit), less than one byte, 2**64 bytes or more."""
    match = _SIZE.fullmatch(text)
    if not match:
        raise ValueError(f"invalid size {text!r}: expected a number with a unit, e.g. 80GiB "
                         f"(units: {_UNIT_NAMES})")
    number, unit = match.groups()
    scale = SIZE_UNITS.get(unit.lower() if unit else "b")
    if scale is None:
        raise ValueError(f"invalid size {text!r}: unknown unit {unit!r}; use {_UNIT_NAMES}")
    value = Fraction(number) * scale
    if value == 0:           # no unit makes nothing bigger: suggesting '0GiB' would be refused too
        raise ValueError(f"invalid size {text!r}: the device needs at least one byte")
    if not unit:
        # GPU sizes are tens of GiB: a small number was meant in GiB, a larger one in MiB.
        guess = f"{number}GiB (or {number}GB)" if value <= 4096 else f"{number}MiB"
        if value.denominator != 1:
            raise ValueError(f"invalid size {text!r}: a number without a unit counts bytes and must "
                             f"be whole; add a unit, e.g. {guess}")
        if value < MIN_BARE_BYTES:
            raise ValueError(f"invalid size {text!r}: a number without a unit counts bytes, and "
                             f"{int(value):,} bytes is less than 1 MiB; add a unit, e.g. {guess}")
    if scale == 1 and value.denominator != 1:
        raise ValueError(f"invalid size {text!r}: not a whole number of bytes")
    value = int(value)          # rounded down to a whole byte
    if value <= 0:
        raise ValueError(f"invalid size {text!r}: the device needs at least one byte")
    if value >= 1 << 64:
        raise ValueError(f"invalid size {text!r}: at most 2**64 - 1 bytes")
    return value


class _HelpFormatter(argparse.HelpFormatter):
    """argparse's formatter, except that the exit-status table keeps its own line breaks."""

    def _fill_text(self, text, width, indent):
        if text is EXIT_STATUSES:
            return "".join(indent + line for line in text.splitlines(keepends=True))
        return super()._fill_text(text, width, indent)


class _Parser(argparse.ArgumentParser):
    """argparse's parser, except that a usage error is one line on stderr (and exit status 2),
    like every other bad input, instead of the usage text and the message."""

    def error(self, message):
        self.exit(2, f"pyalloc: error: {message} (see {self.prog} --help)\n")


def _size_arg(text):
    try:
        return parse_size(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _positive_int(text):
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return value


def _fraction_arg(text):
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"expected a fraction in (0, 1], got {text!r}")
    return value


def _device_arg(text):
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a device ordinal >= 0, got {text!r}")
    return value


class _Progress:
    """A progress bar on stderr (tqdm) when stderr is a terminal; otherwise it does nothing.

    Called as progress(done, total). The bar shows up only once the work has lasted
    PROGRESS_DELAY_S seconds and is erased when closed, so results print on a clean line."""

    def __init__(self, desc: str, unit: str):
        self._bar = None
        stream = sys.stderr
        if not (hasattr(stream, "isatty") and stream.isatty()):
            return
        try:
            from tqdm import tqdm
        except ImportError:   # a progress bar is a nicety: never fail a replay for it
            return
        self._bar = tqdm(desc=desc, unit=unit, unit_scale=unit != "setting", delay=PROGRESS_DELAY_S,
                         file=stream, leave=False, dynamic_ncols=True)

    def __call__(self, done: int, total: int) -> None:
        if self._bar is None:
            return
        if self._bar.total != total:
            self._bar.total = total
        self._bar.update(done - self._bar.n)

    def close(self):
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _json_safe(value):
    from pyalloc.tune import _json_safe as safe
    return safe(value)


def _warn(message: str) -> None:
    print(f"pyalloc: warning: {message}", file=sys.stderr)


# -- shared steps -------------------------------------------------------------------------------------

def _load_trace(path: str, device: int, max_bytes: int):
    """The Trace of `device` in the snapshot file `path` (pyalloc.trace), or CliError with
    SnapshotError's message: also for a corrupt trace entry or a setting stored as something
    other than a string, checked here once so that no command meets them later as an exception.
    `max_bytes`: --max-input-size. Every step of the command reads this one Trace."""
    from pyalloc.snapshot import SnapshotError, load
    from pyalloc.trace import Trace, trace_devices

    try:
        snapshot = load(path, max_bytes=max_bytes)
    except SnapshotError as err:
        raise CliError(str(err)) from None
    devices = trace_devices(snapshot)
    if devices and device not in devices:
        held = ", ".join(map(str, devices))
        raise CliError(f"--device {device}: {path} holds no allocator trace for device {device}; it "
                       f"holds traces for device{'s' if len(devices) > 1 else ''} {held} "
                       f"(try --device {devices[0]})")
    try:
        return Trace(snapshot, device, path=path)
    except SnapshotError as err:
        raise CliError(f"{path}: {err}") from None


def _config_error(err, what: str) -> CliError:
    # ConfigError's message shows the string and a caret on two more lines; the command line
    # reports bad input on one line, with the position in words.
    first = str(err).splitlines()[0]
    position = getattr(err, "position", None)
    where = f" (at character {position})" if position is not None else ""
    return CliError(f"{what}: {first}{where}")


def _check_config(config: str, what: str):
    """The parsed settings of `config`, or CliError for a malformed string."""
    from pyalloc.config import ConfigError, CudaAllocatorConfig

    try:
        return CudaAllocatorConfig(config)
    except ConfigError as err:
        raise _config_error(err, what) from None


def _wrapped_warning(wrapped) -> None:
    # The replay itself notices a wrapped trace (frees of blocks it never saw allocated), so the
    # warning comes after it instead of costing a separate pass over the events.
    if wrapped:
        _warn("the trace starts in the middle of the run (its ring buffer wrapped, or recording "
              "started late: it frees blocks it never saw allocated); the figures cover only the "
              "recorded window. Record with a larger max_entries to see the whole run.")


def _first_clause(err) -> str:
    """An exception's message up to its first ';' (the simulated device's overlap message goes on
    to explain itself at length)."""
    return str(err).split(";")[0]


def _pct(part, whole):
    return f"{100.0 * part / whole:.2f}%" if whole else "-"


# -- replay -----------------------------------------------------------------------------------------

def _check_dump_path(path: str) -> None:
    """CliError, before any work, when --dump's folder does not exist or the path is a folder."""
    _check_output_path(path, "--dump", "replay.pickle")


def _write_dump(snapshot: dict, path: str) -> None:
    from pyalloc import snapshot as snapshot_module

    try:
        snapshot_module.dump(snapshot, path)
    except OSError as err:
        raise CliError(f"--dump {path!r}: {err.strerror or err}") from None


def _replay_setting(args, trace):
    """(setting string, placement) of `pyalloc replay`: --config or the trace's own setting, and
    --placement or, by default, recorded under the trace's own setting and fresh under another."""
    from pyalloc.replay import settings_key

    own = trace.own_config
    if args.config is None:
        config, what = own, "the trace's own setting"
    else:
        config, what = args.config, "--config"
    try:
        settings = _check_config(config, what)
    except CliError as err:
        if args.config is None:   # the trace's own setting: another one may still replay
            raise CliError(f"{err}; pass --config to replay it under another setting") from None
        raise
    placement = args.placement
    if placement is None:
        # Recorded addresses belong to the sequence of segments the trace's own setting asked
        # for; under another setting they would land on unrelated segments.
        try:
            same = settings_key(settings) == settings_key(_check_config(own, "own"))
        except CliError:
            same = False
        placement = "recorded" if same else "fresh"
    return config, placement


def _replay_device_memory(args, trace, config):
    """(memory fraction in force, the trace's recorded OOM or None, whether the device size comes
    from that OOM, device memory in bytes) for `pyalloc replay`."""
    from pyalloc.replay import (DEFAULT_DEVICE_MEMORY, fraction_in_force, implied_device_memory,
                                recorded_oom)
    from pyalloc.snapshot import SnapshotError

    # The run's fraction, whether --memory-fraction or the setting's per_process_memory_fraction
    # gives it: the device a recorded OOM implies is the one whose fraction gives its limit.
    fraction = fraction_in_force(config, args.memory_fraction)
    oom = None
    if trace.has_ooms:
        try:
            oom = recorded_oom(trace, device=args.device, memory_fraction=fraction)
        except SnapshotError as err:   # a corrupt trace entry
            raise CliError(f"{args.trace}: {err}") from None
    derived = args.device_memory is None and oom is not None
    if derived:
        try:
            device_memory = implied_device_memory(oom)
        except SnapshotError as err:
            raise CliError(f"{args.trace}: {err}") from None
    else:
        device_memory = DEFAULT_DEVICE_MEMORY if args.device_memory is None else args.device_memory
    return fraction, oom, derived, device_memory


def _run_replay(args, trace, config, placement, device_memory):
    """(ReplayResult, placement it ran under) of `pyalloc replay`, with a progress bar; recorded
    placement chosen by default falls back to fresh when the trace's addresses do not fit."""
    from pyalloc.replay import replay
    from pyalloc.snapshot import SnapshotError

    def run(placement):
        with _Progress("replay", "ev") as bar:
            # --dump records the replay's own history: its snapshot is a timeline of the replay.
            return replay(trace, config=config, placement=placement, device_memory=device_memory,
                          device=args.device, progress=bar, history=bool(args.dump),
                          memory_fraction=args.memory_fraction)

    try:
        try:
            return run(placement), placement
        except RuntimeError as err:
            if placement != "recorded":
                raise
            # The simulated device refuses a recorded address that overlaps a live segment: the
            # trace's segment sequence does not fit this replay (a device or fraction other than
            # the run's changes the segments it frees). Asked for, that is an error; chosen by
            # default, fresh placement replays it, as tune and recorded_oom do.
            if args.placement == "recorded":
                raise CliError(f"replay at the trace's addresses failed ({err}); "
                               "try --placement fresh") from None
            _warn(f"the trace's addresses do not fit this replay ({_first_clause(err)}): replayed "
                  "with fresh placement instead")
            return run("fresh"), "fresh"
    except SnapshotError as err:   # a corrupt trace entry
        raise CliError(f"{args.trace}: {err}") from None


def _print_replay_report(args, r, config, own, placement, device_memory, derived):
    """The text report of `pyalloc replay`: one line per figure of the ReplayResult `r`, each
    wrapped under its own column to the report's width."""
    from pyalloc.errors import format_bytes
    from pyalloc.tune import bytes_words, report_width

    width = report_width()

    def line(name, value):
        # Wrapped under its own column (a path or a number is never broken).
        print(textwrap.fill(f"{name + ':':<24}{value}", width, subsequent_indent=" " * 24,
                            break_long_words=False, break_on_hyphens=False))

    line("trace", f"{args.trace} ({r.events:,} events, {r.allocations:,} allocations, device {args.device})")
    line("setting", (config or "(defaults)") + ("  (the trace's own)" if config == own else ""))
    line("placement", "recorded (segments at the trace's addresses)" if placement == "recorded"
         else "fresh (segments where the simulated device puts them, top-down)")
    line("device memory", f"{format_bytes(device_memory)} ({device_memory:,} bytes)"
         + ("  (the limit the recorded OOM implies)" if derived else ""))
    if r.memory_fraction is not None:
        line("memory fraction", f"{r.memory_fraction:g}: at most {format_bytes(r.allowed_memory)} "
                                f"({r.allowed_memory:,} bytes)")
    for name, value in (("peak reserved", r.peak_reserved), ("peak allocated", r.peak_allocated),
                        ("peak requested", r.peak_requested)):
        line(name, f"{format_bytes(value)} ({value:,} bytes)")
    line("reserved / requested", f"{r.reserved_over_requested:.4f}" if r.peak_requested else "-")
    line("device allocations", f"{r.num_device_alloc:,}")
    line("allocation retries", f"{r.num_alloc_retries:,}" + (
        "  (failed device allocations retried after freeing cached blocks)"
        if r.num_alloc_retries else ""))
    line("out-of-memory events", f"{r.num_ooms:,}" + (
        "  (each failed allocation was skipped, and the replay went on)" if r.num_ooms else ""))
    if r.oom_requests:
        first = r.oom_requests[0]
        words = (f"fits, {bytes_words(first.margin)} to spare" if first.fits
                 else f"out of memory again, {bytes_words(-first.margin)} short")
        line("recorded OOM's request", f"{words}; {r.oom_requests_fitting:,} of "
                                       f"{len(r.oom_requests):,} oom requests fit (each freed at once)")
    line("empty_cache calls", f"{r.empty_cache_calls:,}  (segment-free runs replayed as calls; the "
                              "others are the policy's own releases)")
    if placement == "recorded":
        line("at the trace's address", f"{r.address_matches:,} of {r.allocations:,} allocations "
                                       f"({_pct(r.address_matches, r.allocations)})")
    else:
        line("at the trace's address", "- (fresh placement)")
    line("speed", f"{r.events_per_second:,.0f} events/s ({r.events:,} events in {r.seconds:.3f} s)")
    if args.dump:
        line("history written to", f"{args.dump} (the replay's events and final segments)")


def _cmd_replay(args) -> int:
    from pyalloc.replay import gc_without_fraction
    from pyalloc.tune import recorded_oom_lines, report_width

    trace = _load_trace(args.trace, args.device, args.max_input_size)
    own = trace.own_config
    config, placement = _replay_setting(args, trace)
    if args.dump:
        _check_dump_path(args.dump)
    fraction, oom, derived, device_memory = _replay_device_memory(args, trace, config)
    if gc_without_fraction(own, fraction):
        _warn("the trace's own setting sets garbage_collection_threshold, which acts only under a "
              "memory fraction below 1, and none is given: its segment frees are replayed as "
              "empty_cache() calls. If the run called torch.cuda.set_per_process_memory_fraction, "
              "pass that fraction as --memory-fraction.")
    if oom is not None and not args.json:
        for text in recorded_oom_lines(oom, len(trace.entries), device_memory, derived, fraction,
                                       report_width()):
            print(text)
    result, placement = _run_replay(args, trace, config, placement, device_memory)
    if args.dump:
        _write_dump(result.snapshot, args.dump)
    _wrapped_warning(result.wrapped)
    if args.json:
        out = result.as_dict()
        out.update(trace=args.trace, device=args.device, device_memory=device_memory,
                   own_config=own, dumped=args.dump, device_memory_derived=derived,
                   recorded_oom=oom.as_dict() if oom is not None else None)
        print(json.dumps(_json_safe(out)))
        return 0
    _print_replay_report(args, result, config, own, placement, device_memory, derived)
    return 0


# -- tune -------------------------------------------------------------------------------------------

def _cmd_tune(args) -> int:
    from pyalloc.config import ConfigError, CudaAllocatorConfig
    from pyalloc.snapshot import SnapshotError
    from pyalloc.tune import format_report, report_width, tune

    for text in args.config or ():
        try:
            CudaAllocatorConfig(text)
        except ConfigError as err:
            raise _config_error(err, "--config") from None
    trace = _load_trace(args.trace, args.device, args.max_input_size)
    if args.html:
        _check_html_path(args.html, "--html")
    # --config alone tries just those settings; --grid adds a whole grid to them.
    grid = args.grid if args.grid is not None else (None if args.config else "default")
    with _Progress("tune", "setting") as bar:
        try:
            # The Trace carries its path: a worker that cannot fork loads the file itself.
            result = tune(trace, grid=grid, configs=args.config or (), jobs=args.jobs,
                          device_memory=args.device_memory, device=args.device, progress=bar,
                          memory_fraction=args.memory_fraction, fit=args.fit)
        except SnapshotError as err:   # a corrupt trace entry
            raise CliError(f"{args.trace}: {err}") from None
    _wrapped_warning(result.wrapped)
    if args.json:
        print(json.dumps(result.as_dict()))
    else:
        print(format_report(result, report_width()))
    if args.html:
        _write_tune_html(args.html, result, trace, quiet=args.json)
    if result.best is None:
        print(f"pyalloc: error: no setting could be replayed ({len(result.failed)} failed, "
              f"{len(result.skipped)} skipped)", file=sys.stderr)
        return 1
    return 0


# -- view -------------------------------------------------------------------------------------------

def _check_output_path(path: str, what: str, example: str) -> None:
    """CliError, before any work, when the output file `path` of option `what` cannot be made:
    its folder does not exist, or it is a folder itself (`example` names a file to give)."""
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise CliError(f"{what} {path!r}: folder {folder!r} does not exist")
    if os.path.isdir(path):
        raise CliError(f"{what} {path!r} is a folder; give a file name such as {example}")


def _check_html_path(path: str, what: str) -> None:
    _check_output_path(path, what, "report.html")


def _write_html(path: str, text: str, what: str) -> int:
    """Write a page (atomically: a failure keeps an old file); returns its size in bytes."""
    from pyalloc.report_html import write

    try:
        return write(path, text)
    except OSError as err:
        raise CliError(f"{what} {path!r}: {err.strerror or err}") from None


def _write_tune_html(path: str, result, trace, quiet: bool) -> None:
    from pyalloc.report_html import tune_page
    from pyalloc.view import tune_curves

    _write_html(path, tune_page(result, tune_curves(result, trace)), "--html")
    if not quiet:     # --json: stdout holds the JSON object only
        print(f"chart written to {path}")


def _cmd_view(args) -> int:
    from pyalloc.errors import format_bytes
    from pyalloc.snapshot import SnapshotError
    from pyalloc.tune import count_words, report_width
    from pyalloc.view import analyze, format_summary

    if args.output:
        _check_html_path(args.output, "-o")
    trace = _load_trace(args.snapshot, args.device, args.max_input_size)
    try:
        view = analyze(trace, device=args.device, path=args.snapshot)
    except SnapshotError as err:     # a frame or tag of the wrong shape
        raise CliError(f"{args.snapshot}: {err}") from None
    except (KeyError, TypeError, AttributeError) as err:
        raise CliError(f"{args.snapshot!r}: a trace entry lacks a field or has one of the wrong type "
                       f"({type(err).__name__}: {err})") from None
    if not args.output:
        print(format_summary(view, width=report_width()))
        return 0
    from pyalloc.report_html import view_page

    size = _write_html(args.output, view_page(view), "-o")
    series = view.peak_series
    value, event = view.peaks[series]
    print(f"{args.output}: {size / 1e6:.2f} MB; peak {series} {format_bytes(value)} "
          f"at event {event:,}" + (f"; {count_words(len(view.ooms), 'out-of-memory event')}"
                                   if view.ooms else ""))
    return 0


# -- entry point ------------------------------------------------------------------------------------

def _add_max_input_size(parser) -> None:
    from pyalloc.snapshot import DEFAULT_MAX_BYTES

    parser.add_argument("--max-input-size", type=_size_arg, default=DEFAULT_MAX_BYTES, metavar="SIZE",
                        help="read snapshot files, and the pickle a .gz decompresses to, of at most "
                             f"this size (default {DEFAULT_MAX_BYTES >> 30}GiB, ~14 million "
                             "trace entries; loading takes about 5 times the pickle's size in "
                             "memory), so that a gzip bomb or /dev/zero stops with one line")


def build_parser() -> argparse.ArgumentParser:
    from pyalloc import __version__

    parser = _Parser(
        prog="pyalloc",
        description="PyTorch's CUDA caching allocator on a simulated device: replay a recorded "
                    "memory snapshot and find the allocator settings that reserve least.",
        epilog=EXIT_STATUSES, formatter_class=_HelpFormatter)
    parser.add_argument("--version", action="version", version=f"pyalloc {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    parser.commands = sub.choices    # name -> subparser, for errors that name its --help

    common = _Parser(add_help=False)
    common.add_argument("trace", metavar="TRACE",
                        help="memory snapshot (.pickle or .pickle.gz) recorded with "
                             "torch.cuda.memory._record_memory_history(enabled='all')")
    common.add_argument("--device-memory", type=_size_arg, default=None, metavar="SIZE",
                        help="simulated device size: a number with a unit, e.g. 80GiB, 13.7GiB, "
                             "40GB: KB, MB, GB, TB are powers of 1000; KiB, MiB, GiB, TiB and K, "
                             "M, G, T powers of 1024 (80G means 80GiB); decimals are rounded down "
                             "to a byte. A number without a unit counts bytes and must be at least "
                             "1 MiB (1048576). Default 80GiB. Out-of-memory events count against it")
    common.add_argument("--memory-fraction", type=_fraction_arg, default=None, metavar="F",
                        help="the per-process memory fraction the run had "
                             "(torch.cuda.set_per_process_memory_fraction): the allocator may hold "
                             "floor(F x device memory) bytes, and garbage_collection_threshold, "
                             "which acts only under a fraction below 1, counts from that. Default: "
                             "the setting's own per_process_memory_fraction, else none")
    common.add_argument("--device", type=_device_arg, default=0, metavar="N",
                        help="which device's trace to replay (default 0)")
    common.add_argument("--json", action="store_true", help="print one JSON object")
    _add_max_input_size(common)

    p = sub.add_parser("replay", parents=[common], epilog=EXIT_STATUSES,
                       formatter_class=_HelpFormatter,
                       help="replay a trace under one setting and print its figures",
                       description="Replay a trace's allocations and frees through pyalloc and print "
                                   "peak reserved/allocated/requested bytes, device allocations, "
                                   "allocation retries, out-of-memory events and replay speed.")
    p.add_argument("--config", default=None, metavar="STR",
                   help="allocator setting string (PYTORCH_CUDA_ALLOC_CONF syntax); default: the "
                        "trace's own")
    p.add_argument("--placement", choices=("recorded", "fresh"), default=None,
                   help="recorded: new segments at the trace's addresses (reproduces PyTorch's "
                        "figures); fresh: where the simulated device puts them. Default: recorded "
                        "under the trace's own setting, fresh under another")
    p.add_argument("--dump", default=None, metavar="PATH",
                   help="record the replay's own memory history and write its snapshot here: every "
                        "alloc, free and segment event of the replay (a timeline that python -m "
                        "torch.cuda._memory_viz trace_plot draws; it reads .pickle, not .gz) and "
                        "the final segments")
    p.set_defaults(func=_cmd_replay)

    t = sub.add_parser("tune", parents=[common], epilog=EXIT_STATUSES,
                       formatter_class=_HelpFormatter,
                       help="replay a trace under a grid of settings and rank them",
                       description="Replay a trace under a grid of allocator settings in parallel, "
                                   "rank them (settings that fit the device first, by peak reserved "
                                   "memory; those that ran out of memory below), and end with the best "
                                   "as a PYTORCH_CUDA_ALLOC_CONF line. The trace's own setting is the "
                                   "baseline: it is replayed at the trace's addresses (PyTorch's own "
                                   "figures) and, like every other setting, with fresh placement; the "
                                   "table compares the fresh replays, so that savings come from the "
                                   "settings rather than from where the driver put segments. "
                                   "garbage_collection_threshold acts only under a "
                                   "per_process_memory_fraction below 1, a share of --device-memory: "
                                   "give your GPU's size there.")
    t.add_argument("--grid", choices=("default", "wide"), default=None,
                   help="settings to try (default: 'default', or none when --config is given)")
    t.add_argument("--config", action="append", metavar="STR",
                   help="a setting string to try (repeatable); without --grid only these run")
    t.add_argument("--jobs", type=_positive_int, default=os.cpu_count() or 1, metavar="N",
                   help="worker processes (default: the number of CPUs)")
    t.add_argument("--fit", action="store_true",
                   help="also find, per setting, the smallest device memory (to 2 MiB) on which the "
                        "whole trace, its out-of-memory requests included, runs without an "
                        "out-of-memory: bisection over replays with fresh placement")
    t.add_argument("--html", default=None, metavar="PATH",
                   help="also write a self-contained HTML page: each setting's reserved memory over "
                        "the trace on one chart, the table beside it")
    t.set_defaults(func=_cmd_tune)

    v = sub.add_parser("view", epilog=EXIT_STATUSES, formatter_class=_HelpFormatter,
                       help="show where a snapshot's memory went (terminal summary or HTML page)",
                       description="Rebuild a snapshot's memory over its trace: peak allocated, reserved "
                                   "and requested bytes and when, out-of-memory events, bytes per "
                                   "user_metadata tag. With -o, write one self-contained HTML page (no "
                                   "network): the timeline, the segment maps at the peak and at the first "
                                   "OOM, the largest live allocations with their stacks, bytes per tag.")
    v.add_argument("snapshot", metavar="SNAPSHOT",
                   help="memory snapshot (.pickle or .pickle.gz) from PyTorch or pyalloc, recorded "
                        "with history on (enabled='all')")
    v.add_argument("-o", "--output", default=None, metavar="PATH", help="write the HTML page here")
    v.add_argument("--device", type=_device_arg, default=0, metavar="N",
                   help="which device's trace to show (default 0)")
    _add_max_input_size(v)
    v.set_defaults(func=_cmd_view)
    return parser


class _Stdout:
    """sys.stdout while a command runs: a failed write or flush (a full disk: `> /dev/full`), or
    a write to a stdout that was closed from the start, becomes CliError, one line like -o's,
    instead of a traceback (or, when closed, of output lost without a word). BrokenPipeError
    passes through: a reader that went away (`| head`) is not an error to report."""

    def __init__(self, stream):
        self._stream = stream

    def _guard(self, name, *args):
        if self._stream is None:     # started with stdout closed (`>&-`): Python sets it to None
            raise _StdoutError("cannot write to standard output: it is closed")
        try:
            return getattr(self._stream, name)(*args)
        except BrokenPipeError:
            raise
        except OSError as err:
            raise _StdoutError(f"cannot write to standard output: {err.strerror or err}") from None

    def write(self, text):
        return self._guard("write", text)

    def flush(self):
        return self._guard("flush")

    def __getattr__(self, name):
        return getattr(self._stream, name)


def _quiet_stdout() -> None:
    # Point stdout at devnull, so that the interpreter's final flush of what could not be
    # written does not raise again (Python's documented recipe for a closed pipe).
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):   # stdout has no descriptor (a test's capture)
        pass


def main(argv=None) -> int:
    """Run the command line with `argv` (default sys.argv[1:]); returns the exit status."""
    parser = build_parser()
    try:
        args, extra = parser.parse_known_args(argv)
        if extra:
            # argparse reports unknown options from the top-level parser; the help that lists
            # the options of the command given is that command's.
            parser.commands[args.command].error(f"unrecognized arguments: {' '.join(extra)}")
    except SystemExit as exit:   # --help, or a usage error argparse has already reported
        return exit.code if isinstance(exit.code, int) else 2
    stdout = sys.stdout
    sys.stdout = _Stdout(stdout)
    try:
        return _run(args)
    finally:
        sys.stdout = stdout


def _run(args) -> int:
    """args.func(args), its output flushed, with every failure as one line and its exit status."""
    try:
        status = args.func(args)
        sys.stdout.flush()       # a full disk shows here, while the error can still be reported
        return status
    except CliError as err:
        if isinstance(err, _StdoutError):
            _quiet_stdout()
        print(f"pyalloc: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("pyalloc: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # Whoever read the output (`| head`) has gone: stop quietly.
        _quiet_stdout()
        return 1


if __name__ == "__main__":
    sys.exit(main())
