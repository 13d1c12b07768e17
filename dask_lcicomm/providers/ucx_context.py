"""The process's UCX context.

UCX reads its configuration once per process, when its context opens; every
worker of the process is made from that context.
"""

from __future__ import annotations

import asyncio
import functools
import threading
from typing import Any

from dask_lcicomm.config import Settings
from dask_lcicomm.providers.registry import ProviderUnavailable
from dask_lcicomm.providers.ucx_options import UcxOptions


@functools.cache
def bindings() -> Any:
    """The ucxx bindings, imported on first use (``ImportError`` without them)."""
    import ucxx._lib.libucxx as ucx

    return ucx


@functools.cache
def _array_type() -> Any:
    from ucxx._lib.arr import Array

    return Array


def array(buffer: Any) -> Any:
    """``buffer`` as ucxx takes it."""
    return _array_type()(buffer)


@functools.cache
def any_tag() -> tuple[Any, Any]:
    """The tag and mask that match every message."""
    return bindings().UCXXTag(0), bindings().UCXXTagMask(0)


class _Context:
    """The process's UCX context, created on first use and kept: UCX reads
    its configuration (``UCX_TLS``, ``UCX_NET_DEVICES``, ``ucx.options``)
    once, when it opens."""

    _lock = threading.Lock()
    _context: Any = None
    _error: str | None = None

    @classmethod
    def get(cls) -> Any:
        with cls._lock:
            if cls._context is None and cls._error is None:
                options: dict[str, str] = {}
                try:
                    ucx = bindings()
                    options = UcxOptions.of(Settings.from_config()).context_options()
                    cls._context = ucx.UCXContext(
                        options, feature_flags=(ucx.Feature.TAG, ucx.Feature.WAKEUP)
                    )
                except ImportError as e:
                    cls._error = f"ucxx is not installed (pip install 'dask-lcicomm[ucx]'): {e}"
                except Exception as e:
                    given = f" with options {options}" if options else ""
                    cls._error = f"UCX cannot open the fabric{given}: {type(e).__name__}: {e}"
            if cls._error is not None:
                raise ProviderUnavailable(cls._error)
            return cls._context


def unavailable() -> str | None:
    """Why this process cannot use UCX at all, or None."""
    try:
        _Context.get()
    except ProviderUnavailable as e:
        return str(e)
    return None


@functools.cache
def setup_errors() -> tuple[type[BaseException], ...]:
    """What making an endpoint may raise when the peer or UCX cannot do it:
    each means "not over UCX with this peer", never a crash."""
    return (OSError, ValueError, asyncio.TimeoutError, bindings().UCXError)


def new_worker() -> Any:
    worker = bindings().UCXWorker(_Context.get())
    worker.init_blocking_progress_mode()
    return worker
