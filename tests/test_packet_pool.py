"""The packet pool: decoders hold a receive buffer only while bytes in it
wait to be parsed, and a process keeps a bounded number of spare ones."""

from __future__ import annotations

from dask_lcicomm.packet_pool import KEEP, PacketPool
from dask_lcicomm.parcel import ParcelDecoder, encode_parcel


def test_buffers_are_reused_up_to_a_bound():
    pool = PacketPool(1024, keep=2)
    buffers = [pool.take() for _ in range(3)]
    assert [len(b) for b in buffers] == [1024] * 3
    for buffer in buffers:
        pool.give(buffer)
    assert {id(pool.take()), id(pool.take())} <= {id(b) for b in buffers[:2]}
    pool.give(bytearray(10))  # another size is not kept
    assert len(pool.take()) == 1024


def test_a_decoder_holds_a_buffer_only_between_the_bytes_of_a_message():
    decoder = ParcelDecoder(buffer_size=4096 + 7)
    pool = decoder._pool
    parcel = encode_parcel(1, 0, [b"head", b"x" * 100], 1024, 1024)
    pool._free.clear()
    decoder.feed(parcel[:30])
    assert decoder._buf is not None  # half a message waits in it
    [message] = decoder.feed(parcel[30:])
    assert decoder._buf is None and len(pool._free) == 1  # given back
    assert [bytes(f) for f in message.frames] == [b"head", b"x" * 100]
    # the frames are copies: reusing the buffer changes none of them
    pool._free[0][:] = bytes(len(pool._free[0]))
    assert [bytes(f) for f in message.frames] == [b"head", b"x" * 100]


def test_many_quiet_decoders_share_a_few_buffers():
    decoders = [ParcelDecoder(buffer_size=4096 + 11) for _ in range(100)]
    pool = decoders[0]._pool
    for seq, decoder in enumerate(decoders):
        decoder.feed(encode_parcel(1, 0, [b"m" * seq], 1024, 1024))
    assert all(decoder._buf is None for decoder in decoders)
    assert len(pool._free) <= KEEP


def test_a_read_that_found_nothing_gives_the_buffer_back():
    decoder = ParcelDecoder(buffer_size=4096 + 13)
    pool = decoder._pool
    pool._free.clear()
    decoder.get_buffer()  # a device reads into it; the read would block
    decoder.read_nothing()
    assert decoder._buf is None and len(pool._free) == 1
    parcel = encode_parcel(1, 0, [b"head", b"x" * 100], 1024, 1024)
    view = decoder.get_buffer()
    view[:30] = parcel[:30]
    assert decoder.buffer_updated(30) == []
    decoder.read_nothing()  # half a message waits: the buffer stays
    assert decoder._buf is not None and not pool._free
