"""The ofi provider: one-sided puts over the fabrics libfabric drives, the
only ones on HPE Slingshot 11 (cxi), AWS EFA (efa) and Cornelis Omni-Path
(opx, psm2), and InfiniBand, RoCE (verbs) or TCP besides.

One libfabric endpoint per progress engine serves every ofi device of it
(:mod:`.ofi_fabric` implements the message-fabric verbs; the rest is the
same as for any message fabric). The extension that calls libfabric
(``_ofi``) is built when the package is installed where libfabric's headers
and library are found; without it the provider is unavailable.
"""

from __future__ import annotations

import asyncio
import functools

from dask_lcicomm.config import Settings
from dask_lcicomm.providers.base import Progress
from dask_lcicomm.providers.message_fabric import MessageFabric
from dask_lcicomm.providers.message_provider import MessageProvider
from dask_lcicomm.providers.ofi_options import SECTION, OfiOptions


@functools.cache
def _unavailable(options: OfiOptions) -> str | None:
    """Why no endpoint opens with ``options`` in this process, or None."""
    try:
        from dask_lcicomm.providers.ofi_fabric import open_endpoint
    except ModuleNotFoundError as e:
        return (f"the libfabric extension was not built ({e}); install libfabric's headers "
                "(Debian: libfabric-dev) and reinstall dask-lcicomm")
    except ImportError as e:
        return f"{e}; put the directory of libfabric.so.1 on LD_LIBRARY_PATH"
    try:
        open_endpoint(options).close()
    except OSError as e:
        asked = f" with provider {options.provider!r}" if options.provider else ""
        return f"libfabric opens no endpoint{asked}: {e.strerror}"
    return None


class OfiProvider(MessageProvider):
    """libfabric with a peer whose listener offers it and that it can reach."""

    name = "ofi"
    section = SECTION

    def unavailable(self) -> str | None:
        return _unavailable(OfiOptions.of(Settings.from_config()))

    def make_fabric(self, loop: asyncio.AbstractEventLoop, progress: Progress) -> MessageFabric:
        from dask_lcicomm.providers.ofi_fabric import OfiFabric

        return OfiFabric(loop, progress)


PROVIDER = OfiProvider()
