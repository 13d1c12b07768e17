"""Tests of :mod:`dask_lcicomm.parcel.wire`: the control units, sequence
numbers and interleaving of virtual connections, and one explicit test per
protocol rule (each a stream the decoder must refuse). Helpers: ``_streams``.
"""

from __future__ import annotations

import pytest
from _streams import (
    P_GROUPS,
    feed_buffered,
    hdr,
    norm,
    raw_fragment,
    raw_parcel,
    raw_placed,
    table,
)

from dask_lcicomm.parcel import (
    BULK,
    MAX_HELLO_BYTES,
    MAX_VC,
    SHARE,
    Close,
    Connect,
    Hello,
    Kind,
    OutgoingParcel,
    ParcelDecoder,
    ProtocolError,
    encode_close,
    encode_connect,
    encode_hello,
    encode_parcel,
)

# ---------------------------------------------------------------------------
# Control units
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("payload", [b"", b"\x00", bytes(range(256)), b"p" * MAX_HELLO_BYTES])
def test_hello_roundtrip(payload):
    dec = ParcelDecoder(buffer_size=64)
    assert dec.feed(encode_hello(payload)) == [Hello(payload)]
    assert dec.idle


def test_encode_hello_too_large():
    with pytest.raises(ValueError, match="too large"):
        encode_hello(b"p" * (MAX_HELLO_BYTES + 1))


@pytest.mark.parametrize("vc", [0, 1, 12345, MAX_VC])
def test_extreme_vcs_roundtrip(vc):
    data = encode_connect(vc) + encode_parcel(vc, 0, [b"a" * 50], 4, 7) + encode_close(vc)
    assert norm(ParcelDecoder().feed(data)) == [("connect", vc), ("msg", vc, 0, [b"a" * 50]), ("close", vc)]


# ---------------------------------------------------------------------------
# Sequence numbers and connection lifecycle
# ---------------------------------------------------------------------------

def test_seq_numbers_per_vc_and_reset_on_reconnect():
    data = (
        encode_connect(1)
        + encode_connect(2)
        + encode_parcel(1, 0, [b"a"], 8, 8)
        + encode_parcel(2, 0, [b"b"], 8, 8)
        + encode_parcel(1, 1, [b"c"], 8, 8)
        + encode_close(1)
        + encode_connect(1)
        + encode_parcel(1, 0, [b"d"], 8, 8)
    )
    events = norm(ParcelDecoder().feed(data))
    msgs = [e for e in events if e[0] == "msg"]
    assert msgs == [
        ("msg", 1, 0, [b"a"]),
        ("msg", 2, 0, [b"b"]),
        ("msg", 1, 1, [b"c"]),
        ("msg", 1, 0, [b"d"]),
    ]


def test_small_message_overtakes_large_one_on_other_vc():
    big = b"B" * 1000
    p1 = OutgoingParcel(1, 0, [big], 16, 100)
    out = encode_connect(1) + encode_connect(2)
    out += b"".join(bytes(b) for b in p1.next_unit())  # head of the big one
    out += b"".join(bytes(b) for b in p1.next_unit())  # one fragment
    out += encode_parcel(2, 0, [b"tiny"], 16, 100)
    dec = ParcelDecoder()
    assert norm(dec.feed(out)) == [("connect", 1), ("connect", 2), ("msg", 2, 0, [b"tiny"])]
    assert not dec.idle
    with pytest.raises(ProtocolError):
        dec.check_eof()
    rest = bytearray()
    while not p1.done:
        for b in p1.next_unit():
            rest += b
    assert norm(dec.feed(rest)) == [("msg", 1, 0, [big])]
    assert dec.idle


# ---------------------------------------------------------------------------
# Protocol rules, one by one
# ---------------------------------------------------------------------------

C1 = encode_connect(1)
P_BULK2 = raw_parcel(1, 0, [3, BULK | 10, BULK | 4], b"abc")  # frames 1 and 2 are bulk, in two groups


RULES = [
    # (id, valid prefix, offending bytes, error message pattern)
    ("parcel-seq-skipped", C1, raw_parcel(1, 1, [1], b"x"), r"parcel 1 on vc 1 out of order \(expected 0\)"),
    ("parcel-seq-repeated", C1 + raw_parcel(1, 0, [1], b"x"), raw_parcel(1, 0, [1], b"x"),
     r"parcel 0 on vc 1 out of order \(expected 1\)"),
    ("parcel-while-incomplete", C1 + P_BULK2, raw_parcel(1, 1, [1], b"x"), r"out of order"),
    ("fragment-unknown-vc", C1, raw_fragment(1, 0, 0, 0, b"abc"), r"fragment for unknown parcel 0 on vc 1"),
    ("fragment-after-complete", C1 + raw_parcel(1, 0, [1], b"x"), raw_fragment(1, 0, 0, 0, b"abc"),
     r"fragment for unknown parcel"),
    ("fragment-wrong-seq", C1 + P_BULK2, raw_fragment(1, 1, 1, 0, b"a" * 10),
     r"fragment for unknown parcel 1"),
    ("fragment-wrong-vc", C1 + encode_connect(2) + P_BULK2, raw_fragment(2, 0, 1, 0, b"a" * 10),
     r"unknown parcel 0 on vc 2"),
    ("fragment-eager-index", C1 + P_BULK2, raw_fragment(1, 0, 0, 0, b"a" * 3),
     r"fragment 0@0\+3 does not continue"),
    ("fragment-index-ahead", C1 + P_BULK2, raw_fragment(1, 0, 2, 0, b"a" * 4),
     r"does not continue parcel 0 on vc 1"),
    ("fragment-index-out-of-range", C1 + P_BULK2, raw_fragment(1, 0, 99, 0, b"a"), r"does not continue"),
    ("fragment-offset-ahead", C1 + P_BULK2, raw_fragment(1, 0, 1, 5, b"a" * 5),
     r"fragment 1@5\+5 does not continue"),
    ("fragment-offset-repeated", C1 + P_BULK2 + raw_fragment(1, 0, 1, 0, b"a" * 5),
     raw_fragment(1, 0, 1, 0, b"a" * 5), r"does not continue"),
    ("fragment-offset-behind", C1 + P_BULK2 + raw_fragment(1, 0, 1, 0, b"a" * 5),
     raw_fragment(1, 0, 1, 4, b"a" * 6), r"does not continue"),
    ("fragment-empty", C1 + P_BULK2, raw_fragment(1, 0, 1, 0, b""), r"fragment 1@0\+0 does not continue"),
    ("fragment-overruns-frame", C1 + P_BULK2, raw_fragment(1, 0, 1, 0, b"a" * 11), r"does not continue"),
    ("fragment-next-frame-early", C1 + P_BULK2 + raw_fragment(1, 0, 1, 0, b"a" * 5),
     raw_fragment(1, 0, 2, 0, b"a" * 4), r"does not continue"),
    ("connect-twice", C1, encode_connect(1), r"CONNECT for open vc 1"),
    ("connect-while-incomplete", C1 + P_BULK2, encode_connect(1),
     r"CONNECT on vc 1 while a parcel is incomplete"),
    ("close-while-incomplete", C1 + P_BULK2, encode_close(1), r"CLOSE on vc 1 while a parcel is incomplete"),
    ("close-while-incomplete-midway", C1 + P_BULK2 + raw_fragment(1, 0, 1, 0, b"a" * 10), encode_close(1),
     r"CLOSE on vc 1 while a parcel is incomplete"),
    ("flags-connect", b"", hdr(Kind.CONNECT, 1, flags=1), r"reserved flags set: 0x1"),
    ("flags-hello", b"", hdr(Kind.HELLO, flags=0x8000), r"reserved flags set: 0x8000"),
    ("flags-parcel", C1, hdr(Kind.PARCEL, 1, 0, 1, flags=2) + table(1) + b"x", r"reserved flags"),
    ("flags-fragment", C1 + P_BULK2, hdr(Kind.FRAGMENT, 1, 0, 1, flags=4), r"reserved flags"),
    ("flags-close", C1, hdr(Kind.CLOSE, 1, flags=0xFFFF), r"reserved flags"),
    ("bad-magic", b"", hdr(Kind.CONNECT, 1, magic=b"HTTP"), r"bad magic b'HTTP'"),
    ("bad-magic-later", C1, hdr(Kind.CONNECT, 2, magic=b"LCIQ"), r"bad magic"),
    ("bad-magic-http", b"", b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", r"bad magic b'GET '"),
    ("version-0", b"", hdr(Kind.CONNECT, 1, version=0), r"unsupported protocol version 0"),
    ("version-1", b"", hdr(Kind.CONNECT, 1, version=1), r"unsupported protocol version 1"),
    ("version-3", b"", hdr(Kind.CONNECT, 1, version=3), r"unsupported protocol version 3"),
    ("version-255", C1, hdr(Kind.CONNECT, 1, version=255), r"unsupported protocol version 255"),
    ("kind-0", b"", hdr(0, 1), r"unknown parcel kind 0"),
    ("kind-7", b"", hdr(7, 1), r"unknown parcel kind 7"),
    ("placed-without-shared-memory", C1 + P_BULK2, raw_placed(1, 0, 1, 0, 0, 10),
     r"placed group on a connection without shared memory"),
    ("placed-unknown-parcel", C1, raw_placed(1, 0, 1, 0, 0, 10),
     r"placed group for unknown parcel 0 on vc 1"),
    ("placed-wrong-seq", C1 + P_BULK2, raw_placed(1, 3, 1, 0, 0, 10), r"placed group for unknown parcel 3"),
    ("flags-placed", C1 + P_BULK2, hdr(Kind.PLACED, 1, 0, 1, flags=1), r"reserved flags"),
    ("kind-255", C1, hdr(255, 1), r"unknown parcel kind 255"),
    ("hello-too-large", b"", hdr(Kind.HELLO, 0, 0, MAX_HELLO_BYTES + 1), r"malformed hello of 65537 bytes"),
    ("hello-with-vc", b"", hdr(Kind.HELLO, 1, 0, 0), r"malformed hello"),
    ("hello-with-seq", b"", hdr(Kind.HELLO, 0, 1, 0), r"malformed hello"),
    ("connect-with-count", b"", hdr(Kind.CONNECT, 1, 0, 1), r"malformed CONNECT for vc 1"),
    ("connect-with-seq", b"", hdr(Kind.CONNECT, 1, 1, 0), r"malformed CONNECT"),
    ("close-with-count", C1, hdr(Kind.CLOSE, 1, 0, 4), r"malformed CLOSE for vc 1"),
    ("close-with-seq", C1, hdr(Kind.CLOSE, 1, 9, 0), r"malformed CLOSE"),
    ("empty-bulk-frame", C1, raw_parcel(1, 0, [5, BULK | 0], b"abcde"), r"empty bulk frame 1"),
    ("empty-bulk-frame-only", C1, raw_parcel(1, 0, [BULK]), r"empty bulk frame 0"),
    # receive buffers: a group starts with a frame without SHARE, and is all eager or all bulk
    ("empty-shared-frame", C1, raw_parcel(1, 0, [3, SHARE], b"abc"), r"empty shared frame 1"),
    ("empty-shared-frame-only", C1, raw_parcel(1, 0, [SHARE]), r"empty shared frame 0"),
    ("empty-bulk-shared-frame", C1, raw_parcel(1, 0, [3, BULK | SHARE], b"abc"), r"empty bulk frame 1"),
    ("share-on-first-frame", C1, raw_parcel(1, 0, [SHARE | 3], b"abc"),
     r"frame 0 shares the buffer of no earlier frame"),
    ("share-on-first-frames", C1, raw_parcel(1, 0, [SHARE | 3, SHARE | 1], b"abcd"),
     r"frame 0 shares the buffer of no earlier frame"),
    ("share-on-first-bulk-frame", C1, raw_parcel(1, 0, [BULK | SHARE | 3]),
     r"frame 0 shares the buffer of no earlier frame"),
    ("share-on-first-nonempty-frame", C1, raw_parcel(1, 0, [0, 0, SHARE | 3], b"abc"),
     r"frame 2 shares the buffer of no earlier frame"),
    ("share-bulk-with-eager", C1, raw_parcel(1, 0, [3, BULK | SHARE | 4], b"abc"),
     r"frame 1 shares a buffer across eager and bulk frames"),
    ("share-eager-with-bulk", C1, raw_parcel(1, 0, [BULK | 4, SHARE | 3], b"abc"),
     r"frame 1 shares a buffer across eager and bulk frames"),
    ("share-across-empty-frame", C1, raw_parcel(1, 0, [3, 0, BULK | SHARE | 4], b"abc"),
     r"frame 2 shares a buffer across eager and bulk frames"),
    ("share-mixed-in-later-group", C1, raw_parcel(1, 0, [BULK | 4, 2, SHARE | 1, BULK | SHARE | 3], b"abc"),
     r"frame 3 shares a buffer across eager and bulk frames"),
    ("share-mixed-in-long-group", C1, raw_parcel(1, 0, [1, *[SHARE | 1] * 40, BULK | SHARE | 1], b"a" * 41),
     r"frame 41 shares a buffer across eager and bulk frames"),
    # fragments follow the bulk groups frame by frame, skipping empty frames
    ("fragment-group-member-first", C1 + P_GROUPS, raw_fragment(1, 0, 2, 0, b"a" * 4), r"does not continue"),
    ("fragment-next-group-early", C1 + P_GROUPS + raw_fragment(1, 0, 1, 0, b"a" * 10),
     raw_fragment(1, 0, 4, 0, b"a" * 5), r"fragment 4@0\+5 does not continue"),
    ("fragment-empty-frame", C1 + P_GROUPS + raw_fragment(1, 0, 1, 0, b"a" * 10)
     + raw_fragment(1, 0, 2, 0, b"b" * 4), raw_fragment(1, 0, 3, 0, b"a"),
     r"fragment 3@0\+1 does not continue"),
    ("fragment-empty-frame-empty", C1 + P_GROUPS + raw_fragment(1, 0, 1, 0, b"a" * 10)
     + raw_fragment(1, 0, 2, 0, b"b" * 4), raw_fragment(1, 0, 3, 0, b""), r"does not continue"),
    ("fragment-group-overrun", C1 + P_GROUPS, raw_fragment(1, 0, 1, 0, b"a" * 14), r"does not continue"),
    ("fragment-after-last-group", C1 + P_BULK2 + raw_fragment(1, 0, 1, 0, b"a" * 10)
     + raw_fragment(1, 0, 2, 0, b"b" * 3), raw_fragment(1, 0, 3, 0, b"c"), r"does not continue"),
]


@pytest.mark.parametrize("prefix, bad, match", [pytest.param(*r[1:], id=r[0]) for r in RULES])
def test_protocol_rule(prefix, bad, match):
    # the valid prefix decodes fine, whole or byte by byte
    ParcelDecoder().feed(prefix)
    # the violation raises, whole ...
    dec = ParcelDecoder()
    with pytest.raises(ProtocolError, match=match):
        dec.feed(prefix + bad)
    # ... and byte by byte, no later than the end of the offending unit
    dec = ParcelDecoder(buffer_size=16)
    dec.feed(prefix)
    with pytest.raises(ProtocolError, match=match):
        for i in range(len(bad)):
            dec.feed(bad[i : i + 1])
    # and through the BufferedProtocol interface with a small buffer
    dec = ParcelDecoder(buffer_size=24)
    with pytest.raises(ProtocolError, match=match):
        feed_buffered(dec, prefix + bad)


def test_protocol_error_is_a_value_error():
    assert issubclass(ProtocolError, ValueError)


def test_close_of_unknown_vc_then_connect():
    # CLOSE of a vc that is not open is tolerated (idempotent close)
    events = ParcelDecoder().feed(encode_close(4) + encode_connect(4) + encode_close(4))
    assert events == [Close(4), Connect(4), Close(4)]
