"""Which sampled threads carry the comm, whichever way py-spy labels them."""

from __future__ import annotations

from benchmarks.budget import _comm_thread_stacks

PID = 4242
LOOP = "select (selectors.py:468)"
PROGRESS = "_main (/site/dask_lcicomm/progress/engine.py:90)"


def test_main_thread_by_pid_or_by_name_and_progress_threads_by_their_frames():
    raw = "\n".join([
        # Python 3.11 and later: the OS thread id, the pid for the main thread.
        f"thread ({PID}): MainThread;{LOOP} 7",
        "thread (4250): ThreadPoolExecutor-0_0;wait (threading.py:320) 3",
        # Before 3.11 under --nonblocking: pthread ids in hex, never the pid.
        f"thread (0x7F21E3C40B80): MainThread;{LOOP} 5",
        f"thread (0x7F21E3C41000): lci-progress-0;{PROGRESS} 2",
        "thread (0x7F21E3C42000): Dask-Offload;wait (threading.py:320) 9",
    ])
    counts = [count for _, count in _comm_thread_stacks(raw, PID)]
    assert counts == [7, 5, 2]


def test_a_frame_name_with_a_line_break_continues_its_sample():
    raw = "\n".join([
        f"thread ({PID}): MainThread;<lambda> (<string>:1);a name that goes on",
        "over two lines. (<string>:2);" + LOOP + " 4",
        f"thread ({PID}): MainThread;{LOOP} 3",
        f"thread ({PID}): MainThread;a sample cut short without a count",
    ])
    stacks = _comm_thread_stacks(raw, PID)
    assert [count for _, count in stacks] == [4, 3]
    assert len(stacks[0][0]) == 3
