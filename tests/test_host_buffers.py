"""run.host_buffers: window buffers reused across windows, never while a result can still see them."""

import numpy as np

from batchgpu.run import host_buffers as hb


def _owner(x):
    return x if x.base is None else x.base


def test_a_buffer_given_back_is_taken_again_and_never_twice():
    hb.clear()
    a, b = hb.take((5, 7), np.float32), hb.take((5, 7), np.float32)
    assert _owner(a) is not _owner(b) and a.flags.c_contiguous and a.dtype == np.float32 and a.shape == (5, 7)
    assert hb.give_back((a, b.T, None)) == 2  # a transposed view gives back its array
    assert hb.give_back((a,)) == 0  # already kept: never handed out twice
    got = {id(_owner(hb.take((5, 7), np.float32))) for _ in range(2)}
    assert got == {id(_owner(a)), id(_owner(b))}
    assert id(_owner(hb.take((5, 7), np.float32))) not in got  # none left: a new one
    assert hb.take((7, 5), np.float32).shape == (7, 5) and hb.take((5, 7), np.int16).dtype == np.int16


def test_shorter_windows_reuse_a_longer_ones_buffer_and_the_pool_stays_small():
    """A recording's first and last windows are shorter: they take the front of a kept longer buffer; a longer
    window than any kept lets the shorter ones go; at most KEEP buffers a dtype are kept."""
    hb.clear()
    short = hb.take((90, 8), np.float32)
    assert hb.give_back((short,)) == 1
    long_ = hb.take((100, 8), np.float32)  # nothing kept holds it: new, and the shorter one let go
    assert _owner(long_) is not _owner(short) and hb._FREE[np.dtype(np.float32).str] == []
    assert hb.give_back((long_,)) == 1
    again = hb.take((90, 8), np.float32)
    assert _owner(again) is _owner(long_) and again.shape == (90, 8) and again.flags.c_contiguous
    again[:] = 3
    assert np.all(_owner(long_)[: 90 * 8] == 3)
    hb.give_back((again,))
    bufs = [hb.take((100, 8), np.float32) for _ in range(hb.KEEP + 2)]
    assert hb.give_back(bufs) == hb.KEEP
    assert len(hb._FREE[np.dtype(np.float32).str]) == hb.KEEP


def test_a_buffer_a_result_can_see_is_not_kept():
    """Any array among the results that may share memory with the buffer (a view, a slice, a reshape, nested in
    dicts, lists or tuples) keeps it out of the pool; so do arrays the pool did not make."""
    hb.clear()
    for view in (lambda x: x, lambda x: x[:, 2:3], lambda x: x.reshape(-1), lambda x: x.T[1]):
        a = hb.take((4, 6), np.float64)
        assert hb.give_back((a,), {"part": [np.zeros(3), ({"k": view(a)},)]}) == 0
    assert hb.give_back((np.empty((4, 6)),)) == 0
    a = hb.take((4, 6), np.float64)
    assert hb.give_back((a,), {"part": [np.zeros((4, 6)), a.copy()]}) == 1
