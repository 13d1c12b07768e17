"""The parcels of lci://: Dask messages to bytes, and bytes back to messages.

Sans-I/O: nothing here touches a socket, a thread or an event loop, so the
whole protocol can be tested on its own with plain bytes. One concept a module,
each importing only those above it in this list:

- :mod:`.wire`: the wire format (described in its docstring), its constants,
  the control units, :class:`Limits` and the events a decoder yields;
- :mod:`.grouping`: Dask's buffer-grouping policy, which frames the receiver
  keeps in one buffer (:func:`shares_buffer`);
- :mod:`.writer`: :class:`OutgoingParcel`, a message cut into units, and
  :func:`encode_parcel`;
- :mod:`.reader`: :class:`ParcelDecoder`, the incremental decoder (it needs
  only :mod:`.wire`).

The names the rest of the package and its tests use are re-exported here.
"""

from __future__ import annotations

from dask_lcicomm.parcel.grouping import shares_buffer
from dask_lcicomm.parcel.reader import ParcelDecoder
from dask_lcicomm.parcel.wire import (
    BULK,
    FRAGMENT_EXT,
    HEADER,
    MAGIC,
    MAX_HELLO_BYTES,
    MAX_VC,
    PLACED_EXT,
    SHARE,
    SIZE_MASK,
    VERSION,
    Buffer,
    Close,
    Connect,
    Hello,
    Kind,
    Limits,
    Message,
    MessageTooLarge,
    Placement,
    ProtocolError,
    encode_close,
    encode_connect,
    encode_hello,
)
from dask_lcicomm.parcel.writer import OutgoingParcel, encode_parcel

__all__ = [
    # the wire format
    "MAGIC", "VERSION", "HEADER", "FRAGMENT_EXT", "PLACED_EXT", "BULK", "SHARE", "SIZE_MASK",
    "MAX_HELLO_BYTES", "MAX_VC", "Kind", "Buffer", "Placement", "ProtocolError", "MessageTooLarge",
    "Limits", "Hello", "Connect", "Close", "Message", "encode_hello", "encode_connect", "encode_close",
    # the grouping policy
    "shares_buffer",
    # the writer
    "OutgoingParcel", "encode_parcel",
    # the reader
    "ParcelDecoder",
]
