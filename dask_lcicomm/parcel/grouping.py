"""Dask's buffer-grouping policy: which frames of a message the receiver keeps
in one buffer.

The sender decides it (see the wire format, :mod:`.wire`) by the rule of
Dask's tcp comm, plus shards of one object, and no object above the eager
threshold in the header's buffer: :func:`plan` says how a message's frames
are received, :func:`shares_buffer` the same as one flag per frame.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pickle import PickleBuffer

from dask_lcicomm.parcel.wire import Buffer


def _as_bytes_view(frame: Buffer) -> memoryview:
    """A flat byte view of ``frame`` in memory order, without copying when possible."""
    view = frame if isinstance(frame, memoryview) else memoryview(frame)
    if view.format == "B" and view.ndim == 1 and view.c_contiguous:
        return view
    if not view.nbytes:
        return memoryview(b"")
    if view.contiguous:
        return PickleBuffer(view).raw()
    return memoryview(view.tobytes())


def as_memoryview(view: Buffer) -> memoryview:
    return view if type(view) is memoryview else memoryview(view)


def _buffer(frame: Buffer) -> object:
    """The object whose memory ``frame`` is (Dask's notion of a frame's buffer)."""
    return frame.obj if isinstance(frame, memoryview) else frame


def plan(
    frames: Sequence[Buffer], join_limit: float = math.inf
) -> tuple[list[Buffer], list[int], list[int]]:
    """How ``frames`` are received: the frames as flat bytes (``bytes`` frames
    as they are, the others as byte views), their sizes, and the index of the
    first frame of each group. Every other non-empty frame shares the receive
    buffer of the previous non-empty frame.

    A frame shares the previous non-empty frame's buffer

    * while it belongs to the leading group of Dask's tcp comm
      (``distributed.comm.tcp._add_frames_header``): frames whose buffer
      (``.obj`` of a memoryview, else the frame itself) is ``bytes`` are
      header-like; the first other buffer joins them if the bytes before it
      total at most ``max(2048, 0.05 * n)``, ``n`` the size of its frame, and
      that frame is at most ``join_limit`` (the sender's eager threshold: a
      larger object gets a buffer, or a shared-memory pool block, of exactly
      its own size), and so do later frames of that same buffer (its shards)
      and header-like frames; the first frame of another non-``bytes``
      buffer ends the group;
    * or when its buffer is that of the previous non-empty frame (shards of
      one object, which Dask joins without a copy when they lie back to back).
    """
    views: list[Buffer] = []
    sizes: list[int] = []
    header = 0  # bytes of the leading group so far
    first: object = None  # the leading group's non-bytes buffer
    for frame in frames:
        if type(frame) is bytes:
            views.append(frame)
            n = len(frame)
            sizes.append(n)
            header += n
            continue
        view = _as_bytes_view(frame)
        n = view.nbytes
        buffer: object = frame.obj if isinstance(frame, memoryview) else frame
        if not isinstance(buffer, bytes):
            if first is None:
                if (header > 2048 and header > n * 0.05) or n > join_limit:
                    break
                first = buffer
            elif buffer is not first:
                break
        views.append(view)
        sizes.append(n)
        header += n
    else:
        # one leading group
        starts = [0] if sizes and sizes[0] else [index for index, n in enumerate(sizes) if n][:1]
        return views, sizes, starts
    # The leading group, then a group per object (or run of its shards),
    # starting with the frame that ended the leading group.
    starts = [0] if sizes and sizes[0] else [index for index, n in enumerate(sizes) if n][:1]
    if n:
        starts.append(len(sizes))
        previous = buffer  # the buffer of the previous non-empty frame
    else:
        previous = next((_buffer(frames[i]) for i in range(len(sizes) - 1, -1, -1) if sizes[i]), None)
    views.append(view)
    sizes.append(n)
    for index in range(len(sizes), len(frames)):
        frame = frames[index]
        if type(frame) is bytes:
            views.append(frame)
            n = len(frame)
            buffer = frame
        else:
            view = _as_bytes_view(frame)
            views.append(view)
            n = view.nbytes
            buffer = _buffer(frame)
        sizes.append(n)
        if n:
            if buffer is not previous:
                starts.append(index)
            previous = buffer
    return views, sizes, starts


def shares_buffer(frames: Sequence[Buffer], join_limit: float = math.inf) -> list[bool]:
    """For each frame, whether the receiver puts it into the buffer of the
    previous non-empty frame (never for an empty frame or the first non-empty
    one); every other non-empty frame starts a buffer of its own.

    The rule is Dask's tcp comm's, plus shards, and no object larger than
    ``join_limit`` shares the header's buffer: see :func:`plan`.
    """
    _, sizes, starts = plan(frames, join_limit)
    own = set(starts)
    return [bool(n) and index not in own for index, n in enumerate(sizes)]
