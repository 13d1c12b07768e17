"""A message device's send side without a fabric: order behind refused
sends, the bytes in flight, failures, unreachable peers and the END."""

from __future__ import annotations

from typing import Any

import dask
import pytest

from dask_lcicomm.providers.held_parcels import Held
from dask_lcicomm.providers.message_outbox import Outbox
from dask_lcicomm.providers.message_tags import BULK, CONTROL, END, STREAM, tag
from dask_lcicomm.providers.send_queue import Raw


class Sent:
    """A send the fake fabric took: finished by the test."""

    def __init__(self) -> None:
        self.completed = False
        self.error: BaseException | None = None

    def check_error(self) -> None:
        if self.error is not None:
            raise self.error

    def finish(self, error: BaseException | None = None) -> None:
        self.error = error
        self.completed = True


class Fabric:
    """The verbs an outbox uses: sends taken (or refused while ``refusing``)."""

    provider = "fake"

    def __init__(self, retry_limit: float = 30.0) -> None:
        self.retry_limit = retry_limit
        self.refusing = False
        self.sent: list[tuple[int, Any, Sent]] = []
        self.retrying: list[Any] = []
        self.busy_owners: list[Any] = []

    def send(self, peer: Any, value: int, message: Any) -> Sent | None:
        if self.refusing:
            return None
        request = Sent()
        self.sent.append((value, message, request))
        return request

    def retry_later(self, owner: Any) -> None:
        self.retrying.append(owner)

    def busy(self, owner: Any) -> None:
        self.busy_owners.append(owner)


@pytest.fixture
def outbox() -> tuple[Outbox, Fabric, list[str], list[str]]:
    fabric = Fabric()
    failures: list[str] = []
    unreachable: list[str] = []
    box = Outbox(fabric, "peer", "owner", failures.append, unreachable.append)  # type: ignore[arg-type]
    box.route = 7
    return box, fabric, failures, unreachable


def test_messages_refused_go_first_and_in_order(outbox):
    box, fabric, _, _ = outbox
    fabric.refusing = True
    box.post(b"one", STREAM, 0, 3)
    fabric.refusing = False
    box.post(b"two", STREAM, 0, 3)
    assert fabric.sent == [] and set(fabric.retrying) == {"owner"} and box.unposted
    assert box.reap()
    assert [message for _, message, _ in fabric.sent] == [b"one", b"two"]
    assert fabric.sent[0][0] == tag(7, STREAM, 0)
    assert not box.unposted


def test_stream_bytes_count_until_the_fabric_finishes_them(outbox):
    box, fabric, failures, _ = outbox
    box.post(b"abc", STREAM, 0, 3)
    box.post(b"defg", STREAM, 0, 4)
    assert box.inflight_bytes == 7 and box.busy and fabric.busy_owners == ["owner", "owner"]
    fabric.sent[0][2].finish()
    assert box.reap() and box.inflight_bytes == 4
    fabric.sent[1][2].finish(ConnectionResetError("gone"))
    box.reap()
    assert box.inflight_bytes == 0 and not box.busy
    assert failures == ["send failed: ConnectionResetError: gone"]


def test_a_held_parcels_bulk_message_counts_down_when_finished(outbox):
    box, fabric, _, _ = outbox
    held = Held(Raw(b"x"), None)
    held.bulk_out = 1
    box.post(b"bulk", BULK, 3, 0, held)
    fabric.sent[0][2].finish()
    box.reap()
    assert held.bulk_out == 0


def test_a_peer_that_never_took_a_send_is_unreachable_once():
    fabric = Fabric(retry_limit=0.0)
    fabric.refusing = True
    unreachable: list[str] = []
    box = Outbox(fabric, "peer", "owner", [].append, unreachable.append)  # type: ignore[arg-type]
    box.post(b"hello", CONTROL, 0)
    assert box.reap() and box.reap() is False
    assert len(unreachable) == 1 and "cannot reach it" in unreachable[0]


def test_a_peer_reached_once_is_lost_only_after_dasks_tcp_timeout():
    fabric = Fabric(retry_limit=0.0)
    unreachable: list[str] = []
    with dask.config.set({"distributed.comm.timeouts.tcp": "30s"}):
        box = Outbox(fabric, "peer", "owner", [].append, unreachable.append)  # type: ignore[arg-type]
    box.post(b"one", STREAM, 0, 3)
    fabric.refusing = True
    box.post(b"two", STREAM, 0, 3)
    box.reap()
    assert unreachable == []


def test_the_end_waits_for_the_sends_in_flight(outbox):
    box, fabric, _, _ = outbox
    box.post(b"abc", STREAM, 0, 3)
    box.end()
    assert box.ending and not box.ended and len(fabric.sent) == 1
    fabric.sent[0][2].finish()
    box.reap()
    assert box.ended and not box.ending
    assert fabric.sent[-1][:2] == (tag(7, CONTROL, END), b"")


def test_close_ends_and_hands_back_what_the_fabric_must_finish(outbox):
    box, fabric, _, _ = outbox
    box.post(b"abc", STREAM, 0, 3)
    dropped, sends = box.close(end=True)
    assert dropped == 0 and box.peer is None
    assert [message for _, message in sends] == [b"abc", b""]
    assert fabric.sent[-1][0] == tag(7, CONTROL, END)


def test_close_drops_what_the_fabric_still_refuses(outbox):
    box, fabric, _, _ = outbox
    fabric.refusing = True
    box.post(b"abc", STREAM, 0, 3)
    dropped, sends = box.close(end=False)
    assert (dropped, sends) == (1, []) and not box.unposted
