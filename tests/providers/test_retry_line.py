"""Messages the fabric answered "retry" to: posted again oldest first, never
past one it refuses again, and timed from the last one it took."""

from __future__ import annotations

import time

from dask_lcicomm.providers.retry_line import RetryLine


class _Taken:
    completed = True

    def check_error(self) -> None:
        pass


def test_messages_are_posted_in_order_until_the_fabric_refuses_one():
    line = RetryLine()
    for i in range(4):
        line.append((f"m{i}", i, 1, None))
    sent: list[tuple[int, object]] = []
    refuse = {2}

    def send(tag: int, message: object) -> _Taken | None:
        if tag in refuse:
            return None
        sent.append((tag, message))
        return _Taken()

    taken = [entry[0] for _, entry in line.post(send)]
    assert taken == ["m0", "m1"] and sent == [(0, "m0"), (1, "m1")]
    # m3 would be taken, but never passes m2.
    assert len(line) == 2
    refuse.clear()
    assert [entry[1] for _, entry in line.post(send)] == [2, 3]
    assert not line


def test_waiting_counts_from_the_first_refusal_and_restarts_when_one_is_taken():
    line = RetryLine()
    line.append((b"a", 0, 1, None))
    time.sleep(0.05)
    line.append((b"b", 1, 1, None))
    # The line waits since its first message, not its last.
    assert line.waited >= 0.05
    taken = iter([_Taken(), None])
    assert len(list(line.post(lambda tag, message: next(taken)))) == 1
    assert line.waited < 0.05 and len(line) == 1
    line.clear()
    assert not line
