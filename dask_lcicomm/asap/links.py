"""Worker-to-worker links that carry the exchange's messages over Dask comms.

One comm per destination worker, opened with :func:`distributed.comm.connect`
to the peer's own address, so models travel over the cluster's scheme
(``lci://``, ``tcp://``, ...) and never through the scheduler. Messages to a
peer leave in order, one writer per comm; models go as
:func:`~distributed.protocol.serialize.to_serialize` frames, which Dask sends
without copying. The bytes each ``write`` reports are counted.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Mapping, Sequence
from typing import Any

from distributed.comm import connect
from distributed.comm.core import Comm
from distributed.protocol.serialize import to_serialize

from dask_lcicomm.asap.protocol import Message, Send

logger = logging.getLogger(__name__)

#: The handler name the messages are addressed to on the receiving worker.
OP = "lci_asap"
#: Seconds a link may take to open. In one probe, 32 simulated hosts opening
#: their 992 all-to-all links at once over tcp:// (no other traffic) took
#: 0.26 s at the median and up to 26 s.
CONNECT_TIMEOUT = 120.0


def wire(run: str, src: int, message: Message) -> dict[str, Any]:
    """``message`` as a one-way Dask message (no reply) for run ``run``."""
    data = None if message.data is None else to_serialize(message.data)
    return {"op": OP, "reply": False, "run": run, "src": src, "kind": message.kind.value,
            "r": message.round, "step": message.step, "data": data}


class _Link:
    """The ordered outbox to one peer and the task that drains it."""

    def __init__(self, owner: PeerLinks, address: str) -> None:
        self.owner, self.address = owner, address
        self.outbox: deque[Send] = deque()
        self.ready = asyncio.Event()
        self.comm: Comm | None = None
        #: Set once the comm is open, or opening it failed.
        self.settled = asyncio.Event()
        self.task = asyncio.ensure_future(self._drain())

    def put(self, send: Send) -> None:
        if send.latest_only:
            for queued in [q for q in self.outbox if q.latest_only]:
                self.outbox.remove(queued)
                self.owner.dropped += 1
        self.outbox.append(send)
        self.ready.set()

    async def _drain(self) -> None:
        try:
            self.comm = await connect(self.address, timeout=self.owner.connect_timeout,
                                      **self.owner.connection_args)
            self.comm.name = "asap"
            self.settled.set()
            while True:
                while not self.outbox:
                    self.ready.clear()
                    await self.ready.wait()
                send = self.outbox.popleft()
                msg = wire(self.owner.run, self.owner.rank, send.message)
                self.owner.bytes_sent += await self.comm.write(msg)
                self.owner.messages_sent += 1
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # reported to the training loop, which stops
            self.owner.fail(f"link to {self.address}: {exc!r}")
        finally:
            self.settled.set()

    async def close(self) -> None:
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)
        if self.comm is not None:
            self.comm.abort()


class PeerLinks:
    """The links of one worker in one run, opened ahead (:meth:`open`) or on
    first use.

    Must be created and used on the worker's event loop."""

    def __init__(self, run: str, rank: int, addresses: Sequence[str],
                 connection_args: Mapping[str, Any], connect_timeout: float = CONNECT_TIMEOUT) -> None:
        self.run, self.rank = run, rank
        self.addresses = list(addresses)
        self.connection_args = dict(connection_args)
        self.connect_timeout = connect_timeout
        self.bytes_sent = 0
        self.messages_sent = 0
        self.dropped = 0  # latest-only messages replaced before they left
        self.errors: list[str] = []
        self.failed = asyncio.Event()
        self._links: dict[int, _Link] = {}

    def fail(self, reason: str) -> None:
        """Record why this worker cannot go on; its training loop raises it."""
        logger.warning("rank %d: %s", self.rank, reason)
        self.errors.append(reason)
        self.failed.set()

    def _link(self, dst: int) -> _Link:
        link = self._links.get(dst)
        if link is None:
            link = self._links[dst] = _Link(self, self.addresses[dst])
        return link

    async def open(self, dsts: Sequence[int]) -> None:
        """Open the links to ``dsts`` now, concurrently, before traffic
        competes with their handshakes; a failure is recorded as any other."""
        links = [self._link(dst) for dst in dsts]
        await asyncio.gather(*(link.settled.wait() for link in links))

    def send(self, send: Send) -> None:
        self._link(send.dst).put(send)

    async def close(self) -> None:
        await asyncio.gather(*(link.close() for link in self._links.values()))
        self._links.clear()
