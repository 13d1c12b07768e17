"""pytest plugin: run distributed's own test suite over Dask's default comm scheme.

Load it with ``-p lci_scheme`` (this directory on ``sys.path``) and choose the
scheme with Dask's own setting, ``DASK_DISTRIBUTED__COMM__DEFAULT_SCHEME=lci``
in the environment. The environment, not a pytest option, because Dask reads
it when it is first imported, before ``distributed.utils_test`` snapshots the
configuration that every test is reset to, and because the worker processes
that nannies spawn inherit it.

Tests that give no scheme end up on the default one through
``parse_address()``. Two places in distributed 2026.7.1 do not consult it and
are patched here, only when the scheme is not ``tcp``, each to do exactly what
it does for ``tcp`` with the chosen scheme instead:

- ``distributed.comm.core.listen()`` turns an address without a scheme into a
  literal ``tcp://`` (``tls://`` with an SSL context) instead of asking
  ``parse_address()``. Every ``Server.listen()`` goes through it, so without
  the patch a ``Scheduler(host="127.0.0.1")`` (as ``gen_cluster`` makes) would
  listen on TCP whatever the default. The patch prefixes the default scheme
  when there is no SSL context; names bound to the function by
  ``from ... import listen`` in distributed's modules are rebound too.
- ``LocalCluster.__init__`` picks ``protocol="tcp://"`` when it is given no
  protocol and the cluster is neither TLS-only nor in-process. The patch passes
  the default scheme in that one case only; in-process clusters keep
  ``inproc://`` and encrypted ones ``tls://``, as upstream.

The run stops at configuration if the scheme has no backend, and the report
header shows where ``distributed`` and the backend were imported from.
"""

from __future__ import annotations

import functools
import inspect
import logging
import sys
from typing import Any

import dask
import pytest

logger = logging.getLogger(__name__)


def default_scheme() -> str:
    """The scheme that tests without an explicit one should use."""
    return str(dask.config.get("distributed.comm.default-scheme"))


def _patch_listen(scheme: str) -> list[str]:
    """Make scheme-less ``listen()`` addresses follow ``scheme``; returns the
    names rebound, for the report header."""
    import distributed.comm.core

    original = distributed.comm.core.listen

    @functools.wraps(original)
    def listen(addr: Any, handle_comm: Any, deserialize: bool = True, **kwargs: Any) -> Any:
        if isinstance(addr, str) and "://" not in addr and not kwargs.get("ssl_context"):
            addr = f"{scheme}://{addr}"
        return original(addr, handle_comm, deserialize, **kwargs)

    rebound = []
    for name, module in list(sys.modules.items()):
        if name.partition(".")[0] == "distributed" and getattr(module, "listen", None) is original:
            module.listen = listen  # type: ignore[attr-defined]
            rebound.append(f"{name}.listen")
    return rebound


def _patch_local_cluster(scheme: str) -> None:
    """Default ``LocalCluster(protocol=None)`` to ``scheme`` where upstream
    would default it to ``tcp://``."""
    from distributed import LocalCluster, Nanny
    from distributed.security import Security

    original = LocalCluster.__init__
    signature = inspect.signature(original)

    def would_be_tcp(args: dict[str, Any]) -> bool:
        # Mirrors the protocol choice in LocalCluster.__init__ (2026.7.1).
        if args.get("protocol") is not None:
            return False
        host = args.get("host") or args.get("ip")
        if host and "://" in host:
            return False
        security = args.get("security")
        if security is True:
            return False
        if security is None:
            security = Security()
        if isinstance(security, Security) and security.require_encryption:
            return False
        processes = args.get("processes")
        if processes is None:
            worker_class = args.get("worker_class")
            processes = worker_class is None or issubclass(worker_class, Nanny)
        return bool(processes or args.get("scheduler_port", 0))

    @functools.wraps(original)
    def __init__(self: LocalCluster, *args: Any, **kwargs: Any) -> None:
        bound = signature.bind(self, *args, **kwargs)
        if would_be_tcp(bound.arguments):
            kwargs["protocol"] = f"{scheme}://"
        original(self, *args, **kwargs)

    LocalCluster.__init__ = __init__  # type: ignore[method-assign]


_header: list[str] = []


@pytest.hookimpl(trylast=True)
def pytest_configure(config: pytest.Config) -> None:
    import distributed
    from distributed.comm.registry import get_backend

    scheme = default_scheme()
    try:
        backend = get_backend(scheme)
    except Exception as e:
        raise pytest.UsageError(f"default scheme {scheme!r} has no comm backend: {e!r}") from e
    module = sys.modules[type(backend).__module__]
    _header.append(
        f"default scheme: {scheme} (backend {type(backend).__qualname__} from "
        f"{getattr(module, '__file__', '?')}); distributed {distributed.__version__} "
        f"from {distributed.__file__}"
    )
    if scheme != "tcp":
        rebound = _patch_listen(scheme)
        _patch_local_cluster(scheme)
        _header.append(f"patched for {scheme}: {', '.join(rebound)}, LocalCluster.__init__")
    logger.debug("%s", "; ".join(_header))


def pytest_report_header(config: pytest.Config) -> list[str]:
    return list(_header)
