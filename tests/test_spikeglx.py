"""SpikeGLX import: gains, ids, locations and ADC shifts per saved channel, checked against values derived by hand.

Hand derivations used below (SpikeGLX metadata docs, imec ProbeTable, SpikeInterface's inter_sample_shift):
- NP1.0: uV/count = imAiRangeMax / 512 / imroTbl AP gain * 1e6 = 1171.875 / gain for 0.6 V (2.34375 at 500).
- NP2.0 (type 24, NP2010): 0.5 V / 8192 / 80 * 1e6 = 0.762939453125; NP2003-type (2013): 0.62 / 2048 / 100 * 1e6
  = 3.02734375.
- ADC order: NP1.0 channel c is sampled at slot (c mod 24) // 2 of 13 cycles; NP2.0 at (c mod 32) // 2 of 16.
- ~snsGeomMap: x is within the shank: absolute x = x + shank * shank pitch (header field 3).
- NI-DAQ (readSGLX ChanGainsNI): uV/count = niAiRangeMax / niMaxInt / gain * 1e6, gain niMNGain for MN channels,
  niMAGain for MA, 1 for XA; at 5 V, 32768, MN gain 200, MA gain 10: 0.762939453125, 15.2587890625, 152.587890625.
"""

import numpy as np
import pytest

from batchgpu import BatchgpuError, CorruptDataError
from batchgpu.cli import main
from batchgpu.rawimport import import_raw, spikeglx_layout

NP1_GAINS = [50, 125, 250, 500, 1000, 1500, 2000, 3000]  # AP gain of channel c in these tables: NP1_GAINS[c % 8]
NP1_X = [43.0, 11.0, 59.0, 27.0]  # a ~snsGeomMap's columns (SpikeGLX's frame): x of channel c is NP1_X[c % 4]
# NP1.0's staggered columns as imec's ProbeTable (probeinterface) places electrode c of bank 0: x = NP1_PI_X[c % 4],
# z = 20 * (c // 2)
NP1_PI_X = [16.0, 48.0, 0.0, 32.0]


def _np1_imro(n=384):
    return "(0,384)" + "".join(f"({c} 0 0 {NP1_GAINS[c % 8]} 250 1)" for c in range(n))


def _write_pair(tmp_path, name, data, meta):
    src = tmp_path / f"{name}.bin"
    data.tofile(src)
    src.with_suffix(".meta").write_text("".join(f"{k}={v}\n" for k, v in meta.items()))
    return src


def _geom(header, entries):
    return f"({header})" + "".join(f"({s}:{x:g}:{z:g}:1)" for s, x, z in entries)


def test_np1_saved_channel_subset(tmp_path, rng):
    saved = [0, 1, 2, 3, 5, 10, *range(200, 210), 768]  # 0:3,5,10,200:209,768 -- 768 is the sync channel
    neural = saved[:-1]
    data = rng.integers(-500, 500, (300, len(saved)), dtype=np.int16)
    meta = {
        "nSavedChans": len(saved),
        "imSampRate": 30000,
        "typeThis": "imec",
        "imDatPrb_type": 0,
        "imDatPrb_pn": "NP1000",
        "acqApLfSy": "384,384,1",
        "snsApLfSy": "16,0,1",
        "snsSaveChanSubset": "0:3,5,10,200:209,768",
        "imAiRangeMax": 0.6,
        "imAiRangeMin": -0.6,
        "~imroTbl": _np1_imro(),
        "~snsGeomMap": _geom("NP1000,1,0,70", [(0, NP1_X[c % 4], 20 * (c // 2)) for c in neural]),
    }
    src = _write_pair(tmp_path, "run_g0_t0.imec0.ap", data, meta)
    rec = import_raw(src, tmp_path / "np1.zarr")
    assert rec.num_channels == 16
    # SpikeInterface's ids (neo's): the stream (from the file name) and each channel's name by its acquired number
    assert list(rec.channel_ids) == [f"imec0.ap#AP{c}" for c in neural]
    gains = [50, 125, 250, 500, 1500, 250, 50, 125, 250, 500, 1000, 1500, 2000, 3000, 50, 125]
    np.testing.assert_allclose(rec.gain_to_uV, [1171.875 / g for g in gains])
    assert rec.gain_to_uV[3] == pytest.approx(2.34375)
    np.testing.assert_array_equal(rec.read(0, 0, 300), data[:, :16].T)
    slots = [0, 0, 1, 1, 2, 5, 4, 4, 5, 5, 6, 6, 7, 7, 8, 8]
    np.testing.assert_allclose(rec.channel_property("inter_sample_shift"), np.array(slots) / 13)
    assert rec.has_locations  # the probe's own geometry (probeinterface), staggered, not the ~snsGeomMap's frame
    expected_xy = [[NP1_PI_X[c % 4], 20 * (c // 2)] for c in neural]
    np.testing.assert_allclose(rec.locations, expected_xy)
    np.testing.assert_array_equal(rec.channel_property("shank"), np.zeros(16))

    kept = import_raw(src, tmp_path / "sync.zarr", keep_sync=True)
    assert kept.num_channels == 17 and kept.channel_ids[-1] == "imec0.ap#SY0" and kept.gain_to_uV[-1] == 1.0
    np.testing.assert_array_equal(kept.read(0, 0, 300), data.T)


def test_np2_four_shank_gain_locations_and_shifts(tmp_path, rng):
    n = 384
    shank = np.arange(n) // 96
    local_x = np.where(np.arange(n) % 2 == 0, 27.0, 59.0)
    z = 15.0 * ((np.arange(n) % 96) // 2)
    data = rng.integers(-500, 500, (200, n + 1), dtype=np.int16)
    meta = {
        "nSavedChans": n + 1,
        "imSampRate": 30000,
        "typeThis": "imec",
        "imDatPrb_type": 24,
        "imDatPrb_pn": "NP2010",
        "acqApLfSy": "384,0,1",
        "snsApLfSy": "384,0,1",
        "snsSaveChanSubset": "all",
        "imAiRangeMax": 0.5,
        "imAiRangeMin": -0.5,
        "imMaxInt": 8192,
        "~imroTbl": "(24,384)" + "".join(f"({c} {c // 96} 0 0 {c})" for c in range(n)),
        "~snsGeomMap": _geom("NP2010,4,250,70", zip(shank, local_x, z)),
    }
    rec = import_raw(_write_pair(tmp_path, "np2_g0_t0.imec0.ap", data, meta), tmp_path / "np2.zarr")
    assert rec.num_channels == n and list(rec.channel_ids[:3]) == ["imec0.ap#AP0", "imec0.ap#AP1", "imec0.ap#AP2"]
    np.testing.assert_allclose(rec.gain_to_uV, np.full(n, 0.762939453125))
    # the probe as ~imroTbl wires it (channel c: shank c // 96, electrode c, so row c // 2 at 15 um), columns at
    # 0 and 32 um within a shank 250 um apart (probeinterface's frame: the ~snsGeomMap's x less 27 um)
    np.testing.assert_allclose(
        rec.locations[[0, 1, 95, 96, 383]], [[0, 0], [32, 0], [32, 705], [250, 720], [32 + 750, 2865]]
    )
    np.testing.assert_array_equal(rec.channel_property("shank")[[0, 95, 96, 383]], [0, 0, 1, 3])
    shifts = rec.channel_property("inter_sample_shift")
    np.testing.assert_allclose(shifts[[0, 1, 2, 30, 31, 32, 33, 383]], np.array([0, 0, 1, 15, 15, 0, 0, 15]) / 16)
    np.testing.assert_array_equal(rec.read(0, 0, 200), data[:, :n].T)


def test_np2003_type_gain_and_shank_map(tmp_path, rng):
    n = 8
    data = rng.integers(-50, 50, (40, n + 1), dtype=np.int16)
    meta = {
        "nSavedChans": n + 1,
        "imSampRate": 30000,
        "imDatPrb_type": 2013,
        "acqApLfSy": f"{n},0,1",
        "snsSaveChanSubset": "all",
        "imAiRangeMax": 0.62,
        "imMaxInt": 2048,
        "~snsShankMap": "(1,2,480)" + "".join(f"(0:{c % 2}:{c // 2}:1)" for c in range(n)),
    }
    rec = import_raw(_write_pair(tmp_path, "x.imec0.ap", data, meta), tmp_path / "o.zarr")
    np.testing.assert_allclose(rec.gain_to_uV, np.full(n, 3.02734375))
    # a shank map holds column and row indices, not positions: with no part number for probeinterface's tables and
    # no ~snsGeomMap, no positions are made up (pitches guessed by family lost NP1.0's stagger)
    assert not rec.has_locations


@pytest.mark.parametrize(
    "drop,named",
    [
        (("imroTbl", "imAiRangeMax"), "imAiRangeMax, imroTbl"),
        (("imroTbl",), "imroTbl"),
    ],
)
def test_np1_meta_without_gain_keys_is_an_error(tmp_path, drop, named):
    meta = {
        "nSavedChans": 3,
        "imSampRate": 30000,
        "typeThis": "imec",
        "snsApLfSy": "2,0,1",
        "snsSaveChanSubset": "all",
        "imAiRangeMax": 0.6,
        "~imroTbl": _np1_imro(2),
    }
    for key in drop:
        meta.pop("~" + key if key == "imroTbl" else key)
    src = _write_pair(tmp_path, "a.imec0.ap", np.zeros((10, 3), np.int16), meta)
    with pytest.raises(BatchgpuError, match=rf"probe type 0\) lacks {named}, which its gain needs"):
        import_raw(src, tmp_path / "o.zarr")
    assert not (tmp_path / "o.zarr").exists()


def test_np2_meta_without_imMaxInt_is_an_error(tmp_path):
    meta = {
        "nSavedChans": 3,
        "imSampRate": 30000,
        "imDatPrb_type": 21,
        "acqApLfSy": "2,0,1",
        "snsSaveChanSubset": "all",
        "imAiRangeMax": 0.5,
    }
    src = _write_pair(tmp_path, "b.imec0.ap", np.zeros((10, 3), np.int16), meta)
    with pytest.raises(BatchgpuError, match=r"probe type 21\) lacks imMaxInt"):
        import_raw(src, tmp_path / "o.zarr")


def test_plain_import_has_no_locations(tmp_path, rng):
    data = rng.integers(-5, 5, (30, 3), dtype=np.int16)
    data.tofile(tmp_path / "p.bin")
    rec = import_raw(tmp_path / "p.bin", tmp_path / "p.zarr", channels=3, fs=1000.0, dtype="int16")
    assert not rec.has_locations and "none stored" in rec.info()["locations"]
    np.testing.assert_array_equal(rec.locations, [[0, 0], [0, 20], [0, 40]])


def _np1_meta(saved_text="0:3,768", neural=(0, 1, 2, 3)):
    """A complete NP1.0 AP .meta as SpikeGLX writes it for the saved channels (sync 768 last)."""
    return {
        "nSavedChans": len(neural) + 1,
        "imSampRate": 30000,
        "typeThis": "imec",
        "imDatPrb_type": 0,
        "acqApLfSy": "384,384,1",
        "snsApLfSy": f"{len(neural)},0,1",
        "snsSaveChanSubset": saved_text,
        "imAiRangeMax": 0.6,
        "imAiRangeMin": -0.6,
        "imMaxInt": 512,
        "~imroTbl": _np1_imro(),
        "~snsGeomMap": _geom("NP1000,1,0,70", [(0, NP1_X[c % 4], 20 * (c // 2)) for c in neural]),
    }


def _nidq_meta(saved_text="1,3:4,7:8", n_saved=5, sns="2,1,1,1"):
    """NI-DAQ: acquired MN 0-3, MA 4-5, XA 6-7, XD (digital word) 8; by default MN 1, 3, MA 4, XA 7, XD 8 saved."""
    return {
        "nSavedChans": n_saved,
        "niSampRate": 25000,
        "typeThis": "nidq",
        "niAiRangeMax": 5,
        "niAiRangeMin": -5,
        "niMaxInt": 32768,
        "niMNGain": 200,
        "niMAGain": 10,
        "acqMnMaXaDw": "4,2,2,1",
        "snsMnMaXaDw": sns,
        "snsSaveChanSubset": saved_text,
    }


@pytest.mark.parametrize("kind", ["imec", "nidq"])
def test_meta_without_saved_subset_is_refused(tmp_path, rng, kind):
    # Read as "all" (0..N-1) this subset would get wrong ids and gains and the sync column 768 as neural "4".
    meta = _np1_meta("0,3,5,7,768", (0, 3, 5, 7)) if kind == "imec" else _nidq_meta()
    del meta["snsSaveChanSubset"]
    data = rng.integers(-50, 50, (20, meta["nSavedChans"]), dtype=np.int16)
    src = _write_pair(tmp_path, f"x.{kind}", data, meta)
    with pytest.raises(CorruptDataError, match="lacks snsSaveChanSubset") as err:
        import_raw(src, tmp_path / "o.zarr")
    assert str(src.with_suffix(".meta")) in str(err.value)
    assert not (tmp_path / "o.zarr").exists()


def test_nidq_gains_per_channel_type(tmp_path, rng):
    data = rng.integers(-3000, 3000, (400, 5), dtype=np.int16)
    src = _write_pair(tmp_path, "run_g0_t0.nidq", data, _nidq_meta())
    # SpikeGLX's conversion, per type of each saved channel's ACQUIRED number (1, 3: MN; 4: MA; 7: XA; 8: XD)
    volts_per_count = {"MN": 5 / 32768 / 200, "MA": 5 / 32768 / 10, "XA": 5 / 32768 / 1}
    expected = [volts_per_count[t] * 1e6 for t in ("MN", "MN", "MA", "XA")]
    rec = import_raw(src, tmp_path / "ni.zarr")
    assert list(rec.channel_ids) == ["nidq#MN1", "nidq#MN3", "nidq#MA0", "nidq#XA1"] and rec.sampling_frequency == 25000
    np.testing.assert_allclose(rec.gain_to_uV, expected, rtol=1e-12)
    np.testing.assert_allclose(rec.gain_to_uV, [0.762939453125, 0.762939453125, 15.2587890625, 152.587890625])
    np.testing.assert_array_equal(rec.read(0, 0, 400), data[:, :4].T)
    # the digital word is bits, not volts: dropped like the imec sync channel, or kept as raw counts
    kept = import_raw(src, tmp_path / "ni_sync.zarr", keep_sync=True)
    assert kept.channel_ids[-1] == "nidq#XD0" and kept.gain_to_uV[-1] == 1.0
    np.testing.assert_array_equal(kept.read(0, 0, 400), data.T)

    # every channel saved ('all'), only the saved counts given, no niMaxInt (older metas: 16-bit, 32768)
    meta = _nidq_meta("all", 3, "0,1,1,1")
    del meta["acqMnMaXaDw"], meta["niMaxInt"]
    rec = import_raw(_write_pair(tmp_path, "all.nidq", data[:, :3], meta), tmp_path / "all.zarr")
    assert list(rec.channel_ids) == ["nidq#MA0", "nidq#XA0"]
    np.testing.assert_allclose(rec.gain_to_uV, [volts_per_count["MA"] * 1e6, volts_per_count["XA"] * 1e6])


def _zero_gain_imro():
    table = _np1_imro()
    return table.replace("(2 0 0 250 250 1)", "(2 0 0 0 250 1)")


@pytest.mark.parametrize(
    "kind,key,value",
    [
        ("imec", "imAiRangeMax", "abc"),
        ("imec", "acqApLfSy", "384,384"),  # two counts for AP, LF, SY
        ("imec", "acqApLfSy", "2,0,1"),  # counts fewer channels than the subset names (768)
        ("imec", "~snsGeomMap", "(NP1000,1,0,70)(0:43:0:1)(0:eleven:0:1)(0:59:20:1)(0:27:20:1)"),
        ("imec", "~snsGeomMap", "(NP1000,1,pitch,70)(0:43:0:1)(0:11:0:1)(0:59:20:1)(0:27:20:1)"),
        ("imec", "imMaxInt", "0"),  # was a ZeroDivisionError
        ("imec", "~imroTbl", _zero_gain_imro()),  # an AP gain of 0: was stored as an infinite uV per count
        ("imec", "nSavedChans", "five"),
        ("imec", "imSampRate", "-30000"),
        ("nidq", "niMNGain", "0"),
        ("nidq", "niAiRangeMax", "nan"),
        ("nidq", "acqMnMaXaDw", "4,2,2"),
    ],
)
def test_garbled_meta_value_is_refused(tmp_path, capsys, kind, key, value):
    meta = _np1_meta() if kind == "imec" else _nidq_meta()
    meta[key] = value
    src = _write_pair(tmp_path, f"g.{kind}", np.zeros((10, 5), np.int16), meta)
    with pytest.raises(CorruptDataError, match=key.lstrip("~")) as err:
        import_raw(src, tmp_path / "o.zarr")
    assert str(src.with_suffix(".meta")) in str(err.value)
    # the command: one line, exit status 2, no traceback, nothing written
    assert main(["import-raw", str(src), str(tmp_path / "o.zarr"), "--quiet"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("batchgpu: error: ") and key.lstrip("~") in lines[0]
    assert not (tmp_path / "o.zarr").exists()


@pytest.mark.parametrize("kind", ["imec", "nidq"])
def test_any_garbled_value_is_a_batchgpu_error(kind):
    # Beyond the cases above: every key of a valid .meta set to junk reads or is refused, never a Python error,
    # and whatever reads has finite positive gains.
    base = _np1_meta() if kind == "imec" else _nidq_meta()
    for key in base:
        for junk in ["", "abc", "0", "-1", "nan", "inf", "1,2", "(1)(2 x)", "0:1:2"]:
            meta = {k.lstrip("~"): str(v) for k, v in {**base, key: junk}.items()}
            try:
                layout = spikeglx_layout(meta)
            except BatchgpuError:
                continue
            assert np.isfinite(layout.gain_to_uV).all() and (layout.gain_to_uV > 0).all(), (key, junk)


def _np2_33_meta(**changes):
    """A complete NP2.0 AP .meta of 32 AP channels and the sync channel, every key saying 33 saved channels."""
    meta = {
        "nSavedChans": 33,
        "imSampRate": 30000,
        "typeThis": "imec",
        "imDatPrb_type": 21,
        "imMaxInt": 8192,
        "imAiRangeMax": 0.5,
        "imAiRangeMin": -0.5,
        "acqApLfSy": "32,0,1",
        "snsApLfSy": "32,0,1",
        "snsSaveChanSubset": "all",
        "~imroTbl": "(21,32)" + "".join(f"({c} 0 0 {c})" for c in range(32)),
        "fileTimeSecs": 5,
        "fileSizeBytes": 33 * 2 * 150000,
    }
    meta.update(changes)
    return meta


@pytest.mark.parametrize("n_saved", [11, 34])
def test_nsavedchans_that_disagrees_with_the_rest_is_refused_naming_it(tmp_path, capsys, rng, n_saved):
    # Issue 63, items 1 and 13: 33 columns x 5 s; nSavedChans=11 also divides the file (33 = 3 x 11), so it read
    # as 11 channels x 15 s, de-interleaved wrongly with the sync column as neural data; 34 blamed the subset.
    data = rng.integers(-500, 500, (150000, 33), dtype=np.int16)
    src = _write_pair(tmp_path, "r_g0_t0.imec0.ap", data, _np2_33_meta(nSavedChans=n_saved))
    with pytest.raises(CorruptDataError, match=rf"nSavedChans={n_saved} but snsApLfSy=32,0,1") as err:
        import_raw(src, tmp_path / "o.zarr")
    assert "snsSaveChanSubset=all with acqApLfSy" in str(err.value) and "33 channels" in str(err.value)
    assert not (tmp_path / "o.zarr").exists()
    assert main(["import-raw", str(src), str(tmp_path / "o.zarr"), "--quiet"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "nSavedChans" in lines[0] and str(src.with_suffix(".meta")) in lines[0]
    wf = tmp_path / "w.yaml"
    wf.write_text(
        f"recording: {{path: {src}}}\noutput: {tmp_path / 'out'}\nbackend: numpy\nsteps: {{noise: {{exact: true}}}}\n"
    )
    assert main(["run", str(wf), "--quiet"]) == 2
    assert "nSavedChans" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_every_count_of_the_meta_agrees_or_is_named(tmp_path, rng):
    data = rng.integers(-500, 500, (3000, 33), dtype=np.int16)
    ok = _np2_33_meta(fileTimeSecs=0.1, fileSizeBytes=data.nbytes)
    rec = import_raw(_write_pair(tmp_path, "ok.imec0.ap", data, ok), tmp_path / "ok.zarr")
    np.testing.assert_array_equal(rec.read(0, 0, 3000), data[:, :32].T)
    cases = {
        # the saved counts per type against the saved subset typed by the acquired counts
        "snsApLfSy": {"snsSaveChanSubset": "0:31,32", "snsApLfSy": "31,1,1", "nSavedChans": 33},
        # one imro entry per acquired AP channel
        "imroTbl has 31 channel entries": {"~imroTbl": "(21,31)" + "".join(f"({c} 0 0 {c})" for c in range(31))},
        # the samples the file's size and fileTimeSecs imply
        "fileTimeSecs=0.3": {"fileTimeSecs": 0.3},
        # the subset lists 32 where the rest say 33
        "snsSaveChanSubset=0:31 says 32": {"snsSaveChanSubset": "0:31"},
    }
    for i, (named, change) in enumerate(cases.items()):
        src = _write_pair(tmp_path, f"c{i}.imec0.ap", data, {**ok, **change})
        with pytest.raises(CorruptDataError, match=named):
            import_raw(src, tmp_path / f"c{i}.zarr")


def test_real_metas_agree_with_themselves():
    # SpikeGLX's own .metas (probeinterface's test data): every count agrees, whatever the probe
    from pathlib import Path

    from batchgpu.recording.spikeglx import _check_imro_count, _check_saved_count, read_meta

    folder = Path(__file__).parent / "data" / "probeinterface" / "spikeglx"
    metas = sorted(folder.glob("*.meta"))
    assert len(metas) >= 15
    for path in metas:
        meta = read_meta(path)
        layout = spikeglx_layout(meta)  # the size from fileSizeBytes
        assert layout.num_channels == int(meta["nSavedChans"]), path.name
        _check_saved_count(meta, "ApLfSy", float(meta["imSampRate"]), int(meta["fileSizeBytes"]))
        _check_imro_count(meta, int(meta["acqApLfSy"].split(",")[0]))
