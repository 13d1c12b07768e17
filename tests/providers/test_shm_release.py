"""The event loop's releaser: kept per loop, and gone with its loop."""

from __future__ import annotations

import asyncio
import gc

from dask_lcicomm.providers import frame_memory, shm_release


def test_a_finished_loop_leaves_neither_its_releaser_nor_its_frame_memory():
    async def use() -> None:
        assert shm_release.releaser(1.0) is shm_release.releaser(1.0)
        frame_memory.frame_memory(1.0)

    gc.collect()
    before = (len(shm_release._releasers), len(frame_memory._memories))
    for _ in range(3):
        asyncio.run(use())
    gc.collect()
    assert (len(shm_release._releasers), len(frame_memory._memories)) == before
