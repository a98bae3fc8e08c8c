# cython: language_level=3
"""SimDevice's stream capture (CUDA graphs), as an allocator sees it.

It owns the captures (begun and not ended: their streams' terminals, their nodes, their status),
the events recorded in a capture and the nodes they stand for, the nodes and graphs that ended
captures leave, graph launch (the graph's work queued on a stream, or one child-graph node in a
capturing stream), the capture-mode rules for "potentially unsafe" calls (per thread,
cudaStreamCaptureMode's), and the reuse sanitizer's check of captured kernel nodes. The rules
are those of the CUDA 13 driver, listed in SimDevice's module doc (_sim.pyx); work counts are
work items of the streams in _sim_streams, which this module queues work and waits on.

None of this is on a path that runs while no capture is underway: SimDevice tests `live`
(captures begun and not ended) or EventState.captured before it calls in here.
"""
from libc.stdint cimport uintptr_t, uint64_t
from libcpp.unordered_map cimport unordered_map
from libcpp.vector cimport vector
from cython.operator cimport dereference as deref
from cpython.pythread cimport PyThread_get_thread_ident
cimport cython

from pyalloc._backend cimport BACKEND_OK, CAPTURE_GLOBAL, CAPTURE_RELAXED
from pyalloc._sim_streams cimport Streams, EventState, uses_of, spans, op_text
from pyalloc.errors import CudaError, ReuseError

MODE_NAMES = ("global", "thread_local", "relaxed")      # by CAPTURE_* value

# CUresult value, driver name and runtime name of the errors a capture can raise.
ERRORS = {
    "invalid_value": (1, "CUDA_ERROR_INVALID_VALUE", "cudaErrorInvalidValue"),
    "illegal_state": (401, "CUDA_ERROR_ILLEGAL_STATE", "cudaErrorIllegalState"),
    "unsupported": (900, "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED", "cudaErrorStreamCaptureUnsupported"),
    "invalidated": (901, "CUDA_ERROR_STREAM_CAPTURE_INVALIDATED", "cudaErrorStreamCaptureInvalidated"),
    "merge": (902, "CUDA_ERROR_STREAM_CAPTURE_MERGE", "cudaErrorStreamCaptureMerge"),
    "unmatched": (903, "CUDA_ERROR_STREAM_CAPTURE_UNMATCHED", "cudaErrorStreamCaptureUnmatched"),
    "unjoined": (904, "CUDA_ERROR_STREAM_CAPTURE_UNJOINED", "cudaErrorStreamCaptureUnjoined"),
    "isolation": (905, "CUDA_ERROR_STREAM_CAPTURE_ISOLATION", "cudaErrorStreamCaptureIsolation"),
    "captured_event": (907, "CUDA_ERROR_CAPTURED_EVENT", "cudaErrorCapturedEvent"),
    "wrong_thread": (908, "CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD", "cudaErrorStreamCaptureWrongThread"),
}


cdef object _capture_error(str call, str error, str detail):
    result, name, runtime_name = ERRORS[error]
    return CudaError(call, result, name, f"SimDevice: {detail} ({runtime_name})")


cdef inline unsigned long _me() noexcept:
    return <unsigned long>PyThread_get_thread_ident()


class _Capture:
    """One capture sequence: its streams' terminals (origin first, then in joining order) and its
    nodes in the order they were added."""
    __slots__ = ("id", "origin", "mode", "thread", "status", "reason", "terminals", "nodes", "ended")

    def __init__(self, capture_id, origin, mode, thread):
        self.id = capture_id
        self.origin = origin
        self.mode = mode
        self.thread = thread
        self.status = "active"          # or "invalidated"
        self.reason = ""                # what invalidated it
        self.terminals = {origin: []}   # stream -> list of nodes
        self.nodes = []
        self.ended = False


class _Node:
    """A node of a capture or graph: "kernel" (launch), "wait" (external event wait) or "graph"
    (a graph launched into a capturing stream)."""
    __slots__ = ("parents", "uses", "count", "kind", "events", "op")

    def __init__(self, parents, uses, count, kind, events=(), op=None):
        self.parents = parents          # tuple of node handles
        self.uses = uses                # tuple of uses: an address (1 byte) or (address, nbytes)
        self.count = count              # units of work when the graph is launched
        self.kind = kind
        self.events = events            # external events awaited ("wait", and "graph" holding waits)
        self.op = op                    # with check_reuse: the operation that added it (op_text)


class _Graph:
    __slots__ = ("capture_id", "nodes", "work")

    def __init__(self, capture_id, nodes):
        self.capture_id = capture_id
        self.nodes = nodes              # node handles, in capture order
        self.work = 0                   # units of work a launch queues (its nodes' counts)


# no_gc_clear: SimDevice's tables must outlive a collection that takes its allocator (see the note
# above SimDevice); this object is one of them.
@cython.no_gc_clear
@cython.final
cdef class Captures:
    """The captures, nodes and graphs of one SimDevice, over its Streams."""

    def __init__(self, Streams streams):
        self.streams = streams
        self.live = 0
        self.capture_of = {}
        self.live_captures = {}
        self.event_capture = {}
        self.nodes = {}
        self.graphs = {}
        self.thread_modes = {}
        self.next_capture = 1
        self.next_node = 1
        self.next_graph = 1

    cdef bint in_capture(self, uintptr_t stream) except -1:
        """Whether `stream` is in a live capture (active or invalidated)."""
        return self.live != 0 and stream in self.capture_of

    # ---------------------------------------------------------------- begin and end

    cdef int begin(self, uintptr_t stream, int mode) except -1:
        if mode < CAPTURE_GLOBAL or mode > CAPTURE_RELAXED:
            raise ValueError(f"SimDevice: capture mode must be CAPTURE_GLOBAL (0), CAPTURE_THREAD_LOCAL "
                             f"(1) or CAPTURE_RELAXED (2), got {mode}")
        if stream == 0:
            raise _capture_error("cuStreamBeginCapture", "unsupported",
                                 "stream 0 (the legacy default stream) cannot be captured; "
                                 "capture a stream from create_stream()")
        cap = self.capture_of.get(stream)
        if cap is not None:
            raise _capture_error("cuStreamBeginCapture", "illegal_state",
                                 f"stream {stream} is already in capture {cap.id} (begun on stream "
                                 f"{cap.origin}, {cap.status}); capture {cap.id} carries on")
        cap = _Capture(self.next_capture, stream, mode, _me())
        self.next_capture += 1
        self.capture_of[stream] = cap
        self.live_captures[cap.id] = cap
        self.live += 1
        return BACKEND_OK

    cdef int _finish(self, cap, bint keep_nodes) except -1:
        """Take every stream of `cap` out of capture; its nodes go to a graph or away."""
        for st in cap.terminals:
            del self.capture_of[st]
        del self.live_captures[cap.id]
        self.live -= 1
        cap.ended = True
        if not keep_nodes:
            for n in cap.nodes:
                del self.nodes[n]
        return 0

    cdef int _invalidate(self, cap, str reason) except -1:
        if cap.status == "active":
            cap.status = "invalidated"
            cap.reason = reason
        return 0

    cdef int _check_active(self, cap, str call, uintptr_t stream) except -1:
        if cap.status != "active":
            raise _capture_error(call, "invalidated",
                                 f"stream {stream} is in capture {cap.id}, which was invalidated "
                                 f"({cap.reason}); end_capture on stream {cap.origin} ends it")
        return 0

    cdef int end(self, uintptr_t stream, uintptr_t* graph) except -1:
        """cuStreamEndCapture on `stream`: *graph the new graph, or an error (see the rules)."""
        cap = self.capture_of.get(stream) if self.live else None
        if cap is None:
            raise _capture_error("cuStreamEndCapture", "illegal_state",
                                 f"stream {stream} is not capturing: no capture to end")
        if stream != cap.origin:
            self._invalidate(cap, f"end_capture on stream {stream}, which joined it")
            raise _capture_error("cuStreamEndCapture", "unmatched",
                                 f"stream {stream} joined capture {cap.id}, which began on stream "
                                 f"{cap.origin}: end it there; capture {cap.id} is invalidated")
        if cap.mode != CAPTURE_RELAXED and _me() != cap.thread:
            self._finish(cap, False)
            raise _capture_error("cuStreamEndCapture", "wrong_thread",
                                 f"capture {cap.id} on stream {stream} began in "
                                 f"{MODE_NAMES[cap.mode]} mode on another thread, which must end "
                                 f"it; the capture ended, with no graph")
        if cap.status != "active":
            self._finish(cap, False)
            raise _capture_error("cuStreamEndCapture", "invalidated",
                                 f"capture {cap.id} on stream {stream} was invalidated ({cap.reason}); "
                                 f"it ended, with no graph")
        self._check_joined(cap, stream)
        cdef uintptr_t g = self.next_graph
        self.next_graph += 1
        gr = _Graph(cap.id, cap.nodes)
        for n in cap.nodes:
            gr.work += self.nodes[n].count
        self.graphs[g] = gr
        self._finish(cap, True)
        graph[0] = g
        return BACKEND_OK

    cdef int _check_joined(self, cap, uintptr_t stream) except -1:
        """STREAM_CAPTURE_UNJOINED (ending the capture) unless every joined stream's terminals
        are the origin's terminals or their ancestors."""
        origin_terminals = cap.terminals[stream]
        reached = self.ancestor_set(origin_terminals)
        reached.update(origin_terminals)
        unjoined = []
        for st, terminals in cap.terminals.items():
            left = [n for n in terminals if n not in reached]
            if st != stream and left:
                unjoined.append(f"stream {st} (node{'s' if len(left) > 1 else ''} "
                                f"{', '.join([str(n) for n in left])})")
        if unjoined:
            self._finish(cap, False)
            raise _capture_error("cuStreamEndCapture", "unjoined",
                                 f"capture {cap.id} began on stream {stream}, and the work of "
                                 f"{'; '.join(unjoined)} was not joined back into stream {stream} "
                                 f"(record an event after it and wait on that in stream {stream}); "
                                 f"the capture ended, with no graph")
        return 0

    cdef int info(self, uintptr_t stream, unsigned long long* capture_id,
                  vector[uintptr_t]* terminals) except -1:
        """Backend.capture_info: 1 with the capture id and terminals while `stream` captures."""
        if not self.live:
            return 0
        cap = self.capture_of.get(stream)
        if cap is None or cap.status != "active":
            return 0
        capture_id[0] = cap.id
        terminals.clear()
        for n in cap.terminals[stream]:
            terminals.push_back(n)
        return 1

    # ---------------------------------------------------------------- nodes

    cdef object node(self, node):
        nd = self.nodes.get(node)
        if nd is None:
            raise ValueError(f"SimDevice: unknown graph node {node} (its capture failed, or its graph "
                             "was destroyed)")
        return nd

    cdef object graph(self, uintptr_t graph):
        gr = self.graphs.get(graph)
        if gr is None:
            raise ValueError(f"SimDevice: unknown graph handle {graph}")
        return gr

    cdef int dependencies(self, uintptr_t node, vector[uintptr_t]* parents) except -1:
        nd = self.node(node)
        parents.clear()
        for p in nd.parents:
            parents.push_back(p)
        return BACKEND_OK

    cdef object _add_node(self, cap, uintptr_t stream, tuple uses, uint64_t count, str kind,
                          tuple events):
        cdef uintptr_t node = self.next_node
        self.next_node += 1
        self.nodes[node] = _Node(tuple(cap.terminals[stream]), uses, count, kind, events)
        cap.terminals[stream] = [node]
        cap.nodes.append(node)
        return node

    cdef set ancestor_set(self, nodes):
        """Every node that a node of `nodes` depends on, directly or not."""
        seen = set()
        stack = []
        for n in nodes:
            stack.extend(self.node(n).parents)
        while stack:
            n = stack.pop()
            if n not in seen:
                seen.add(n)
                stack.extend(self.node(n).parents)
        return seen

    # ---------------------------------------------------------------- work and events in capture

    cdef object launch(self, uintptr_t stream, uint64_t count, object uses):
        """A launch on capturing `stream`: one kernel node after its terminals; returns it."""
        cap = self.capture_of[stream]
        self._check_active(cap, "cuLaunchKernel", stream)
        node = self._add_node(cap, stream, uses_of(uses), count, "kernel", ())
        if self.streams.checks_reuse:
            self.streams.launches += 1
            self.nodes[node].op = ("launch", self.streams.launches, stream)
        return node

    cdef int record(self, uintptr_t event, EventState* e, uintptr_t stream) except -1:
        """Record `event` in capturing `stream`: it holds the stream's terminals."""
        cap = self.capture_of[stream]
        self._check_active(cap, "cuEventRecord", stream)
        e.captured = True
        self.event_capture[event] = (cap, tuple(cap.terminals[stream]))
        return BACKEND_OK

    cdef int forget_event(self, uintptr_t event, EventState* e) except -1:
        """`event` (a capture event) is re-recorded outside capture or destroyed."""
        e.captured = False
        del self.event_capture[event]
        return 0

    cdef int wait(self, uintptr_t stream, uintptr_t event, EventState* e, bint external) except -1:
        """cudaStreamWaitEvent where `event` is a capture event or `stream` captures."""
        cap = self.capture_of.get(stream) if self.live else None
        if e.captured:
            return self._join(stream, event, cap)
        self._check_active(cap, "cuStreamWaitEvent", stream)
        if external:
            self._add_node(cap, stream, (), 0, "wait", (event,))
        elif e.recorded:
            reason = f"stream {stream} waited on event {event}, which was not recorded in the capture"
            self._invalidate(cap, reason)
            raise _capture_error("cuStreamWaitEvent", "isolation",
                                 f"{reason} (pass external=True for cudaEventWaitExternal); capture "
                                 f"{cap.id} is invalidated")
        return 0

    cdef int _join(self, uintptr_t stream, uintptr_t event, cap) except -1:
        """A wait on capture event `event` by `stream` (in capture `cap`, or None): joins the
        event's capture, or adds the event's nodes to the stream's terminals."""
        ecap, nodes = self.event_capture[event]
        if ecap.ended:
            raise _capture_error("cuStreamWaitEvent", "invalid_value",
                                 f"event {event} was recorded in capture {ecap.id}, which has "
                                 f"ended; record it again before stream {stream} waits on it")
        if cap is None:
            if stream == 0:
                self._invalidate(ecap, f"stream 0 waited on event {event}")
                raise _capture_error("cuStreamWaitEvent", "unsupported",
                                     f"stream 0 (the legacy default stream) cannot join capture "
                                     f"{ecap.id} by waiting on event {event}; capture {ecap.id} "
                                     "is invalidated")
            if ecap.status != "active":
                raise _capture_error("cuStreamWaitEvent", "invalidated",
                                     f"event {event} belongs to capture {ecap.id}, which was "
                                     f"invalidated ({ecap.reason}); stream {stream} cannot join it")
            self.capture_of[stream] = ecap
            ecap.terminals[stream] = list(nodes)
            return 0
        if cap is not ecap:
            reason = (f"stream {stream} of capture {cap.id} waited on event {event} of "
                      f"capture {ecap.id}")
            self._invalidate(cap, reason)
            self._invalidate(ecap, reason)
            raise _capture_error("cuStreamWaitEvent", "merge",
                                 f"{reason}: a wait cannot merge two captures; both are invalidated")
        self._check_active(cap, "cuStreamWaitEvent", stream)
        terminals = cap.terminals[stream]
        for n in nodes:
            if n not in terminals:
                terminals.append(n)
        return 0

    # ---------------------------------------------------------------- calls refused in capture

    cdef int event_use(self, uintptr_t event, bint captured, str call, str verb) except -1:
        """Raise for a query or synchronize of `event` that CUDA refuses now; only called while
        a capture is underway or the event is a capture event."""
        if captured:
            cap, nodes = self.event_capture[event]
            if cap.ended:
                raise _capture_error(call, "invalid_value",
                                     f"event {event} was recorded in capture {cap.id}, which has "
                                     f"ended: it stands for no work; record it again before you "
                                     f"{verb} it")
            self._invalidate(cap, f"{verb} of event {event}, recorded in the capture")
            raise _capture_error(call, "captured_event",
                                 f"cannot {verb} event {event}: it was recorded in capture "
                                 f"{cap.id} (begun on stream {cap.origin}), whose work does not "
                                 f"run; capture {cap.id} is invalidated")
        self.unsafe_call(call, f"{verb} of event {event}")
        return 0

    cdef int stream_sync(self, uintptr_t stream) except -1:
        """Raise for a cuStreamSynchronize that CUDA refuses while a capture is underway."""
        cap = self.capture_of.get(stream)
        if cap is not None:
            self._invalidate(cap, f"synchronize of stream {stream}, in the capture")
            raise _capture_error("cuStreamSynchronize", "unsupported",
                                 f"cannot synchronize stream {stream}: it is in capture {cap.id} "
                                 f"(begun on stream {cap.origin}); capture {cap.id} is invalidated")
        self.unsafe_call("cuStreamSynchronize", f"synchronize of stream {stream}")
        return 0

    cdef int device_sync(self) except -1:
        """A device synchronize while a capture is underway: invalidates every one, raises."""
        caps = list(self.live_captures.values())
        for cap in caps:
            self._invalidate(cap, "device synchronize")
        raise _capture_error("cuCtxSynchronize", "unsupported",
                             "cannot synchronize the device while "
                             + ", ".join([f"capture {c.id} (stream {c.origin})" for c in caps])
                             + " is underway; invalidated")

    cdef int unsafe_call(self, str call, str what) except -1:
        """cudaStreamCaptureMode's rule for a potentially unsafe call by this thread: refused (and
        the captures that refuse it invalidated) when this thread began a capture that is not
        relaxed, or, in global mode, another thread began a global capture."""
        cdef unsigned long me = _me()
        cdef int mode = self.thread_modes.get(me, CAPTURE_GLOBAL) if self.thread_modes else CAPTURE_GLOBAL
        if mode == CAPTURE_RELAXED:
            return 0
        blocking = [c for c in self.live_captures.values()
                    if (c.thread == me and c.mode != CAPTURE_RELAXED)
                    or (mode == CAPTURE_GLOBAL and c.thread != me and c.mode == CAPTURE_GLOBAL)]
        if not blocking:
            return 0
        for c in blocking:
            self._invalidate(c, what)
        raise _capture_error(call, "unsupported",
                             f"{what} is not permitted while "
                             + ", ".join([f"capture {c.id} ({MODE_NAMES[c.mode]} mode, stream "
                                          f"{c.origin}, {'this' if c.thread == me else 'another'} "
                                          "thread)" for c in blocking])
                             + " is underway; invalidated")

    def exchange_mode(self, mode):
        """SimDevice.exchange_capture_mode: set this thread's mode, return the previous one."""
        if mode not in MODE_NAMES:
            raise ValueError(f"capture mode must be one of {', '.join(MODE_NAMES)}, got {mode!r}")
        cdef unsigned long me = _me()
        previous = self.thread_modes.get(me, CAPTURE_GLOBAL)
        if mode == "global":
            self.thread_modes.pop(me, None)
        else:
            self.thread_modes[me] = MODE_NAMES.index(mode)
        return MODE_NAMES[previous]

    # ---------------------------------------------------------------- graphs

    cdef int graph_launch(self, uintptr_t graph, uintptr_t stream) except -1:
        """Queue `graph` on `stream`: its kernel nodes' work after its external waits; into a
        capturing stream, one child-graph node."""
        gr = self.graph(graph)
        events = []
        uses = {}
        for n in gr.nodes:
            nd = self.nodes[n]
            events.extend(nd.events)
            for u in nd.uses:
                uses[u] = None
        if self.in_capture(stream):
            cap = self.capture_of[stream]
            self._check_active(cap, "cuGraphLaunch", stream)
            node = self._add_node(cap, stream, tuple(uses), gr.work, "graph", tuple(events))
            if self.streams.checks_reuse:
                self.nodes[node].op = ("graph", graph, stream)
            return BACKEND_OK
        cdef Streams sts = self.streams
        cdef unordered_map[uintptr_t, EventState].iterator it
        for ev in events:
            it = sts.events.find(ev)
            if it != sts.events.end() and not deref(it).second.captured:
                sts.push_wait(stream, &deref(it).second)
        sts.state(stream).launched += gr.work
        if sts.checks_reuse and uses:
            # Every node's uses are pending until the graph's work is done: only an event
            # recorded after the launch orders anything after them.
            sts.queue_uses(stream, sts.state(stream).launched, tuple(uses),
                           ("graph", graph, stream))
        return BACKEND_OK

    cdef int graph_destroy(self, uintptr_t graph) except -1:
        gr = self.graph(graph)
        for n in gr.nodes:
            del self.nodes[n]
        del self.graphs[graph]
        return BACKEND_OK

    def graph_nodes(self, uintptr_t graph):
        """SimDevice.graph_nodes: [(node, [parent nodes], [uses])] in capture order."""
        return [(n, list(self.nodes[n].parents), list(self.nodes[n].uses))
                for n in self.graph(graph).nodes]

    def status(self, uintptr_t stream):
        """SimDevice.capture_status: "none", "active" or "invalidated"."""
        cap = self.capture_of.get(stream) if self.live else None
        return "none" if cap is None else cap.status

    # ---------------------------------------------------------------- the reuse sanitizer

    cdef int check_uses(self, uintptr_t ptr, size_t nbytes, uintptr_t stream) except -1:
        """The capture half of SimDevice.check_handout: ReuseError for a kernel node of an
        active capture that uses [ptr, ptr + nbytes), unless `stream` is in that capture and
        the node precedes its terminals."""
        cdef uintptr_t end = ptr + nbytes
        mine = self.capture_of.get(stream)
        reach = None
        for cap in self.live_captures.values():
            if cap.status != "active":
                continue
            for n in cap.nodes:
                nd = self.nodes[n]
                if not nd.uses:
                    continue
                for start, stop in spans(nd.uses):
                    if not (start < end and ptr < stop):
                        continue
                    if cap is mine:
                        if reach is None:
                            reach = self.ancestor_set(cap.terminals[stream])
                            reach.update(cap.terminals[stream])
                        if n in reach:
                            break
                        why = (f"it does not precede stream {stream}'s terminals "
                               f"{sorted(cap.terminals[stream])}")
                    else:
                        why = (f"stream {stream} is not in that capture" if mine is None else
                               f"stream {stream} is in capture {mine.id}, another one")
                    what = (op_text(nd.op) + f", captured as {nd.kind} node {n}" if nd.op
                            else f"{nd.kind} node {n}")
                    raise ReuseError(
                        f"SimDevice reuse check: block {ptr:#x} (+{nbytes} bytes) handed out for "
                        f"stream {stream} while {what} of capture {cap.id} (begun on stream "
                        f"{cap.origin}) uses [{start:#x}, {stop:#x}), and {why}: every launch of "
                        "the graph would use that memory",
                        ptr=ptr, nbytes=nbytes, stream=stream, use_stream=None,
                        operation=f"{what} of capture {cap.id}")
        return 0
