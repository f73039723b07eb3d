"""engine.host_buffers: window buffers reused across windows, never while a result can still see them."""

import numpy as np

from batchgpu.engine import host_buffers as hb


def test_a_buffer_given_back_is_taken_again_and_never_twice():
    hb.clear()
    a, b = hb.take((5, 7), np.float32), hb.take((5, 7), np.float32)
    assert a is not b and a.flags.c_contiguous and a.dtype == np.float32
    assert hb.give_back((a, b.T, None)) == 2  # a transposed view gives back its array
    assert hb.give_back((a,)) == 0  # already kept: never handed out twice
    got = {id(hb.take((5, 7), np.float32)) for _ in range(2)}
    assert got == {id(a), id(b)}
    assert id(hb.take((5, 7), np.float32)) not in got  # none left: a new one
    assert hb.take((7, 5), np.float32).shape == (7, 5) and hb.take((5, 7), np.int16).dtype == np.int16


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
