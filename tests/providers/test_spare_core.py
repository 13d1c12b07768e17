"""The free-core condition that bounds polling."""

from __future__ import annotations

from pathlib import Path

import pytest

from dask_lcicomm.providers.spare_core import SpareCore, runnable_tasks, usable_cores


def test_runnable_tasks_reads_the_fourth_field() -> None:
    assert runnable_tasks(b"0.35 0.63 0.87 3/76 711\n") == 3


@pytest.mark.parametrize("text", [b"", b"0.35 0.63 0.87", b"0.35 0.63 0.87 76 711", b"a b c x/76 1"])
def test_runnable_tasks_refuses_what_is_not_a_loadavg_line(text: bytes) -> None:
    with pytest.raises(ValueError):
        runnable_tasks(text)


def _loadavg(path: Path, running: int) -> None:
    path.write_bytes(f"0.10 0.20 0.30 {running}/100 4242\n".encode())


def test_a_core_is_spare_while_runnable_tasks_do_not_outnumber_the_cores(tmp_path: Path) -> None:
    path = tmp_path / "loadavg"
    cores = usable_cores()
    _loadavg(path, cores)
    assert SpareCore(period=0.0, path=str(path))(0.0)
    _loadavg(path, cores + 1)
    assert not SpareCore(period=0.0, path=str(path))(0.0)


def test_the_answer_is_read_again_only_after_the_period(tmp_path: Path) -> None:
    path = tmp_path / "loadavg"
    cores = usable_cores()
    _loadavg(path, cores)
    spare = SpareCore(period=1.0, path=str(path))
    assert spare(10.0)
    _loadavg(path, cores + 5)
    assert spare(10.5)  # within the period: the last reading stands
    assert not spare(11.0)
    _loadavg(path, 1)
    assert not spare(11.9)
    assert spare(12.0)


@pytest.mark.parametrize("content", [None, b"garbage\n"])
def test_without_a_reading_never_poll(tmp_path: Path, content: bytes | None) -> None:
    path = tmp_path / "loadavg"
    if content is not None:
        path.write_bytes(content)
    assert not SpareCore(period=0.0, path=str(path))(0.0)


def test_the_real_loadavg_is_readable() -> None:
    if not Path("/proc/loadavg").exists():
        pytest.skip("no /proc/loadavg on this system")
    assert runnable_tasks(Path("/proc/loadavg").read_bytes()) >= 1
