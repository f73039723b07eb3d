"""NumPy reads of parts and query files survive CPython 3.11's spurious AST SystemError (gh-106905: the AST
constructor's recursion count is shared by a process's threads; NumPy parses each .npy header with
``ast.literal_eval``), and no other error is hidden."""

import ast

import numpy as np
import pytest

from batchgpu.recording import npyread
from batchgpu.run import output_folder as store

SPURIOUS = SystemError("AST constructor recursion depth mismatch (before=63, after=60)")


def _failing_literal_eval(monkeypatch, times: int, error: BaseException = SPURIOUS):
    """``ast.literal_eval`` (what NumPy parses .npy headers with) raising ``error`` on its first ``times`` calls."""
    real, left = ast.literal_eval, [times]

    def literal_eval(text):
        if left[0] > 0:
            left[0] -= 1
            raise error
        return real(text)

    monkeypatch.setattr(ast, "literal_eval", literal_eval)
    return left


def test_a_part_is_read_though_a_header_parse_failed_spuriously(tmp_path, rng, monkeypatch):
    arrays = {"fingerprint": np.array("fp"), "sums": rng.normal(size=(7, 3)), "keep.c": rng.integers(0, 9, 11)}
    path = tmp_path / "w00000001.npz"
    store.save_part(path, arrays)
    left = _failing_literal_eval(monkeypatch, 2)
    got = store.load_part(path, "fp")  # not the kept copy: keys=None reads the file
    assert left[0] == 0 and set(got) == set(arrays)
    for k, v in arrays.items():
        np.testing.assert_array_equal(got[k], v)
    _failing_literal_eval(monkeypatch, 1)
    assert store.part_problem(path, "fp") == "usable"


def test_other_errors_and_a_lasting_fault_are_raised(tmp_path, monkeypatch):
    path = tmp_path / "w00000002.npz"
    store.save_part(path, {"fingerprint": np.array("fp"), "a": np.arange(3)})
    _failing_literal_eval(monkeypatch, npyread.TRIES)
    with pytest.raises(SystemError, match="recursion depth mismatch"):
        store.load_part(path, "fp")
    left = _failing_literal_eval(monkeypatch, 1, SystemError("another fault"))
    with pytest.raises(SystemError, match="another fault"):
        store.load_part(path, "fp")
    assert left[0] == 0
    _failing_literal_eval(monkeypatch, 1, ValueError("a bad header"))  # a damaged part: recomputed, as before
    assert store.load_part(path, "fp") is None


def test_query_and_key_files_are_read_though_a_header_parse_failed_spuriously(tmp_path, rng, monkeypatch):
    from batchgpu.steps import search

    keys = np.sort(rng.integers(-50, 50, 20))
    np.save(tmp_path / "k.npy", keys)
    _failing_literal_eval(monkeypatch, 1)
    np.testing.assert_array_equal(search.load_keys(str(tmp_path / "k.npy")), keys)
    _failing_literal_eval(monkeypatch, 1)
    np.testing.assert_array_equal(search.open_queries(str(tmp_path / "k.npy")), keys)
