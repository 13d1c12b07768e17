"""The UCX provider: one-sided puts over the fabric UCX drives (InfiniBand,
RoCE; TCP and shared memory where that is all there is; not Slingshot 11,
EFA or Omni-Path, which only libfabric drives).

One UCX worker per progress engine serves every ucx device of it: the
worker is the endpoint of a message fabric (:mod:`.ucx_worker` implements
its verbs; :mod:`.message_fabric` routes, :mod:`.message_device` and
:mod:`.message_provider` do the rest, as for any message fabric), and a
device is one UCX endpoint of it.
"""

from __future__ import annotations

import asyncio

from dask_lcicomm.providers import ucx_context
from dask_lcicomm.providers.base import Progress
from dask_lcicomm.providers.message_provider import MessageProvider
from dask_lcicomm.providers.ucx_options import SECTION
from dask_lcicomm.providers.ucx_worker import UcxWorker


class UcxProvider(MessageProvider):
    """UCX with a peer whose listener offers it and that UCX can reach."""

    name = "ucx"
    section = SECTION

    def unavailable(self) -> str | None:
        return ucx_context.unavailable()

    def make_fabric(self, loop: asyncio.AbstractEventLoop, progress: Progress) -> UcxWorker:
        return UcxWorker(loop, progress)


PROVIDER = UcxProvider()
