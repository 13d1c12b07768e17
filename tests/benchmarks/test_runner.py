"""The shared runner's rounds alternate the contenders."""

from __future__ import annotations

from benchmarks._runner import alternated


def test_rounds_rotate_the_contenders() -> None:
    assert [(i, "".join(c for j, c in alternated("abc", 4) if j == i)) for i in range(4)] == [
        (0, "abc"), (1, "bca"), (2, "cab"), (3, "abc")]
    assert list(alternated([], 3)) == []
