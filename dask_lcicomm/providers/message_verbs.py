"""What a message fabric's data-path verbs answer with, and the verbs of a
fabric with RMA (see :mod:`.message_fabric`)."""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np


class Request(Protocol):
    """A send, receive or read the fabric has posted."""

    @property
    def completed(self) -> bool: ...

    def check_error(self) -> None:
        """Raise what made the request fail, if anything did."""


class _Done:
    __slots__ = ()
    completed = True

    def check_error(self) -> None:
        pass


#: The request of a message that came with its bytes: nothing to wait for.
DONE: Request = _Done()


class Rma(Protocol):
    """The verbs of a fabric that reads peers' memory (LCI's one-sided get),
    called under the fabric's lock."""

    #: Bulk groups of at least this many bytes are read, not sent.
    rendezvous_bytes: int

    def register(self, buffer: Any) -> tuple[Any, int, int]:
        """Let peers read ``buffer``: a handle for :meth:`unregister`, and
        the address and key a peer reads it by."""

    def unregister(self, handle: Any) -> None:
        """Peers may read the registered memory no longer."""

    def read(self, peer: Any, buffer: np.ndarray, address: int, key: int) -> Request:
        """Read ``buffer.nbytes`` bytes that ``peer`` registered at
        ``address`` with ``key`` into ``buffer``."""
