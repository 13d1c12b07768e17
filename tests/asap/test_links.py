"""Links: one ordered comm per peer, bytes counted, latest-only replacement,
failures reported instead of hanging."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from distributed.comm import listen

from dask_lcicomm.asap.links import OP, PeerLinks
from dask_lcicomm.asap.protocol import Kind, Message, Send


@pytest.mark.parametrize("scheme", ["lci", "tcp"])
def test_messages_arrive_in_order_and_latest_only_replaces_queued_ones(scheme):
    async def main():
        received: list[dict] = []

        async def handle(comm):
            try:
                while True:
                    received.append(await comm.read())
            except Exception:
                pass

        listener = listen(f"{scheme}://127.0.0.1:0", handle)
        await listener.start()
        links = PeerLinks("run-1", 3, ["unused", listener.contact_address], {})
        try:
            links.send(Send(1, Message(Kind.ACK, 0)))
            for r in range(5):  # queued before the link even connected
                links.send(Send(1, Message(Kind.NOTIFY, r, np.full(1000, float(r))), latest_only=True))
            links.send(Send(1, Message(Kind.ACK, 1)))
            for _ in range(500):
                if len(received) == 3:
                    break
                await asyncio.sleep(0.01)
        finally:
            await links.close()
            listener.stop()
        return received, links

    received, links = asyncio.run(main())
    assert [(m["op"], m["kind"], m["r"]) for m in received] == [
        (OP, "ack", 0), (OP, "notify", 4), (OP, "ack", 1)]
    assert np.array_equal(received[1]["data"], np.full(1000, 4.0))
    assert received[1]["src"] == 3 and received[1]["reply"] is False
    assert links.dropped == 4 and links.messages_sent == 3
    assert links.bytes_sent > 8000 and not links.errors


def test_unreachable_peer_is_reported():
    async def main():
        links = PeerLinks("run-2", 0, ["tcp://127.0.0.1:1"], {}, connect_timeout=1.0)
        links.send(Send(0, Message(Kind.ACK, 0)))
        try:
            await asyncio.wait_for(links.failed.wait(), 10)
        finally:
            await links.close()
        return links

    links = asyncio.run(main())
    assert links.errors and "tcp://127.0.0.1:1" in links.errors[0]


def test_links_opened_ahead_are_open_before_anything_is_sent_and_a_failure_is_recorded():
    async def main():
        opened: list[object] = []

        async def handle(comm):
            opened.append(comm)
            try:
                await comm.read()
            except Exception:
                pass

        listener = listen("lci://127.0.0.1:0", handle)
        await listener.start()
        links = PeerLinks("run-3", 0, [listener.contact_address, listener.contact_address,
                                       "tcp://127.0.0.1:1"], {}, connect_timeout=1.0)
        try:
            await asyncio.wait_for(links.open([0, 1]), 10)
            for _ in range(100):
                if len(opened) == 2:
                    break
                await asyncio.sleep(0.01)
            open_before_sending = (len(opened), links.messages_sent, list(links.errors))
            await asyncio.wait_for(links.open([2]), 30)
        finally:
            await links.close()
            listener.stop()
        return open_before_sending, links

    (comms, sent, errors), links = asyncio.run(main())
    assert (comms, sent, errors) == (2, 0, [])
    assert links.failed.is_set() and "tcp://127.0.0.1:1" in links.errors[0]
