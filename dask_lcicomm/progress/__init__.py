"""Completion objects and the progress engine (LCI's ``comp/`` and progress)."""

from dask_lcicomm.progress.completion import CompletionQueue, Synchronizer, make_completion
from dask_lcicomm.progress.engine import ProgressEngine

__all__ = ["CompletionQueue", "ProgressEngine", "Synchronizer", "make_completion"]
