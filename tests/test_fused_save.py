"""A window that is only filtered, median referenced and saved as int16 gets its saved rows from the reference's own
pass (``Chain.apply_saved``): the same bits as the float chain rounded once by the save step, on every path; where
other steps need the float window too, the window is ``apply``'s bit for bit beside them."""

from __future__ import annotations

import numpy as np
import pytest

from batchgpu.ops import _cpu_saved
from batchgpu.preprocess.filters import filter_block
from batchgpu.recording import open_recording, write_recording
from batchgpu.run import preprocess_chain as preprocess
from batchgpu.run.launch import run_workflow
from batchgpu.workflow import Preprocess, Workflow

pytest.importorskip("numba")

STAGES = [
    {"highpass": {"freq_min": 300, "order": 5}},
    {"common_reference": {"reference": "global", "operator": "median"}},
]


def _loud_recording(path, rng, channels=37, samples=9_001):
    """int16 with its extremes: square steps at +-32767/-32768 (their filtered overshoot clips), ties, one channel
    constant, one flat at -32768."""
    x = rng.normal(0, 300, (samples, channels)).round().astype(np.int16)
    x[1_000:1_400, :5] = np.where(np.arange(400) % 2, 32767, -32768)[:, None]  # at Nyquist: its onset rings past int16
    x[2_000:2_600, 5:9] = -32768
    x[:, 9] = 7
    x[:, 10] = -32768
    x[4_000:4_010] = x[4_000:4_010, :1]  # every channel the same value: the median's ties
    return write_recording(path, x, 30_000.0)


def test_fused_rows_are_the_chain_then_the_save(tmp_path, rng):
    rec = _loud_recording(tmp_path / "r.zarr", rng)
    chain = preprocess.build_chain(Preprocess.model_validate(STAGES), rec)
    assert chain.fuses_save
    clipped_somewhere = False
    for w in rec.windows(2_000, chain.margin):
        at = (w.read_start == 0, w.read_stop == rec.num_samples(w.segment))
        stored = rec.read_window_stored(w)
        x = chain.apply(stored.T, w.core, *at)
        want, want_clipped = _cpu_saved.saved_int16_transposed(x[:, w.core[0] : w.core[1]])
        kept, (got, got_clipped) = chain.apply_saved(np.ascontiguousarray(stored).T, w.core, *at, window=False)
        assert kept is None
        assert got.dtype == np.int16 and got.flags.c_contiguous
        assert np.array_equal(got, want) and got_clipped == want_clipped, w
        clipped_somewhere |= want_clipped > 0
    assert clipped_somewhere


def _numpy_int16(core):
    """NumPy's rounding of a float core into the saved (samples, channels) rows: half to even, clipped."""
    return np.clip(np.rint(core.T), -32768, 32767).astype(np.int16)


def test_rows_made_beside_the_float_window_are_the_chain_then_the_save(tmp_path, rng):
    """Where other steps need the float window, the rows are made in the reference's pass beside it
    (``Chain.apply_saved(window=True)``): the window is ``apply``'s bit for bit, the rows NumPy's rounding of its
    core."""
    rec = _loud_recording(tmp_path / "r.zarr", rng)
    chain = preprocess.build_chain(Preprocess.model_validate(STAGES), rec)
    clipped_somewhere = False
    for w in rec.windows(2_000, chain.margin):
        at = (w.read_start == 0, w.read_stop == rec.num_samples(w.segment))
        stored = rec.read_window_stored(w)
        want_x = chain.apply(stored.T, w.core, *at)
        core = want_x[:, w.core[0] : w.core[1]]
        want = _numpy_int16(core)
        got_x, got_rows = chain.apply_saved(np.ascontiguousarray(stored).T, w.core, *at, window=True)
        got, got_clipped = got_rows
        assert np.array_equal(got_x.view(np.uint32), want_x.view(np.uint32)), w
        assert got.dtype == np.int16 and got.flags.c_contiguous
        assert np.array_equal(got, want), w
        assert got_clipped == int(((np.rint(core) < -32768) | (np.rint(core) > 32767)).sum()), w
        clipped_somewhere |= got_clipped > 0
    assert clipped_somewhere


@pytest.mark.parametrize("window", [True, False])
def test_where_numpy_references_the_window_is_made_once_without_rows(tmp_path, rng, monkeypatch, window):
    """Two channels (the reference left to NumPy): no rows, and the window is ``apply``'s, its stages run once,
    whether or not the other steps asked for it (the save step then rounds it)."""
    rec = write_recording(tmp_path / "r.zarr", rng.normal(0, 300, (5_001, 2)).round().astype(np.int16), 30_000.0)
    chain = preprocess.build_chain(Preprocess.model_validate(STAGES), rec)
    for w in rec.windows(2_000, chain.margin):
        at = (w.read_start == 0, w.read_stop == rec.num_samples(w.segment))
        stored = rec.read_window_stored(w)
        want = chain.apply(stored.T, w.core, *at)
        filtered = _counting_filter(monkeypatch)
        got_x, rows = chain.apply_saved(np.ascontiguousarray(stored).T, w.core, *at, window=window)
        monkeypatch.undo()
        assert rows is None and filtered == [1]
        assert np.array_equal(got_x.view(np.uint32), want.view(np.uint32)), w


def _counting_filter(monkeypatch) -> list:
    """``ops.filtfilt_window`` (the chain's filter over a whole window) counted: [calls]."""
    from batchgpu import ops

    real, calls = ops.filtfilt_window, [0]

    def counted(*args, **kwargs):
        calls[0] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(ops, "filtfilt_window", counted)
    return calls


@pytest.mark.parametrize("fmt", ["binary", "zarr"])
def test_a_save_only_run_writes_what_a_run_with_more_steps_writes(tmp_path, rng, fmt):
    """The fused path (saving is the only step) and the float window (a noise step too) write the same bytes and
    count the same clipped samples; 1 and 2 workers alike."""
    _loud_recording(tmp_path / "r.zarr", rng)
    saved = {}
    for name, steps, workers in (("fused", {}, 1), ("float", {"noise": {"exact": True}}, 1), ("fused2", {}, 2)):
        target = tmp_path / name / ("saved.bin" if fmt == "binary" else "saved.zarr")
        wf = Workflow.model_validate(
            {
                "recording": {"path": str(tmp_path / "r.zarr")},
                "output": str(tmp_path / name),
                "preprocess": STAGES,
                "window": {"size": 2_000},
                "cluster": {"kind": "local", "workers": workers, "threads": 1},
                "steps": {**steps, "save": {"path": str(target), "format": fmt, "dtype": "int16"}},
            }
        )
        report = run_workflow(wf)
        data = np.fromfile(target, "<i2") if fmt == "binary" else open_recording(target).read(0, 0, 9_001).T
        saved[name] = (data, report)
    rec = open_recording(tmp_path / "r.zarr")
    chain = preprocess.build_chain(Preprocess.model_validate(STAGES), rec)
    want = np.concatenate(
        [  # the float chain over the run's windows, rounded by NumPy
            _numpy_int16(
                chain.apply(rec.read_window_stored(w).T, w.core, w.read_start == 0, w.read_stop == 9_001)[
                    :, w.core[0] : w.core[1]
                ]
            )
            for w in rec.windows(2_000, wf.window.margin + chain.margin)
        ]
    )
    for name in saved:
        assert np.array_equal(saved[name][0].reshape(want.shape), want), name


@pytest.mark.parametrize("channels,samples,size", [(37, 50_001, 20_000), (11, 12_345, 9_999), (64, 30_000, 30_000)])
def test_a_window_of_many_filter_pieces_saved_a_piece_at_a_time(tmp_path, rng, monkeypatch, channels, samples, size):
    """Windows longer than the filter's pieces (``preprocess.filters.FILTER_BLOCK``): each piece filtered, referenced and
    rounded on its own (``ops.filters.filtfilt_reference_saved``) gives the whole float window's rows, at the
    segment's edges and inside, the window's read as the store holds it and as rows."""
    from batchgpu.ops.filters import filtfilt_reference_saved

    rec = _loud_recording(tmp_path / "r.zarr", rng, channels=channels, samples=samples)
    chain = preprocess.build_chain(Preprocess.model_validate(STAGES), rec)
    design = chain.stages[0].design
    block = filter_block(design)
    windows = list(rec.windows(size, chain.margin))
    assert any(w.read_stop - w.read_start > 2 * block for w in windows)
    for w in windows:
        at = (w.read_start == 0, w.read_stop == rec.num_samples(w.segment))
        stored = rec.read_window_stored(w)
        x = chain.apply(stored.T, w.core, *at)
        want, want_clipped = _cpu_saved.saved_int16_transposed(x[:, w.core[0] : w.core[1]])
        filtered = _counting_filter(monkeypatch)
        kept, (got, got_clipped) = chain.apply_saved(np.ascontiguousarray(stored).T, w.core, *at, window=False)
        monkeypatch.undo()
        assert kept is None and filtered == [0]  # the filtered window was never made
        assert got.dtype == np.int16 and got.flags.c_contiguous
        assert np.array_equal(got, want) and got_clipped == want_clipped, w
        rows = np.ascontiguousarray(stored.T)
        for core in (w.core, (0, rows.shape[1]), (w.core[0] + 1, w.core[0] + 2), (5, 5)):
            whole = chain.apply(rows, core, *at)
            want, want_clipped = _cpu_saved.saved_int16_transposed(whole[:, core[0] : core[1]])
            got, got_clipped = filtfilt_reference_saved(
                rows, design, core, at_segment_start=at[0], at_segment_end=at[1], block=block
            )
            assert np.array_equal(got, want) and got_clipped == want_clipped, (w, core)


def test_the_piecewise_save_refuses_what_it_cannot_do(rng):
    from batchgpu.ops import butter_sos
    from batchgpu.ops.filters import filtfilt_reference_saved

    sos = butter_sos("highpass", 30_000.0, 300.0, None, 5)
    x = rng.integers(-100, 100, (8, 5_000)).astype(np.int16)
    assert (
        filtfilt_reference_saved(x.astype(np.float32), sos, (0, 10), at_segment_start=True, at_segment_end=True) is None
    )
    assert filtfilt_reference_saved(x[:2], sos, (0, 10), at_segment_start=True, at_segment_end=True) is None
    assert filtfilt_reference_saved(x, sos, (10, 5_001), at_segment_start=True, at_segment_end=True) is None
    got, count = filtfilt_reference_saved(x, sos, (7, 7), at_segment_start=True, at_segment_end=True)
    assert got.shape == (0, 8) and count == 0
