"""resume.split_events: a stream read in arbitrary pieces comes out as whole events only,
every byte once, in order; what is left is the start of an event not yet complete."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from epdctl.proxy.stages.resume import split_events

ENDS = (b"\n\n", b"\r\n\r\n", b"\n\r\n")


def test_no_complete_event_leaves_everything():
    for buf in (b"", b"d", b"da", b'data: {"a": 1}', b'data: {"a": 1}\n', b"data: x\r\n"):
        assert split_events(buf) == (b"", buf)


def test_whole_events_up_to_the_last_end():
    assert split_events(b"data: a\n\ndata: b\n\ndata: c") == (b"data: a\n\ndata: b\n\n",
                                                           b"data: c")
    assert split_events(b"data: a\r\n\r\ndata: b") == (b"data: a\r\n\r\n", b"data: b")


@given(st.lists(st.tuples(st.binary(max_size=20).filter(lambda b: b"\n" not in b),
                          st.sampled_from(ENDS)), max_size=8),
       st.lists(st.integers(min_value=0, max_value=200), max_size=12))
def test_any_reads_give_whole_events_every_byte_once(events, cuts):
    stream = b"".join(b"data: " + data + end for data, end in events)
    bounds = sorted({min(c, len(stream)) for c in cuts} | {0, len(stream)})
    out: list[bytes] = []
    tail = b""
    for start, stop in zip(bounds, bounds[1:], strict=False):
        whole, tail = split_events(tail + stream[start:stop])
        assert whole == b"" or whole.endswith(ENDS), whole
        out.append(whole)
    assert b"".join(out) + tail == stream
    assert tail == b""  # the stream ended with a whole event: nothing is held back
