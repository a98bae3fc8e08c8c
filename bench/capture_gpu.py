"""The random multi-stream capture benchmark (PyTorch PR #162186) on a GPU: the programs of
bench/capture_program.py captured through CuPy on pyalloc (pyalloc.cupy.graph) and through
PyTorch's own allocator (torch.cuda.graph + record_stream), next to pyalloc on the simulated
device running the same programs.

    python bench/capture_gpu.py                  the full grid (2x2x3 programs), ~1-3 minutes
    python bench/capture_gpu.py --quick          2 programs, fewer runs
    python bench/capture_gpu.py --json out.json  also every figure as JSON
    python bench/capture_gpu.py --dry-run        no GPU: CuPy and torch replaced by stand-ins over
                                                 the simulated device (bench/_fake_gpu.py), to
                                                 check the runners' logic and the subprocesses
    --parts sim,cupy,torch                       which runners (default all three)

On the GPU machine, with pyalloc built by `GPU_CHECK_BUILD_ONLY=1 bash tools/gpu-check.sh`:
    PYTHONPATH=/tmp/inst:/tmp/site python3 bench/capture_gpu.py --json $OUT/capture_gpu.json

Runners (each guarded: a failure prints one line and the others still run):
  sim    pyalloc on a SimDevice (bench/bench_capture.py's runner): peak reserved per setting.
  cupy   pyalloc.cupy.install(); `with pyalloc.cupy.graph(stream=s0) as g:` with CuPy streams
         s1.. (cupy.cuda.Stream(non_blocking=True)); an alloc is cupy.empty(n, uint8) under
         `with stream:`, a kernel `t.fill(1)` there, a join an Event recorded on one stream and
         waited on by the other, record_stream pyalloc.record_stream(t, stream), last-use marks
         allocator.record_stream(ptr, stream, last_use=True), a free dropping the array. The
         settings (off, on, on+a, on+b, on+a+b as in bench_capture.py) switch through
         pyalloc.set_allocator_settings with all three keys spelled out, and take turns run by
         run. Memory: the graph pool's reserved bytes (allocator._pool_info(g.pool())) after
         every op in the tracked run, the maximum.
  torch  PyTorch's CUDACachingAllocator: torch.cuda.graph(g, stream=s0) with torch.cuda.Stream()s,
         torch.empty(n, dtype=torch.uint8, device="cuda") under torch.cuda.stream(s), t.fill_(1),
         t.record_stream(s), torch.cuda.Event record/wait_event. Off/on need
         PYTORCH_CUDA_ALLOC_CONF=graph_capture_record_stream_reuse:False/True before torch
         initialises CUDA, so every setting runs in its own subprocess (this script with
         --torch-worker), in the order off, on, on, off (--torch-rounds 2): the timed runs of a
         setting are pooled over its processes. Memory: memory_reserved() minus its value at the
         start of the capture, after every op in the tracked run, the maximum (nothing else
         allocates during the capture); checked against the snapshot's segments whose
         segment_pool_id is g.pool() at the end. V/E: the captured cudaGraph_t
         (CUDAGraph(keep_graph=True).raw_cuda_graph(), cuGraphGetNodes/GetEdges) in the tracked run.

Capture time: wall seconds of the program loop inside the capture (begin/end excluded: ending a
capture instantiates the graph), median of the timed runs. Every run executes the identical op
list; the tracked run re-derives its digest from what it did (stream indexes and array sizes read
back) and the table marks a runner whose digest differs from the program's.
"""
import argparse
import gc
import json
import os
import re
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import capture_program as cp   # noqa: E402

MiB = 1 << 20
KEYS = ("graph_capture_record_stream_reuse", "graph_capture_cross_stream_reuse",
        "graph_capture_last_use_marks")
CUPY_SETTINGS = {                  # name -> ((reuse, cross, marks), issue last-use marks)
    "off": ((False, False, False), False),
    "on": ((True, False, False), False),
    "on+a": ((True, True, False), False),
    "on+b": ((True, False, True), True),
    "on+a+b": ((True, True, True), True),
}
TORCH_SETTINGS = {"off": "graph_capture_record_stream_reuse:False",
                  "on": "graph_capture_record_stream_reuse:True"}
RESULT_PREFIX = "TORCH_WORKER_RESULT "


def settings_string(flags):
    return ",".join(f"{k}:{v}" for k, v in zip(KEYS, flags))


def one_line(exc):
    text = f"{type(exc).__name__}: {exc}".replace("\n", " ")
    return text if len(text) <= 200 else text[:197] + "..."


def programs(args):
    if args.quick:
        return cp.grid(args.seed, steps=(500,), probs=cp.PROBS[:1])
    return cp.grid(args.seed)


# ------------------------------------------------------------------------------ runners

class CupyRunner(cp.Runner):
    """The program in CuPy on pyalloc: tensors are uint8 cupy arrays."""

    def __init__(self, cupy, streams, events, allocator, record_stream):
        self.streams = streams
        empty, uint8 = cupy.empty, cupy.uint8

        def alloc(nbytes, s):
            with s:
                return empty(nbytes, dtype=uint8)

        def kernel(t, s):
            with s:
                t.fill(1)

        def join(dst, src):
            ev = events[id(src)]
            ev.record(src)
            dst.wait_event(ev)
        self.alloc, self.kernel, self.join = alloc, kernel, join
        self.record_stream = record_stream                  # pyalloc.record_stream(array, stream)
        mark = allocator.record_stream
        self.mark = lambda t, s: mark(t.data.ptr, s, last_use=True)
        self.free = lambda t: None                          # execute() drops the last reference

    def nbytes(self, t):
        return int(t.nbytes)


class TorchRunner(cp.Runner):
    """The program in PyTorch: tensors are uint8 CUDA tensors on torch's own allocator."""

    def __init__(self, torch, streams, events):
        self.streams = streams
        empty, uint8, stream_ctx = torch.empty, torch.uint8, torch.cuda.stream

        def alloc(nbytes, s):
            with stream_ctx(s):
                return empty(nbytes, dtype=uint8, device="cuda")

        def kernel(t, s):
            with stream_ctx(s):
                t.fill_(1)

        def join(dst, src):
            ev = events[id(src)]
            ev.record(src)
            dst.wait_event(ev)
        self.alloc, self.kernel, self.join = alloc, kernel, join
        self.record_stream = lambda t, s: t.record_stream(s)
        self.free = lambda t: None

    def mark(self, t, s):
        raise RuntimeError("PyTorch has no last-use marks")

    def nbytes(self, t):
        return int(t.numel() * t.element_size())


# ------------------------------------------------------------------------------ sim

def run_sim_part(progs):
    import bench_capture as bc
    out = {}
    for prog in progs:
        row = out[prog.key] = {}
        for name, (flags, marks) in CUPY_SETTINGS.items():
            try:
                r = bc.run_sim(prog, settings_string(flags), marks, track=True)
                row[name] = dict(peak_reserved=r["peak_reserved"], peak_allocated=r["peak_allocated"],
                                 V=r["V"], E=r["E"], nodes_expanded=r["nodes_expanded"],
                                 digest=r["executed_digest"])
            except Exception as exc:   # noqa: BLE001 -- one line, the rest goes on
                print(f"sim {prog.name} {name}: failed: {one_line(exc)}")
                row[name] = dict(error=one_line(exc))
    return out


# ------------------------------------------------------------------------------ cupy

def cupy_setup(dry_run):
    """(cupy, allocator, graph(s0) context factory, record_stream, set_settings, device name)."""
    import pyalloc
    if dry_run:
        import _fake_gpu
        pyalloc.set_default_backend("sim")
        allocator = pyalloc.get_allocator(0)
        cupy = _fake_gpu.fake_cupy(allocator)
        return (cupy, allocator, _fake_gpu.fake_cupy_graph(cupy, allocator), pyalloc.record_stream,
                pyalloc.set_allocator_settings, "SimDevice (dry run)")
    import cupy
    import pyalloc.cupy
    pyalloc.cupy.install()
    device = cupy.cuda.Device()
    allocator = pyalloc.get_allocator(device.id)
    try:
        name = cupy.cuda.runtime.getDeviceProperties(device.id)["name"].decode()
    except Exception:   # noqa: BLE001
        name = f"device {device.id}"
    return (cupy, allocator, lambda s0: pyalloc.cupy.graph(stream=s0), pyalloc.record_stream,
            pyalloc.set_allocator_settings, f"{name}, CuPy {cupy.__version__}")


def run_cupy_part(progs, runs, dry_run, deadline):
    cupy, allocator, graph, record_stream, set_settings, device = cupy_setup(dry_run)
    nstreams = max(p.streams for p in progs)
    streams = [cupy.cuda.Stream(non_blocking=True) for _ in range(nstreams)]
    events = {id(s): cupy.cuda.Event(block=False, disable_timing=True) for s in streams}
    # Warm up outside any capture: the fill kernel is compiled and loaded, every event recorded
    # once, pyalloc's allocator made; then the memory is given back.
    for s in streams:
        x = CupyRunner(cupy, streams, events, allocator, record_stream).alloc(4096, s)
        with s:
            x.fill(1)
        events[id(s)].record(s)
        streams[0].wait_event(events[id(s)])
        if s is not streams[0]:
            record_stream(x, streams[0])
        del x
    cupy.cuda.Device().synchronize()
    allocator.empty_cache()

    def once(prog, name, track):
        flags, marks = CUPY_SETTINGS[name]
        set_settings(settings_string(flags))
        runner = CupyRunner(cupy, streams[:prog.streams], events, allocator, record_stream)
        gc.collect()
        expanded0 = allocator._capture_stats()["nodes_expanded"]
        allocator.reset_peak_memory_stats()
        base_allocated = allocator.memory_allocated()
        peak = [0]
        pool = []
        info = allocator._pool_info

        def after_op(i):
            r = info(pool[0])["reserved_bytes"]
            if r > peak[0]:
                peak[0] = r
        with graph(streams[0]) as g:
            pool.append(g.pool())
            t0 = time.perf_counter()
            digest = cp.execute(prog, runner, marks=marks, after_op=after_op if track else None,
                                record=track)
            seconds = time.perf_counter() - t0
        final = allocator._pool_info(g.pool())["reserved_bytes"]
        out = dict(seconds=seconds, final_reserved=final,
                   peak_allocated=allocator.max_memory_allocated() - base_allocated,
                   nodes_expanded=allocator._capture_stats()["nodes_expanded"] - expanded0)
        if track:
            out.update(peak_reserved=peak[0], digest=digest)
        g.reset()
        allocator.empty_cache()
        allocator._check_invariants()
        return out

    out = {}
    names = list(CUPY_SETTINGS)
    for prog in progs:
        row = out[prog.key] = {}
        for name in names:
            try:
                row[name] = once(prog, name, track=True)
                row[name]["times"] = []
            except Exception as exc:   # noqa: BLE001
                print(f"cupy {prog.name} {name}: failed: {one_line(exc)}")
                row[name] = dict(error=one_line(exc))
        for k in range(runs):
            if time.monotonic() > deadline:
                print(f"cupy {prog.name}: deadline reached after {k} timed runs")
                break
            shift = k % len(names)
            for name in names[shift:] + names[:shift]:
                if "error" in row[name]:
                    continue
                try:
                    r = once(prog, name, track=False)
                    row[name]["times"].append(r["seconds"])
                    if r["final_reserved"] != row[name]["peak_reserved"]:
                        row[name]["unstable"] = r["final_reserved"]
                except Exception as exc:   # noqa: BLE001
                    print(f"cupy {prog.name} {name}: timed run failed: {one_line(exc)}")
                    row[name]["error"] = one_line(exc)
        for name in names:
            t = row[name].get("times") or ([row[name]["seconds"]] if "seconds" in row[name] else [])
            if t:
                row[name]["capture_s"] = statistics.median(t)
    set_settings(settings_string((False, False, False)))
    return out, device


# ------------------------------------------------------------------------------ torch

def graph_size(torch, raw):
    """(V, E) of a cudaGraph_t handle (int), through cuda.bindings' driver API."""
    if hasattr(torch, "_sim_graph_size"):
        return torch._sim_graph_size(raw)
    from cuda.bindings import driver
    h = driver.CUgraph(raw)
    res = driver.cuGraphGetNodes(h, 0)
    if res[0] != driver.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"cuGraphGetNodes: {res[0]}")
    res2 = driver.cuGraphGetEdges(h, 0)
    if res2[0] != driver.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"cuGraphGetEdges: {res2[0]}")
    return int(res[-1]), int(res2[-1])


def torch_worker(setting, progs, runs, dry_run):
    """In the subprocess: every program once tracked and `runs` times timed under the setting in
    PYTORCH_CUDA_ALLOC_CONF. Returns a JSON-able dict."""
    if dry_run:
        import _fake_gpu
        torch = _fake_gpu.fake_torch()
    else:
        import torch
    info = dict(setting=setting, conf=os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
                torch=torch.__version__, device=torch.cuda.get_device_name())
    nstreams = max(p.streams for p in progs)
    streams = [torch.cuda.Stream() for _ in range(nstreams)]
    events = {id(s): torch.cuda.Event() for s in streams}
    # Warm up on the side streams (as torch.cuda.graph's docs ask): kernels loaded, events created.
    for s in streams:
        x = TorchRunner(torch, streams, events).alloc(4096, s)
        with torch.cuda.stream(s):
            x.fill_(1)
        events[id(s)].record(s)
        streams[0].wait_event(events[id(s)])
        if s is not streams[0]:
            x.record_stream(streams[0])
        del x
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    try:
        info["allocator_settings"] = str(torch.cuda.memory._snapshot().get("allocator_settings"))
    except Exception as exc:   # noqa: BLE001
        info["allocator_settings"] = f"? ({one_line(exc)})"

    def once(prog, track):
        runner = TorchRunner(torch, streams[:prog.streams], events)
        g = None
        if track:
            try:
                g = torch.cuda.CUDAGraph(keep_graph=True)
            except TypeError:
                g = None
        if g is None:
            g = torch.cuda.CUDAGraph()
        torch.cuda.synchronize()
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        reserved = torch.cuda.memory_reserved
        peak = [0]
        base = []

        def after_op(i):
            r = reserved() - base[0]
            if r > peak[0]:
                peak[0] = r
        with torch.cuda.graph(g, stream=streams[0]):
            base.append(reserved())
            base_allocated = torch.cuda.memory_allocated()
            t0 = time.perf_counter()
            digest = cp.execute(prog, runner, after_op=after_op if track else None, record=track)
            seconds = time.perf_counter() - t0
            final = reserved() - base[0]
        out = dict(seconds=seconds, final_reserved=final,
                   peak_allocated=torch.cuda.max_memory_allocated() - base_allocated)
        if track:
            out.update(peak_reserved=peak[0], digest=digest,
                       max_reserved=torch.cuda.max_memory_reserved() - base[0])
            try:
                pool = tuple(g.pool())
                out["snapshot_pool_bytes"] = sum(
                    seg["total_size"] for seg in torch.cuda.memory._snapshot()["segments"]
                    if tuple(seg.get("segment_pool_id", ())) == pool)
            except Exception as exc:   # noqa: BLE001
                out["snapshot_error"] = one_line(exc)
            try:
                out["V"], out["E"] = graph_size(torch, g.raw_cuda_graph())
            except Exception as exc:   # noqa: BLE001
                out["graph_size_error"] = one_line(exc)
        g.reset()
        del g
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        return out

    rows = {}
    for prog in progs:
        try:
            row = once(prog, track=True)
            row["times"] = [once(prog, track=False)["seconds"] for _ in range(runs)]
            rows[prog.key] = row
        except Exception as exc:   # noqa: BLE001
            rows[prog.key] = dict(error=one_line(exc))
    info["rows"] = rows
    return info


def run_torch_part(args, progs, deadline):
    """Workers off, on, on, off, ...; merged per setting. Returns (rows, info lines)."""
    order = []
    for r in range(args.torch_rounds):
        order += ["off", "on"] if r % 2 == 0 else ["on", "off"]
    merged = {name: {} for name in TORCH_SETTINGS}
    infos = []
    for name in order:
        left = deadline - time.monotonic()
        if left < 20:
            print(f"torch {name}: skipped, deadline reached")
            continue
        env = dict(os.environ)
        env.pop("PYTORCH_ALLOC_CONF", None)
        env["PYTORCH_CUDA_ALLOC_CONF"] = TORCH_SETTINGS[name]
        cmd = [sys.executable, os.path.abspath(__file__), "--torch-worker", name,
               "--runs", str(args.torch_runs), "--seed", str(args.seed)]
        cmd += ["--quick"] * args.quick + ["--dry-run"] * args.dry_run
        try:
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=left)
        except subprocess.TimeoutExpired:
            print(f"torch {name}: worker timed out after {left:.0f} s")
            continue
        lines = [l for l in proc.stdout.splitlines() if l.startswith(RESULT_PREFIX)]
        if proc.returncode != 0 or not lines:
            text = (proc.stderr.strip() or proc.stdout.strip() or "?").splitlines()
            errors = [l for l in text if re.match(r"^[\w.]*(Error|Exception|Interrupt)\b", l)]
            tail = (errors or text)[-1]
            print(f"torch {name}: worker failed (status {proc.returncode}): {tail[:200]}")
            continue
        info = json.loads(lines[-1][len(RESULT_PREFIX):])
        infos.append({k: v for k, v in info.items() if k != "rows"})
        for key, row in info["rows"].items():
            m = merged[name].setdefault(key, {"times": [], "workers": 0})
            if "error" in row:
                print(f"torch {name} {key}: failed: {row['error']}")
                m.setdefault("error", row["error"])
                continue
            m["workers"] += 1
            m["times"] += row["times"]
            if "peak_reserved" in m and m["peak_reserved"] != row["peak_reserved"]:
                m["unstable"] = row["peak_reserved"]
            for k, v in row.items():
                if k != "times":
                    m.setdefault(k, v)
    for rows in merged.values():
        for m in rows.values():
            if m["times"]:
                m["capture_s"] = statistics.median(m["times"])
    return merged, infos


# ------------------------------------------------------------------------------ report

def cell_mib(row, name, key="peak_reserved"):
    r = (row or {}).get(name) or {}
    if "error" in r and key not in r:
        return "err"
    return f"{r[key] / MiB:.0f}" if key in r else "-"


def cell_ms(row, name):
    r = (row or {}).get(name) or {}
    return f"{1e3 * r['capture_s']:.1f}" if "capture_s" in r else ("err" if "error" in r else "-")


def cell_ratio(row):
    try:
        return f"{row['on']['capture_s'] / row['off']['capture_s']:.2f}"
    except (KeyError, TypeError, ZeroDivisionError):
        return "-"


def print_report(progs, res, infos):
    sim, cupy, torch = res.get("sim") or {}, res.get("cupy") or {}, res.get("torch") or {}
    w = max(len(p.name) for p in progs)
    print("Graph-pool peak reserved MiB, reuse off / on (same programs; digest ok = every runner "
          "executed the program's ops)")
    print(f"{'config':<{w}} {'digest':<16} {'sim':>11} {'cupy+pyalloc':>13} {'torch':>11} "
          f"{'ok':>3}")
    for p in progs:
        s, c = sim.get(p.key), cupy.get(p.key)
        t = {n: torch.get(n, {}).get(p.key) for n in TORCH_SETTINGS}
        digests = [r.get("digest") for row in (s, c, t) if row for r in row.values() if r]
        ok = "yes" if digests and all(d == p.digest for d in digests if d) else "NO"
        print(f"{p.name:<{w}} {p.digest} {cell_mib(s, 'off'):>5} {cell_mib(s, 'on'):>5} "
              f"{cell_mib(c, 'off'):>6} {cell_mib(c, 'on'):>6} {cell_mib(t, 'off'):>5} "
              f"{cell_mib(t, 'on'):>5} {ok:>3}")
    print()
    print("Capture loop ms, reuse off / on (ratio on/off); V/E: nodes/edges of the graph (sim; torch)")
    print(f"{'config':<{w}} {'cupy+pyalloc':>20} {'torch':>20} {'V/E sim':>11} {'V/E torch':>11}")
    for p in progs:
        c = cupy.get(p.key)
        t = {n: torch.get(n, {}).get(p.key) for n in TORCH_SETTINGS}
        s = (sim.get(p.key) or {}).get("off") or {}
        tv = (t.get("off") or {})
        ve_sim = f"{s['V']}/{s['E']}" if "V" in s else "-"
        ve_t = f"{tv['V']}/{tv['E']}" if "V" in tv else "-"
        print(f"{p.name:<{w}} {cell_ms(c, 'off'):>6} {cell_ms(c, 'on'):>6} ({cell_ratio(c):>5}) "
              f"{cell_ms(t, 'off'):>6} {cell_ms(t, 'on'):>6} ({cell_ratio(t):>5}) "
              f"{ve_sim:>11} {ve_t:>11}")
    print()
    opts = [n for n in CUPY_SETTINGS if n not in ("off", "on")]
    print("pyalloc's own options, peak reserved MiB: sim / cupy+pyalloc")
    print(f"{'config':<{w}} " + " ".join(f"{n:>13}" for n in opts))
    for p in progs:
        s, c = sim.get(p.key), cupy.get(p.key)
        print(f"{p.name:<{w}} " + " ".join(f"{cell_mib(s, n):>6} {cell_mib(c, n):>6}" for n in opts))
    problems = []
    for p in progs:
        s, c = sim.get(p.key) or {}, cupy.get(p.key) or {}
        for n in CUPY_SETTINGS:
            if n in s and n in c and "peak_reserved" in s[n] and "peak_reserved" in c[n] \
                    and s[n]["peak_reserved"] != c[n]["peak_reserved"]:
                problems.append(f"{p.name} {n}: cupy+pyalloc {c[n]['peak_reserved']} != sim "
                                f"{s[n]['peak_reserved']} bytes")
            if "unstable" in (c.get(n) or {}):
                problems.append(f"{p.name} {n}: cupy+pyalloc reserved differs between runs")
        for n in TORCH_SETTINGS:
            r = torch.get(n, {}).get(p.key) or {}
            if "unstable" in r:
                problems.append(f"{p.name} torch {n}: reserved differs between workers")
            if "snapshot_pool_bytes" in r and r["snapshot_pool_bytes"] != r.get("final_reserved"):
                problems.append(f"{p.name} torch {n}: pool segments {r['snapshot_pool_bytes']} != "
                                f"reserved delta {r.get('final_reserved')}")
    print()
    for line in problems:
        print("check:", line)
    if not problems:
        print("checks: cupy+pyalloc equals the sim byte for byte where both ran; runs agree")
    seen = set()
    for info in infos:
        if info["setting"] in seen:
            continue
        seen.add(info["setting"])
        print(f"torch worker {info['setting']}: torch {info['torch']} on {info['device']}, "
              f"PYTORCH_CUDA_ALLOC_CONF={info['conf']}, snapshot allocator_settings "
              f"{info.get('allocator_settings')}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, default=cp.SEED)
    ap.add_argument("--runs", type=int, default=5, help="CuPy timed runs per setting (5)")
    ap.add_argument("--torch-rounds", type=int, default=2,
                    help="pairs of torch worker processes, off/on then on/off (2)")
    ap.add_argument("--torch-runs", type=int, default=3, help="timed runs per torch worker (3)")
    ap.add_argument("--parts", default="sim,cupy,torch")
    ap.add_argument("--quick", action="store_true", help="2 programs (500 steps), fewer runs")
    ap.add_argument("--dry-run", action="store_true",
                    help="CuPy and torch replaced by stand-ins over the simulated device")
    ap.add_argument("--deadline", type=float, default=450,
                    help="seconds after which remaining runs are skipped (450)")
    ap.add_argument("--json", metavar="PATH")
    ap.add_argument("--torch-worker", metavar="SETTING", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.quick:
        args.runs, args.torch_runs, args.torch_rounds = min(args.runs, 2), min(args.torch_runs, 1), 1
    progs = programs(args)
    for p in progs:
        cp.check(p)

    if args.torch_worker:
        info = torch_worker(args.torch_worker, progs, args.torch_runs, args.dry_run)
        print(RESULT_PREFIX + json.dumps(info))
        return 0

    t_start = time.monotonic()
    deadline = t_start + args.deadline
    parts = set(args.parts.split(","))
    res, infos, device = {}, [], None
    if "sim" in parts:
        try:
            res["sim"] = run_sim_part(progs)
        except Exception as exc:   # noqa: BLE001
            print(f"sim: failed: {one_line(exc)}")
    if "cupy" in parts:
        try:
            res["cupy"], device = run_cupy_part(progs, args.runs, args.dry_run, deadline)
        except Exception as exc:   # noqa: BLE001
            print(f"cupy: failed: {one_line(exc)}")
        try:                      # give the GPU memory back before the torch workers start
            import pyalloc
            pyalloc.empty_cache()
        except Exception:   # noqa: BLE001
            pass
    if "torch" in parts:
        try:
            res["torch"], infos = run_torch_part(args, progs, deadline)
        except Exception as exc:   # noqa: BLE001
            print(f"torch: failed: {one_line(exc)}")
    elapsed = time.monotonic() - t_start
    print_report(progs, res, infos)
    print(f"{len(progs)} programs, seed {args.seed}; cupy: {device or '-'}; {args.runs} CuPy "
          f"timed runs per setting, torch {args.torch_rounds * 2} workers x {args.torch_runs} "
          f"runs; {elapsed:.1f} s{' (dry run: no GPU)' if args.dry_run else ''}")
    if args.json:
        doc = dict(benchmark="capture_record_stream_reuse", seed=args.seed, dry_run=args.dry_run,
                   device=device, torch_workers=infos, elapsed_s=elapsed,
                   programs={p.key: dict(name=p.name, digest=p.digest, counts=p.counts)
                             for p in progs}, results=res)
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
