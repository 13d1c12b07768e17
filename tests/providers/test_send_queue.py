"""The send queue on its own: no sockets, just units, bytes and tokens."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from dask_lcicomm.providers.send_queue import IOV_MAX, Raw, SendQueue


class Chunks:
    """A unit source of ``sizes`` units, each one buffer."""

    def __init__(self, tag: bytes, sizes: list[int]) -> None:
        self._units = [tag * n for n in sizes]
        self.nbytes = sum(sizes)

    @property
    def done(self) -> bool:
        return not self._units

    def next_unit(self) -> list[bytes]:
        return [self._units.pop(0)]


def _drain(queue: SendQueue, accept: int = 1 << 60) -> tuple[bytes, list[object]]:
    """Send everything, ``accept`` bytes at a time at most."""
    sent, done = b"", []
    while queue.out or queue.fill():
        n = min(accept, sum(len(b) for b in queue.out))
        sent += b"".join(bytes(b) for b in queue.out)[:n]
        done += queue.consume(n)
    return sent, done


def test_units_of_different_vcs_interleave_round_robin():
    queue = SendQueue(batch_bytes=1 << 20)
    queue.push(1, Chunks(b"a", [1, 1, 1]))
    queue.push(2, Chunks(b"b", [1, 1]))
    queue.push(3, Raw(b"c"))
    sent, _ = _drain(queue)
    assert sent == b"abcaba"


def test_units_of_one_vc_keep_their_order():
    queue = SendQueue(batch_bytes=1 << 20)
    queue.push(1, Raw(b"first"))
    queue.push(1, Raw(b"second"))
    assert _drain(queue)[0] == b"firstsecond"


def test_a_token_comes_back_when_its_last_byte_is_accepted():
    queue = SendQueue(batch_bytes=1 << 20)
    queue.push(1, Raw(b"xxxx"), token="t")
    queue.fill()
    assert queue.consume(3) == []
    assert queue.queued_bytes == 4
    assert queue.consume(1) == ["t"]
    assert queue.queued_bytes == 0


def test_push_says_when_a_batch_is_full():
    queue = SendQueue(batch_bytes=10)
    assert not queue.push(1, Raw(b"x" * 9))
    assert queue.push(2, Raw(b"x"))


def test_fill_takes_at_most_a_batch_or_iov_max_buffers():
    queue = SendQueue(batch_bytes=100)
    queue.push(1, Chunks(b"a", [60, 60, 60]))
    queue.fill()
    assert sum(len(b) for b in queue.out) == 120
    many = SendQueue(batch_bytes=1 << 30)
    many.push(1, Chunks(b"a", [1] * (IOV_MAX + 5)))
    many.fill()
    assert len(many.out) == IOV_MAX


def test_clear_returns_every_unfinished_token_once():
    queue = SendQueue(batch_bytes=4)
    queue.push(1, Raw(b"aaaa"), token="taken")
    queue.push(1, Raw(b"bbbb"), token="queued")
    queue.push(2, Raw(b"cccc"))
    queue.fill()
    assert queue.consume(2) == []
    assert sorted(queue.clear()) == ["queued", "taken"]
    assert queue.clear() == []
    assert queue.queued_bytes == 0 and not queue.out and not queue.fill()


def test_push_first_takes_a_whole_unit_at_once():
    queue = SendQueue(batch_bytes=1 << 20)
    assert queue.idle
    queue.push_first(1, Raw(b"xxxx"), token="t")
    assert not queue.idle and list(queue.out) == [b"xxxx"] and queue.queued_bytes == 4
    queue.fill()
    assert list(queue.out) == [b"xxxx"]  # nothing else was queued
    assert queue.consume(4) == ["t"]
    assert queue.idle and queue.queued_bytes == 0


def test_push_first_fills_on_from_a_unit_of_many_takes():
    queue = SendQueue(batch_bytes=100)
    queue.push_first(1, Chunks(b"a", [60, 60, 60]), token="t")
    assert sum(len(b) for b in queue.out) == 180  # the first take, then a batch as fill() takes
    queue.push(2, Raw(b"b"))
    sent, done = _drain(queue)
    assert sent == b"a" * 180 + b"b" and done == ["t"]


#: Sources (a virtual connection and the sizes of its chunks), the bytes the
#: fabric accepts per call, and the batch size.
_TRAFFIC = given(
    st.lists(
        st.tuples(st.integers(0, 3), st.lists(st.integers(1, 50), min_size=1, max_size=4)),
        max_size=12,
    ),
    st.integers(1, 64),
    st.integers(1, 100),
)


@settings(max_examples=200, deadline=None)
@_TRAFFIC
def test_every_byte_and_token_arrives_exactly_once(sources, accept, batch):
    queue = SendQueue(batch_bytes=batch)
    expected: dict[int, bytes] = {}
    for i, (vc, sizes) in enumerate(sources):
        tag = bytes([65 + i])
        queue.push(vc, Chunks(tag, sizes), token=i)
        expected[vc] = expected.get(vc, b"") + tag * sum(sizes)
    sent, done = _drain(queue, accept)
    assert sorted(done) == list(range(len(sources)))
    assert queue.queued_bytes == 0
    # Per vc, its bytes come out in order (tags are unique per source).
    for data in expected.values():
        tags = set(data)
        assert bytes(b for b in sent if b in tags) == data


@settings(max_examples=200, deadline=None)
@_TRAFFIC
def test_posting_as_a_device_does_sends_every_byte_and_token_once(sources, accept, batch):
    """A device posts: push_first on an idle queue, push otherwise, and the
    fabric takes up to ``accept`` bytes after each post."""
    queue = SendQueue(batch_bytes=batch)
    expected: dict[int, bytes] = {}
    sent, done = b"", []

    def send() -> None:
        nonlocal sent
        n = min(accept, sum(len(b) for b in queue.out))
        sent += b"".join(bytes(b) for b in queue.out)[:n]
        for token in queue.consume(n):
            # Back only once the last byte of its source has been sent.
            assert sent.count(65 + token) == sum(sources[token][1])
            done.append(token)

    for i, (vc, sizes) in enumerate(sources):
        tag = bytes([65 + i])
        if queue.idle:
            queue.push_first(vc, Chunks(tag, sizes), token=i)
        else:
            queue.push(vc, Chunks(tag, sizes), token=i)
        expected[vc] = expected.get(vc, b"") + tag * sum(sizes)
        if queue.out or queue.fill():
            send()
    while queue.out or queue.fill():
        send()
    assert sorted(done) == list(range(len(sources)))
    assert queue.queued_bytes == 0 and queue.idle
    for data in expected.values():
        tags = set(data)
        assert bytes(b for b in sent if b in tags) == data
