"""The data plane: start a bucket's collective (the default all-reduce or a comm hook) and take its result.

The reducer decides *when* (buckets launch strictly in index order on every rank, so collectives
pair up across ranks even when gradients become ready in different orders); the launcher decides
*how*. ``ShardedLauncher`` (``sharded/launcher.py``) reduce-scatters instead. A comm hook has torch's
signature, ``hook(state, bucket) -> torch.futures.Future[Tensor]``, and receives a ``GradBucket`` that
answers the methods of ``torch.distributed.GradBucket``, so torch's own hooks run unchanged; the
catalogue is ``gradsync.hooks``, which the engine never imports.
"""
from __future__ import annotations

import copy
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from .. import process
from .._torch import Future
from .bucket import slot
from .control import ControlPlane
from .messages import hook_id
from .store import Bucket

CommHook = Callable[[Any, "GradBucket"], torch.futures.Future]


class GradBucket:
    """One flat bucket of gradients, as handed to a communication hook."""

    __slots__ = ("_index", "_buffer", "_gradients", "_parameters", "_is_last")

    def __init__(self, index: int, buffer: torch.Tensor, gradients: list[torch.Tensor],
                 parameters: list[torch.Tensor], is_last: bool):
        self._index = index
        self._buffer = buffer
        self._gradients = gradients
        self._parameters = parameters
        self._is_last = is_last

    def index(self) -> int:
        """Return the bucket's position in launch order (0 is launched first)."""
        return self._index

    def buffer(self) -> torch.Tensor:
        """Return the flat tensor holding this bucket's gradients."""
        return self._buffer

    def gradients(self) -> list[torch.Tensor]:
        """Return each parameter's gradient as a view into ``buffer()``."""
        return self._gradients

    def parameters(self) -> list[torch.Tensor]:
        """Return the parameters, in the same order as ``gradients()``."""
        return self._parameters

    def is_last(self) -> bool:
        """Return True for the last bucket launched in an iteration."""
        return self._is_last

    def set_buffer(self, tensor: torch.Tensor) -> None:
        """Make ``tensor`` (as many elements) the bucket's buffer, as torch's does: torch's ``fp16_compress_wrapper``
        hands the hook it wraps a half-precision buffer this way, and its future may yield that dtype."""
        if tensor.numel() != self._buffer.numel():
            raise ValueError(
                f"set_buffer on bucket {self._index}: expected {self._buffer.numel()} elements, "
                f"got {tensor.numel()}"
            )
        old, self._buffer = self._buffer, tensor.reshape(self._buffer.shape).contiguous()
        self._gradients = [slot(self._buffer, g.storage_offset() - old.storage_offset(), g) for g in self._gradients]


def one_collective(hook: CommHook, world_sizes: tuple[int, ...] | None = None) -> CommHook:
    """Declare that ``hook`` issues one collective and none from its future's callbacks (on any world
    size, or on ``world_sizes``): the reducer then launches the next bucket without waiting for it."""
    process.state.one_collective_hooks[hook] = world_sizes
    return hook


def issues_one_collective(hook: CommHook, world_size: int | None = None) -> bool:
    """Whether ``hook`` is declared to issue one collective (``one_collective``). Other hooks (e.g.
    torch's ``powerSGD_hook``) may start collectives from a callback on gloo's thread when an earlier
    one completes; the reducer then issues nothing else until that bucket's future is done, so every
    rank issues collectives in the same order."""
    hook = getattr(hook, "func", hook)  # functools.partial
    if hook not in process.state.one_collective_hooks:
        return False
    sizes = process.state.one_collective_hooks[hook]
    return sizes is None or world_size in sizes


def saved_state(state: Any) -> dict[str, Any] | None:
    """A deep copy of a hook state's attributes but its process group, if its class says it can be saved."""
    if type(state).__getstate__ is object.__getstate__:
        return None
    names = [n for c in type(state).__mro__ for n in getattr(c, "__slots__", ())] + list(getattr(state, "__dict__", ()))
    return copy.deepcopy({n: getattr(state, n) for n in names
                          if hasattr(state, n) and not isinstance(getattr(state, n), dist.ProcessGroup)})


class BucketLauncher:
    def __init__(self, group: dist.ProcessGroup, plane: ControlPlane, params: list[torch.Tensor]):
        self.group = group
        self.plane = plane  # every wait is bounded there
        self.params = params
        self.hook: CommHook | None = None
        self.set_dtypes: dict[int, torch.dtype] = {}  # bucket index -> its buffer's dtype once the hook returned
        self.waited = 0.0  # seconds waited for the phase header and the previous bucket, in all (reducer.py times them)
        self.state: Any = None
        # a window may be reduced again (a commit protocol, skip_on): keep the hook's state as each synced
        # backward's first launch found it, and put it back before the second reduction (rewind)
        self.rewinds, self.kept, self.saved = False, False, None

    def set_hook(self, hook: CommHook | None, state: Any) -> None:
        self.hook, self.state = hook, state
        self.plane.hook = hook_id(hook)  # every header compares it: a hook on some ranks only raises there

    def rewind(self) -> None:
        """Before the window is reduced again: the hook's state as the synced backward began. Only a state whose
        class defines ``__getstate__`` (how a state says it can be saved: torch's ``PowerSGDState``, with its step
        count, error feedback, warm starts and random state) is kept; the process group stays."""
        for name, value in copy.deepcopy(self.saved or {}).items():
            setattr(self.state, name, value)

    @property
    def divides_on_copy(self) -> bool:
        """The default all-reduce sums averages: the store divides each gradient as it copies it in.
        A hook divides (or not) itself."""
        return self.hook is None

    def launch(self, bucket: Bucket, buckets: list[Bucket], traced: bool) -> None:
        """Start ``bucket``'s collective; its handle goes to ``bucket.handle``."""
        if traced:
            bucket.times["launch"] = time.perf_counter()
        if self.rewinds and not self.kept:
            self.kept, self.saved = True, saved_state(self.state) if self.hook is not None else None
        previous = buckets[bucket.index - 1].handle if bucket.index else None
        buffer, views = bucket.buffer, bucket.views
        if bucket.wire is not None:  # the window stays in the buffer: reduce its average's copy (keep_window_apart)
            buffer, views = bucket.wire, bucket.wire_views
            if self.divides_on_copy:
                torch.mul(bucket.buffer, 1.0 / self.group.size(), out=buffer)  # as the store (bucket.average)
            else:
                buffer.copy_(bucket.buffer)
        bucket.handle = self.issue(bucket.index, buffer, views, bucket.members, previous, bucket.index == len(buckets) - 1)
        if traced:
            fut = bucket.handle if isinstance(bucket.handle, Future) else bucket.handle.get_future()
            times = bucket.times
            fut.add_done_callback(lambda _f: times.__setitem__("done", time.perf_counter()))

    def issue(self, index: int, buffer: torch.Tensor, views: list[torch.Tensor], members: list[int],
              previous: Any, is_last: bool) -> Any:
        """Start bucket ``index``'s collective: the default all-reduce, or the comm hook's future.

        ``previous`` is the handle of bucket ``index - 1``; a hook not known to issue a single
        collective waits for it first (see ``issues_one_collective``).
        """
        if self.hook is None:
            return dist.all_reduce(buffer, group=self.group, async_op=True)
        if previous is not None and not issues_one_collective(self.hook, self.group.size()):
            start = time.perf_counter()
            self.plane.wait(previous, f"bucket {index - 1} (its hook's collectives finish before bucket {index})")
            self.waited += time.perf_counter() - start
        if buffer.is_complex():  # as torch's reducer: hooks see the real view (a cast would drop imaginary parts)
            buffer, views = torch.view_as_real(buffer).view(-1), [torch.view_as_real(v) for v in views]
        bucket = GradBucket(index, buffer, views, [self.params[i] for i in members], is_last)
        handle = self.hook(self.state, bucket)
        if bucket.buffer().dtype != buffer.dtype:  # the hook's set_buffer declared another dtype for its result
            self.set_dtypes[index] = bucket.buffer().dtype
        else:
            self.set_dtypes.pop(index, None)
        if not isinstance(handle, Future):  # torch's sentence and type, raised where torch raises it (the bucket's launch)
            raise RuntimeError(
                "gradsync: DDP communication hook's callback must return a torch.futures.Future object, but got "
                f"{type(handle).__module__}.{type(handle).__qualname__} (bucket {index}): a hook returns a future "
                "of the reduced tensor"
            )
        return handle

    def before_control(self, handles: list[Any]) -> None:
        """A hook that may issue collectives from its futures' callbacks finishes them before the
        control all-reduce, so the control pairs with the control on every rank."""
        if self.hook is not None and not issues_one_collective(self.hook, self.group.size()):
            for index, handle in enumerate(handles):
                if handle is not None:  # None: a bucket skip_all_reduce_unused_params did not launch
                    self.plane.wait(handle, f"bucket {index}")

    def result(self, bucket: Bucket) -> torch.Tensor:
        """Wait for ``bucket``'s collective; return the reduced tensor (checked against the bucket)."""
        reduced = self.reduced(bucket)
        if self.plane.replicas is not None:  # check_replicas: fingerprinted while later buckets still travel
            self.plane.replicas.arrived(bucket.index, reduced)
        return reduced

    def reduced(self, bucket: Bucket) -> torch.Tensor:
        """``result`` without the replicas' fingerprint: what a launcher of another reduction overrides."""
        handle = bucket.handle
        self.plane.wait(handle, f"bucket {bucket.index}")
        if not isinstance(handle, Future):
            return bucket.buffer if bucket.wire is None else bucket.wire
        result = handle.value()
        if isinstance(result, (list, tuple)) and len(result) == 1:
            result = result[0]
        if bucket.buffer.is_complex() and isinstance(result, torch.Tensor) and not result.is_complex() \
                and result.dtype == bucket.buffer.real.dtype and result.numel() == 2 * bucket.buffer.numel():
            result = torch.view_as_complex(result.reshape(-1, 2))  # the hook reduced the real view
        if not isinstance(result, torch.Tensor) or result.numel() != bucket.buffer.numel():
            what = (f"a tensor of {result.numel()} elements" if isinstance(result, torch.Tensor)
                    else type(result).__name__)
            raise TypeError(
                f"gradsync: the communication hook's future for bucket {bucket.index} yielded {what}; "
                f"expected a tensor of {bucket.buffer.numel()} elements (the bucket's buffer)"
            )
        if result.dtype != bucket.buffer.dtype and result.dtype == self.set_dtypes.get(bucket.index):
            result = result.to(bucket.buffer.dtype)  # the dtype the hook's set_buffer declared: decompressed here
        if result.dtype != bucket.buffer.dtype:
            raise TypeError(
                f"gradsync: the communication hook's future for bucket {bucket.index} yielded a "
                f"{result.dtype} tensor; expected {bucket.buffer.dtype} (the bucket's dtype). A "
                "compressing hook must decompress into the bucket's dtype before returning."
            )
        return result

    def reset(self) -> None:
        """A backward begins, or the last one raised before its end: the next launch keeps the hook's state."""
        self.kept, self.saved = False, None


__all__ = ["BucketLauncher", "CommHook", "GradBucket", "issues_one_collective", "one_collective"]
