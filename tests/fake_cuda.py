"""A stand-in for the torch.cuda calls the decode runner makes, for machines without a GPU
(tests/test_runner_device.py; tests/test_cuda.py runs the real thing on a GPU and says what only
a GPU proves).

Tensors stay on the CPU (asked for on a CUDA device, they are made there), but every torch
operation the host runs counts as launched on a CUDA stream, and the stand-in follows
torch.cuda's semantics where a runner can get them wrong (torch/cuda/graphs.py, streams.py,
__init__.py):

- Capture runs nothing (`torch.cuda.graph` only records kernels between capture_begin and
  capture_end): the stand-in runs the captured code once to record every aten operation with the
  very tensors it used, then puts back every tensor that existed before the capture and was
  written during it, and fills what the capture allocated with garbage (NaN, -1): that memory is
  the graph's, holding nothing usable outside its replays. An operation whose result the host
  needs (`.item()`, `bool(t)`, `nonzero`) while capturing is an error, as on a GPU
  (cudaErrorStreamCaptureUnsupported); so is capturing on a default stream ("CUDA graphs must be
  captured on a non-default stream"). `torch.cuda.graph` synchronizes first, as the real one does.
- `CUDAGraph.replay` re-runs the recorded operations, in order, on the recorded tensors: no
  Python of the captured code runs. A replay reads what the captured tensors (the static
  buffers) hold now; a tensor made after the capture, e.g. a buffer rebound to a new tensor
  instead of written in place, is never seen (the stale-buffer bug of CUDA graphs). A graph
  replays, as one launch, on the current stream of the device it was captured on; replaying it
  under another current device is an error.
- Streams order work. Only `wait_stream`, an event the host has waited for (`synchronize`, or a
  `query` that said True), `torch.cuda.synchronize` and a blocking copy to the host (`.cpu()`,
  `.to("cpu")` without non_blocking, `.tolist()`, `.item()`) order work on one stream after work
  on another (vector clocks, as PyTorch's CUDA sanitizer, torch/cuda/_sanitizer.py, tracks
  them). An operation that reads or writes memory another stream wrote, or writes memory another
  stream read, with none of those in between is a data race on a GPU: the stand-in raises
  `StreamRace` naming both.
- The device runs behind the host: an event is done when the device has finished the work
  launched before it on its stream. With `behind=None` the device finishes work only when the
  host waits for it (`Event.synchronize`, `torch.cuda.synchronize`, a blocking copy to the
  host); with `behind=n` it also keeps up by itself to within n operations of the host on each
  stream (n=0: a device that is never behind). A graph replay takes one microsecond of device
  time per recorded operation (`CUDAGraph.device_ms`), an eager operation none, so
  `elapsed_time` between two timing events is the device time of the graphs replayed between
  them; it refuses events made without enable_timing, or not yet done.

The stand-in sees the operations of the thread that installed it only (torch's dispatch modes
are per thread), and `tensors_on` is a label: every tensor counts as being on that one device.
"""

from __future__ import annotations

import collections
import contextlib

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten
# Operations whose result the host needs (a value, or a size that depends on the data): on a GPU
# they wait for the device (under inference mode `item` arrives whole, else as _local_scalar_dense).
HOST_SYNCS = {aten._local_scalar_dense, aten.item, aten.is_nonzero, aten.equal, aten.allclose, aten.nonzero,
              aten.masked_select}
US_PER_GRAPH_OP = 1e-3  # milliseconds of device time per recorded operation of a replayed graph


class StreamRace(RuntimeError):
    """Two streams touch one tensor with nothing ordering them: on a GPU, a data race."""


def _is_cuda(device) -> bool:
    if isinstance(device, int) and not isinstance(device, bool):
        return True
    return isinstance(device, (str, torch.device)) and torch.device(device).type == "cuda"


def _tensors(tree) -> list[torch.Tensor]:
    """The tensors in an operation's arguments or results (nested tuples, lists, dicts)."""
    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, (tuple, list)):
        return [t for item in tree for t in _tensors(item)]
    if isinstance(tree, dict):
        return [t for item in tree.values() for t in _tensors(item)]
    return []


def _map(fn, tree):
    """`tree` with each tensor t in it replaced by fn(t)."""
    if isinstance(tree, torch.Tensor):
        return fn(tree)
    if isinstance(tree, (tuple, list)):
        return type(tree)(_map(fn, item) for item in tree)
    if isinstance(tree, dict):
        return {k: _map(fn, v) for k, v in tree.items()}
    return tree


def _key(t: torch.Tensor) -> int | None:
    """The memory a tensor lives in (views share it); None for none, or none to see (an opaque
    tensor, e.g. the CPU fast path's packed mkldnn weights)."""
    try:
        storage = t.untyped_storage()
    except (NotImplementedError, RuntimeError):
        return None
    return storage.data_ptr() if storage.nbytes() else None


def _written(func, args, kwargs) -> list[torch.Tensor]:
    """The arguments an operation writes (in-place and out= arguments, from its schema)."""
    out = []
    for i, arg in enumerate(func._schema.arguments):
        if arg.alias_info is not None and arg.alias_info.is_write:
            value = args[i] if i < len(args) else kwargs.get(arg.name)
            out += _tensors(value)
    return out


class FakeCuda:
    def __init__(self, tensors_on: torch.device | str = "cuda:0", behind: int | None = None):
        """`tensors_on`: the device every tensor counts as being on (their operations go to that
        device's current stream); `behind`: how far the device may lag (module docstring)."""
        self.tensors_on = torch.device(tensors_on)
        self.behind = behind
        self.current_device = torch.device("cuda", 0)  # a thread's default
        self._current: dict[torch.device, FakeCuda.Stream] = {}  # per device; default streams lazily
        self.streams: list = []  # every stream made
        self.capturing: _Capture | None = None
        self.in_graph: tuple | None = None  # (stream, operation number) of the replay running
        self.quiet = False  # the stand-in's own bookkeeping operations: not launched, not tracked
        self.clock_ms = 0.0  # device time: advances as the device finishes work
        self.host_knows: dict = {}  # vector clock of the work the host has waited for
        self.access: dict[int, list] = {}  # memory -> [(writer stream, op number), {reader stream: op number}]
        self.captures: list[tuple] = []  # (device, stream, pool) of each capture
        self.replays: list[tuple] = []  # (device, stream, graph, op number on the stream) of each replay
        self.synchronized = 0  # Event.synchronize calls
        self.blocked = 0  # ... of them that had to wait for the device
        self.device_synchronizes = 0
        self._define_classes()

    # -- torch.cuda's classes -----------------------------------------------------------------

    def _define_classes(self) -> None:
        cuda = self

        class Stream:
            def __init__(self, device=None, priority=0, _default=False):
                cuda.streams.append(self)
                self.device = cuda._device(device)
                self.priority, self.default = priority, _default
                self.launched = 0  # operations launched on it, numbered from 1
                self.done = 0  # ... of which the device has finished
                self.cost_ms: dict[int, float] = {}  # op number -> device time (graph replays)
                self.waiting: dict[int, list] = collections.defaultdict(list)  # op number -> events
                self.after: dict = {}  # vector clock: per stream, the last op ordered before our next

            def __repr__(self):
                return f"<{'default ' if self.default else ''}stream {id(self) % 10000} on {self.device}>"

            def wait_stream(self, other):
                """Work launched on this stream from now on runs after the work on `other` so far."""
                cuda._merge(self.after, other.clock())

            def clock(self) -> dict:
                return {**self.after, self: self.launched}

            def launch(self, cost_ms: float = 0.0) -> int:
                cuda._merge(self.after, cuda.host_knows)  # launched after what the host has waited for
                self.launched += 1
                if cost_ms:
                    self.cost_ms[self.launched] = cost_ms
                if cuda.behind is not None:
                    cuda._finish(self, self.launched - cuda.behind)
                return self.launched

        class Event:
            def __init__(self, enable_timing=False, blocking=False, interprocess=False):
                self.timing = enable_timing
                self.stream = self.position = self.time_ms = self.clock = None

            def record(self, stream=None):
                stream = stream if stream is not None else cuda.current_stream()
                if self.stream is not None and self in self.stream.waiting.get(self.position, []):
                    self.stream.waiting[self.position].remove(self)
                self.stream, self.position, self.clock = stream, stream.launched, stream.clock()
                self.time_ms = cuda.clock_ms if stream.done >= stream.launched else None
                if self.time_ms is None:
                    stream.waiting[self.position].append(self)

            def query(self):
                if self.stream is None:  # never recorded: nothing to wait for
                    return True
                done = self.stream.done >= self.position
                if done:
                    cuda._merge(cuda.host_knows, self.clock)
                return done

            def synchronize(self):
                cuda.synchronized += 1
                if self.stream is None:
                    return
                if self.stream.done < self.position:
                    cuda.blocked += 1
                    cuda._finish(self.stream, self.position)
                cuda._merge(cuda.host_knows, self.clock)

            def elapsed_time(self, end):
                if not (self.timing and end.timing):
                    raise RuntimeError("Both events must be created with argument 'enable_timing=True'.")
                if self.time_ms is None or end.time_ms is None:
                    raise RuntimeError("CUDA error: device not ready (an event not recorded or not yet done)")
                return end.time_ms - self.time_ms

        class CUDAGraph:
            def __init__(self):
                self.ops: list[tuple] = []  # (func, args, kwargs, out) as recorded
                self.device = None  # where it was captured

            @property
            def device_ms(self) -> float:
                return len(self.ops) * US_PER_GRAPH_OP

            def replay(self):
                if self.device is None:
                    raise RuntimeError("replay of a graph that was never captured")
                if cuda.current_device != self.device:
                    raise RuntimeError(f"a graph captured on {self.device} replayed under {cuda.current_device}")
                if cuda.capturing is not None:
                    raise RuntimeError("replay while a stream is capturing")
                stream = cuda.current_stream()
                number = stream.launch(self.device_ms)  # one launch, however many operations
                cuda.replays.append((cuda.current_device, stream, self, number))
                cuda.in_graph = (stream, number)
                replayed: dict[int, torch.Tensor] = {}  # id(recorded output) -> this replay's

                def now(t):
                    return replayed.get(id(t), t)

                try:
                    with torch.inference_mode():
                        for func, args, kwargs, out in self.ops:
                            result = func(*_map(now, args), **_map(now, kwargs))
                            for old, new in zip(_tensors(out), _tensors(result)):
                                replayed[id(old)] = new
                finally:
                    cuda.in_graph = None

        self.Stream, self.Event, self.CUDAGraph = Stream, Event, CUDAGraph

    # -- torch.cuda's functions ---------------------------------------------------------------

    def _device(self, device) -> torch.device:
        if device is None:
            return self.current_device
        if isinstance(device, int):
            return torch.device("cuda", device)
        device = torch.device(device)
        return torch.device("cuda", self.current_device.index) if device.index is None else device

    def current_stream(self, device=None):
        device = self._device(device)
        if device not in self._current:
            self._current[device] = self.Stream(device, _default=True)
        return self._current[device]

    @contextlib.contextmanager
    def device(self, device):
        """torch.cuda.device: the current device for the block (None: unchanged)."""
        before = self.current_device
        if device is not None:
            self.current_device = self._device(device)
        try:
            yield
        finally:
            self.current_device = before

    @contextlib.contextmanager
    def stream(self, stream):
        """torch.cuda.stream (StreamContext): the stream's device becomes current, and the
        stream that device's current stream, for the block."""
        if stream is None:
            yield
            return
        before_device, before_stream = self.current_device, self.current_stream(stream.device)
        self.current_device, self._current[stream.device] = stream.device, stream
        try:
            yield
        finally:
            self._current[stream.device], self.current_device = before_stream, before_device

    def synchronize(self, device=None):
        """torch.cuda.synchronize: the host waits for every stream of the device."""
        device = self._device(device)
        self.device_synchronizes += 1
        for stream in self.streams:
            if stream.device == device:
                self._finish(stream, stream.launched)
                self._merge(self.host_knows, stream.clock())

    def graph_pool_handle(self):
        return ("graph pool", object())

    @contextlib.contextmanager
    def graph(self, cuda_graph, pool=None, stream=None, capture_error_mode="global"):
        """torch.cuda.graph: synchronize, then capture on `stream` (a side stream of its own if
        None) under that stream's context."""
        if self.capturing is not None:
            raise RuntimeError("capture inside a capture")
        self.synchronize()
        stream = stream if stream is not None else self.Stream()
        if stream.default:
            raise RuntimeError("CUDA graphs must be captured on a non-default stream. "
                               "(However, after capture, it's ok to replay them on the default stream.)")
        self.captures.append((self.current_device, stream, pool))
        with self.stream(stream):
            cuda_graph.device = self.current_device
            self.capturing = _Capture(self, cuda_graph)
            try:
                yield
            finally:
                capture, self.capturing = self.capturing, None
                capture.end()

    # -- the device's work ---------------------------------------------------------------------

    @staticmethod
    def _merge(into: dict, clock: dict) -> None:
        for stream, n in clock.items():
            if into.get(stream, 0) < n:
                into[stream] = n

    def _finish(self, stream, upto: int) -> None:
        """The device finishes `stream`'s work up to operation `upto`."""
        while stream.done < upto:
            stream.done += 1
            self.clock_ms += stream.cost_ms.pop(stream.done, 0.0)
            for event in stream.waiting.pop(stream.done, []):
                event.time_ms = self.clock_ms

    def run_op(self, func, args, kwargs):
        """One operation the host runs: launched on the current stream of the tensors' device
        (or part of the replay running), checked for races with other streams, then run."""
        if self.in_graph is not None:
            stream, number = self.in_graph
        else:
            stream = self.current_stream(self.tensors_on)
            number = stream.launch()
        tensors = {_key(t): t for t in _tensors((args, kwargs))}
        written = {_key(t) for t in _written(func, args, kwargs)} - {None}
        read = set(tensors) - {None} - written
        for key in read | written:
            self._check(func, tensors[key], key, stream, key in written)
        out = func(*args, **kwargs)
        fresh = {_key(t) for t in _tensors(out)} - {None} - read - written
        if func.overloadpacket in (aten.lift_fresh, aten.lift_fresh_copy):  # a constant from the host
            fresh = {_key(t) for t in _tensors(out)} - {None}
        for key in written | fresh:
            self.access[key] = [(stream, number), {}]
        for key in read - fresh:
            if key in self.access:
                self.access[key][1][stream] = number
        if func.overloadpacket in HOST_SYNCS:
            self.host_waits(stream)
        return out

    def host_waits(self, stream=None) -> None:
        """The host reads device memory (a blocking copy): it waits for the stream's work."""
        stream = stream if stream is not None else self.current_stream(self.tensors_on)
        self._finish(stream, stream.launched)
        self._merge(self.host_knows, stream.clock())

    def _check(self, func, tensor, key, stream, write: bool) -> None:
        if key not in self.access:
            return
        (writer, number), readers = self.access[key]
        what = f"{func} on {stream} {'writes' if write else 'reads'} a tensor {tuple(tensor.shape)} {tensor.dtype}"
        if writer is not stream and stream.after.get(writer, 0) < number:
            raise StreamRace(f"{what} that {writer} wrote (its operation {number}) with no wait_stream or "
                             f"synchronize in between")
        if write:
            for reader, n in readers.items():
                if reader is not stream and stream.after.get(reader, 0) < n:
                    raise StreamRace(f"{what} that {reader} read (its operation {n}) with no wait_stream or "
                                     f"synchronize in between")

    # -- installing -----------------------------------------------------------------------------

    @contextlib.contextmanager
    def installed(self, monkeypatch):
        """torch.cuda's classes and functions replaced for the block, and every operation of this
        thread going through the stand-in (tensors asked for on a CUDA device made on the CPU)."""
        for name in ("Stream", "CUDAGraph", "Event", "device", "stream", "graph", "current_stream",
                     "synchronize", "graph_pool_handle"):
            monkeypatch.setattr(torch.cuda, name, getattr(self, name))
        with _OnHost(self), _Launches(self):
            yield self


class _Capture:
    def __init__(self, cuda: FakeCuda, graph):
        self.cuda, self.graph = cuda, graph
        self.made: set[int] = set()  # memory the capture allocated (the graph's pool)
        self.before: dict[int, tuple] = {}  # memory that existed before and was written: its contents

    def record(self, func, args, kwargs):
        if func.overloadpacket in HOST_SYNCS:
            raise RuntimeError(f"{func} needs the host to wait for the device: not permitted while a stream "
                               f"is capturing (cudaErrorStreamCaptureUnsupported)")
        for t in _written(func, args, kwargs):
            key = _key(t)
            if key is not None and key not in self.made and key not in self.before:
                storage = t.untyped_storage()
                self.before[key] = (storage, storage.clone())
        inputs = {_key(t) for t in _tensors((args, kwargs))}
        out = func(*args, **kwargs)
        self.made |= {_key(t) for t in _tensors(out)} - inputs - {None}
        self.graph.ops.append((func, args, kwargs, out))
        return out

    def end(self) -> None:
        """Capture ran nothing: what existed before is as it was, what it made is garbage."""
        self.cuda.quiet = True
        try:
            with torch.inference_mode():
                for storage, contents in self.before.values():
                    storage.copy_(contents)
                for *_, out in self.graph.ops:
                    for t in _tensors(out):
                        if _key(t) in self.made:
                            t.fill_(float("nan") if t.is_floating_point() else -1 if t.dtype != torch.bool else True)
        finally:
            self.cuda.quiet = False


class _Launches(TorchDispatchMode):
    """Every aten operation: recorded into the graph being captured, else launched and run."""

    def __init__(self, cuda: FakeCuda):
        super().__init__()
        self.cuda = cuda

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.cuda.quiet:
            return func(*args, **kwargs)
        if self.cuda.capturing is not None:
            return self.cuda.capturing.record(func, args, kwargs)
        return self.cuda.run_op(func, args, kwargs)


class _OnHost(TorchFunctionMode):
    """Tensors asked for on a CUDA device are made on the CPU (the stand-in's device memory); a
    copy to the host waits for the device."""

    def __init__(self, cuda: FakeCuda):
        super().__init__()
        self.cuda = cuda

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _is_cuda(kwargs.get("device")):
            kwargs = {**kwargs, "device": torch.device("cpu")}
        to_host = func in (torch.Tensor.cpu, torch.Tensor.tolist, torch.Tensor.numpy)
        if func is torch.Tensor.to:
            target = args[1] if len(args) > 1 else kwargs.get("device")
            if _is_cuda(target):
                args = (args[0], torch.device("cpu"), *args[2:])
            to_host = (isinstance(target, (str, torch.device)) and torch.device(target).type == "cpu"
                       and not kwargs.get("non_blocking"))  # a non-blocking copy does not wait
        out = func(*args, **kwargs)
        if to_host:
            self.cuda.host_waits()
        return out
