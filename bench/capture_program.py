"""Random multi-stream capture programs: the workload of PyTorch PR #162186's capture benchmark
(graph_capture_record_stream_reuse), as plain data so that every runner (pyalloc on the simulated
device, CuPy + pyalloc and PyTorch on a GPU) executes exactly the same sequence.

A program is generated from (seed, streams, steps, probabilities). Streams are numbered 0..S-1;
stream 0 is the capture's origin. The ops, in order:

    ("join", dst, src)          dst waits on an event recorded on src now. The program opens with
                                one fork per side stream (dst = i, src = 0), so that every stream
                                is in the capture before it does anything, and closes with one
                                merge per side stream (dst = 0, src = i), so the capture can end.
    ("alloc", t, s, nbytes)     tensor t: nbytes (uint8) allocated on stream s, then a kernel on s
                                that writes it.
    ("free", t, s)              a kernel on s that uses t; when s is not t's allocation stream,
                                record_stream(t, s); then t is freed (its last reference dropped).
    ("release", t)              at the very end, after the merges: t freed, no kernel.

Each step picks a stream uniformly and then alloc / free / join with the step probabilities; a
free with no live tensor and a join with a single stream emit nothing (the step is counted in
`idle_steps`). A free picks a live tensor uniformly; a join's source is another stream, uniform.

Sizes are log-uniform in [4 KiB, 64 MiB], rounded to 512 bytes (PyTorch's and pyalloc's rounding
unit), so both pools serve them: about 57% are small-pool requests (<= 1 MiB), about 19% are over
10 MiB (a segment of their own).

Last uses (option (b), graph_capture_last_use_marks): `last_use[(t, s)]` is the index of the op
whose kernel is t's last use on stream s (an "alloc" or "free" op); `marks_after[i]` lists the
(t, s) pairs whose last use is op i. A runner issuing marks calls
record_stream(t, s, last_use=True) right after op i's kernel (for a "free" op: before the free).

    prog = generate(seed=0, streams=2, steps=500, probs=(0.5, 0.4, 0.1))
    prog.ops, prog.counts, prog.digest, prog.marks_after

Run as a script to print the grid's programs and their digests.
"""
import hashlib
import math
import random
from dataclasses import dataclass, field

KiB = 1 << 10
MiB = 1 << 20

MIN_SIZE = 4 * KiB
MAX_SIZE = 64 * MiB
ROUND = 512

STREAMS = (2, 4)
STEPS = (500, 2000)
PROBS = ((0.5, 0.4, 0.1), (0.4, 0.4, 0.2), (0.34, 0.33, 0.33))   # (alloc, free, join)
SEED = 162186


@dataclass(frozen=True)
class Program:
    seed: int
    streams: int
    steps: int
    probs: tuple
    ops: tuple                      # the op tuples, in order
    last_use: dict = field(repr=False)     # (tensor, stream) -> op index of its last kernel there
    marks_after: dict = field(repr=False)  # op index -> ((tensor, stream), ...)
    counts: dict = field(repr=False)       # allocs, frees, joins, forks, merges, releases, ...
    digest: str = ""                # sha256 of the op list (first 16 hex digits)

    @property
    def name(self):
        a, f, j = self.probs
        return f"S{self.streams} N{self.steps} p{a:g}/{f:g}/{j:g}"

    @property
    def key(self):
        """A short machine key: s2-n500-p0.5-0.4-0.1."""
        return f"s{self.streams}-n{self.steps}-p" + "-".join(f"{p:g}" for p in self.probs)


def op_digest(ops):
    """sha256 of the op list's canonical text: equal digests, equal programs."""
    return hashlib.sha256(repr(tuple(ops)).encode()).hexdigest()[:16]


def random_size(rng):
    """Log-uniform in [MIN_SIZE, MAX_SIZE], rounded to ROUND bytes (at least ROUND)."""
    x = math.exp(rng.uniform(math.log(MIN_SIZE), math.log(MAX_SIZE)))
    return max(ROUND, int(round(x / ROUND)) * ROUND)


def generate(seed=SEED, streams=2, steps=500, probs=(0.5, 0.4, 0.1)):
    """The random program for these parameters (deterministic: same arguments, same program)."""
    if streams < 1:
        raise ValueError(f"streams must be >= 1, got {streams}")
    p_alloc, p_free, p_join = probs
    if min(probs) < 0 or not math.isclose(p_alloc + p_free + p_join, 1.0, abs_tol=1e-9):
        raise ValueError(f"probabilities (alloc, free, join) must be >= 0 and sum to 1, got {probs}")
    # A string seed is hashed (sha512) by random.seed: stable across runs and platforms.
    rng = random.Random(f"capture-program/{seed}/{streams}/{steps}/{p_alloc!r}/{p_free!r}/{p_join!r}")
    ops = []
    home = {}            # tensor -> allocation stream
    live = []            # live tensors, in allocation order (a free picks by index)
    last_use = {}
    counts = dict(steps=steps, allocs=0, frees=0, joins=0, forks=0, merges=0, releases=0,
                  cross_stream_frees=0, idle_steps=0, small_allocs=0, large_allocs=0,
                  alloc_bytes=0)
    for s in range(1, streams):
        ops.append(("join", s, 0))
        counts["forks"] += 1
    next_tensor = 0
    for _ in range(steps):
        s = rng.randrange(streams)
        r = rng.random()
        if r < p_alloc:
            t, next_tensor = next_tensor, next_tensor + 1
            nbytes = random_size(rng)
            last_use[(t, s)] = len(ops)
            ops.append(("alloc", t, s, nbytes))
            home[t] = s
            live.append(t)
            counts["allocs"] += 1
            counts["alloc_bytes"] += nbytes
            counts["small_allocs" if nbytes <= MiB else "large_allocs"] += 1
        elif r < p_alloc + p_free:
            if not live:
                counts["idle_steps"] += 1
                continue
            t = live.pop(rng.randrange(len(live)))
            last_use[(t, s)] = len(ops)
            ops.append(("free", t, s))
            counts["frees"] += 1
            counts["cross_stream_frees"] += s != home[t]
        else:
            if streams < 2:
                counts["idle_steps"] += 1
                continue
            src = rng.randrange(streams - 1)
            src += src >= s
            ops.append(("join", s, src))
            counts["joins"] += 1
    for s in range(1, streams):
        ops.append(("join", 0, s))
        counts["merges"] += 1
    for t in live:
        ops.append(("release", t))
        counts["releases"] += 1
    marks = {}
    for (t, s), i in sorted(last_use.items(), key=lambda kv: (kv[1], kv[0])):
        marks.setdefault(i, []).append((t, s))
    ops = tuple(ops)
    return Program(seed=seed, streams=streams, steps=steps, probs=tuple(probs), ops=ops,
                   last_use=last_use, marks_after={i: tuple(v) for i, v in marks.items()},
                   counts=counts, digest=op_digest(ops))


class Runner:
    """What execute() drives: one framework's streams, tensors and kernels. Streams are the
    runner's own objects, indexed by the program's stream numbers (runner.streams[i]).

    alloc(nbytes, s) -> tensor      allocate on stream s (and nothing else)
    kernel(tensor, s)               one kernel on s that writes / uses the tensor
    record_stream(tensor, s)        the allocator's record_stream
    mark(tensor, s)                 record_stream(tensor, s, last_use=True)
    free(tensor)                    free it; for refcounted tensors (CuPy, torch) do nothing:
                                    execute() drops its own reference, the caller's is the last
    join(dst, src)                  dst waits on an event recorded on src now
    nbytes(tensor)                  the tensor's size in bytes (for the executed-op digest)
    """
    streams = ()


def execute(prog, runner, marks=False, after_op=None, record=False):
    """Run prog's ops on `runner` (a Runner; call it inside the capture). marks: issue the
    last-use marks of prog.marks_after. after_op(i): called after every op (memory tracking).
    record: return the digest of the ops as executed, with stream indexes and tensor sizes read
    back from the runner (equal to prog.digest when the runner did exactly the program);
    else return None."""
    streams = runner.streams
    alloc, kernel, record_stream, free, join = (runner.alloc, runner.kernel, runner.record_stream,
                                                runner.free, runner.join)
    mark = runner.mark
    marks_after = prog.marks_after if marks else {}
    home = {}
    tensors = {}
    done = [] if record else None
    for i, op in enumerate(prog.ops):
        kind = op[0]
        if kind == "alloc":
            _, t, s, nbytes = op
            stream = streams[s]
            tensors[t] = alloc(nbytes, stream)
            home[t] = s
            kernel(tensors[t], stream)
            for mt, ms in marks_after.get(i, ()):
                mark(tensors[mt], streams[ms])
            if record:
                done.append(("alloc", t, streams.index(stream), runner.nbytes(tensors[t])))
        elif kind == "free":
            _, t, s = op
            stream = streams[s]
            kernel(tensors[t], stream)
            if s != home[t]:
                record_stream(tensors[t], stream)
            for mt, ms in marks_after.get(i, ()):
                mark(tensors[mt], streams[ms])
            free(tensors.pop(t))
            if record:
                done.append(("free", t, streams.index(stream)))
        elif kind == "join":
            join(streams[op[1]], streams[op[2]])
            if record:
                done.append(op)
        else:
            free(tensors.pop(op[1]))
            if record:
                done.append(op)
        if after_op is not None:
            after_op(i)
    if tensors:
        raise AssertionError(f"tensors left live after the program: {sorted(tensors)[:10]}")
    return op_digest(done) if record else None


def grid(seed=SEED, streams=STREAMS, steps=STEPS, probs=PROBS):
    """The benchmark's programs: every (streams, steps, probs) combination, in that order."""
    return [generate(seed, s, n, p) for s in streams for n in steps for p in probs]


def check(prog):
    """Assert the program is well formed (every tensor allocated once, freed once, used only
    while live; last uses and marks consistent); returns prog."""
    state = {}
    for i, op in enumerate(prog.ops):
        kind = op[0]
        if kind == "alloc":
            _, t, s, nbytes = op
            assert t not in state and 0 <= s < prog.streams and nbytes % ROUND == 0 and nbytes > 0
            state[t] = "live"
        elif kind == "free" or kind == "release":
            assert state.get(op[1]) == "live", (i, op)
            state[op[1]] = "freed"
        else:
            assert kind == "join" and op[1] != op[2], (i, op)
    assert all(v == "freed" for v in state.values())
    for (t, s), i in prog.last_use.items():
        op = prog.ops[i]
        assert op[0] in ("alloc", "free") and op[1] == t and op[2] == s
        assert (t, s) in prog.marks_after[i]
    assert sum(map(len, prog.marks_after.values())) == len(prog.last_use)
    assert op_digest(prog.ops) == prog.digest
    return prog


if __name__ == "__main__":
    import argparse
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, default=SEED)
    ap.add_argument("--show", type=int, default=0, metavar="N", help="print the first N ops of each")
    args = ap.parse_args()
    for prog in grid(args.seed):
        check(prog)
        c = prog.counts
        print(f"{prog.name:<24} {prog.digest}  ops {len(prog.ops):5}  alloc {c['allocs']:4} "
              f"free {c['frees']:4} (cross {c['cross_stream_frees']:4})  join {c['joins']:4}  "
              f"release {c['releases']:4}  alloc GiB {c['alloc_bytes'] / (1 << 30):6.2f}")
        for op in prog.ops[:args.show]:
            print("   ", op)
