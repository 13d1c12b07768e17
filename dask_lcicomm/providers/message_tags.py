"""The tags of a message fabric's messages, and its control messages.

A tag is::

    | route: 32 bits | kind: 2 bits | number: 30 bits |

The route is a random number that the receiving device chose and told its
peer alone, in its WELCOME. A peer therefore knows the routes of its own
devices only: it cannot put a message into another peer's conversation
except by guessing 32 random bits, and a message whose route no device holds
is dropped unread.

Route 0 belongs to the fabric. A HELLO there (a control message) asks a
listener for a device. It carries the connecting endpoint's address, the
listener's number (from its offer) and the route to answer on. The acceptor
makes the device and a peer handle back, and answers on that route with a
WELCOME that carries its own route. Any other message to route 0 is a
:data:`PROBE`, dropped unread: a fabric that learns of a peer's death only
by sending to it sends those.
"""

from __future__ import annotations

import struct

import numpy as np

from dask_lcicomm.parcel import ProtocolError

#: Message kinds. A stream message carries bytes of the parcel stream;
#: a bulk message one bulk group of a parcel (prompt: its parcel follows at
#: once); a control message a WELCOME or an END, in stream order, or a
#: READABLE or READ of the rendezvous (:mod:`.message_rendezvous`).
STREAM, BULK, PROMPT, CONTROL = range(4)
WELCOME, END, READABLE, READ = range(4)
NUMBER_BITS = 30
NUMBER_MASK = (1 << NUMBER_BITS) - 1

_ROUTE = struct.Struct("<I")


def tag(route: int, kind: int, number: int) -> int:
    """The tag of a message of ``kind`` to ``route``."""
    return route << 32 | kind << NUMBER_BITS | (number & NUMBER_MASK)


#: The tag of an empty message that only checks that the peer is alive.
PROBE = tag(0, STREAM, 0)


def welcome_message(route: int) -> bytes:
    """The WELCOME that tells a peer ``route``."""
    return _ROUTE.pack(route)


def peer_route(message: np.ndarray) -> int:
    """The route a WELCOME carries."""
    if message.nbytes != _ROUTE.size:
        raise ProtocolError(f"a {message.nbytes}-byte welcome")
    (route,) = _ROUTE.unpack(message.tobytes())
    if route == 0:
        raise ProtocolError("a welcome without a route")
    return int(route)
