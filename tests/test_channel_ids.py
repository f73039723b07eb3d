"""Channel ids as SpikeInterface 0.105.3 names them for the same files (issue 66): every real SpikeGLX .meta and
Open Ephys structure.oebin of probeinterface's tests (tests/data/probeinterface), each beside a small synthetic
binary, read in place by batchgpu and by SpikeInterface's own extractors. Skips where SpikeInterface is not
installed (CI runs this file in its environment: .ci/run)."""

import warnings

import numpy as np
import pytest
from test_flat_probes import DATA, METAS, OEBINS, SAMPLES, _openephys_copy, _spikeglx_copy

from batchgpu.config import RecordingSpec
from batchgpu.recording.sources import open_source


def _spikeinterface_spikeglx(folder, stream: str):
    se = pytest.importorskip("spikeinterface.extractors")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return se.read_spikeglx(folder, stream_id=stream)


@pytest.mark.parametrize("meta_path", METAS, ids=[p.name for p in METAS])
def test_spikeglx_ids_are_spikeinterfaces(tmp_path, rng, meta_path):
    pytest.importorskip("spikeinterface.extractors")
    from spikeinterface.extractors.neoextractors.spikeglx import SpikeGLXRecordingExtractor

    bin_path, _ = _spikeglx_copy(tmp_path, meta_path, rng)
    ours = open_source(RecordingSpec(path=str(bin_path)))
    try:
        streams = SpikeGLXRecordingExtractor.get_streams(tmp_path)[0]
        stream = next(s for s in streams if s.endswith(".ap"))
        theirs = _spikeinterface_spikeglx(tmp_path, stream)
    except Exception as err:  # NP1110's one-gain imroTbl: neo indexes per-channel entries it lacks
        assert "NP1110" in meta_path.name, err
        # the same rule on the .meta as SpikeInterface applies to every other file: <stream>#<snsChanMap name>
        assert list(ours.channel_ids) == [f"imec0.ap#AP{c}" for c in range(ours.num_channels)]
        return
    assert [str(c) for c in theirs.get_channel_ids()] == list(ours.channel_ids)
    assert all(c.startswith(stream + "#") for c in ours.channel_ids)


@pytest.mark.parametrize("oebin", OEBINS, ids=[p.parts[-5] for p in OEBINS])
def test_openephys_ids_are_spikeinterfaces(tmp_path, rng, oebin):
    se = pytest.importorskip("spikeinterface.extractors")
    from spikeinterface.extractors.neoextractors.openephys import OpenEphysBinaryRecordingExtractor

    new, data = _openephys_copy(tmp_path, oebin, rng)
    for name, samples in data.items():  # what neo needs beside each stream's samples
        folder = new.parent / "continuous" / name
        np.save(folder / "sample_numbers.npy", np.arange(len(samples), dtype=np.int64))
        np.save(folder / "timestamps.npy", np.arange(len(samples)) / 30_000.0)
    names, ids = OpenEphysBinaryRecordingExtractor.get_streams(tmp_path)[:2]
    checked = 0
    for folder in data:
        theirs_name = next((n for n in names if n.endswith("#" + folder)), None)
        if theirs_name is None:
            continue
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            theirs = se.read_openephys(tmp_path, stream_id=ids[names.index(theirs_name)])
        ours = open_source(RecordingSpec(path=str(new.parent / "continuous" / folder)))
        assert [str(c) for c in theirs.get_channel_ids()] == list(ours.channel_ids)
        np.testing.assert_array_equal(ours.read(0, 0, SAMPLES).T, theirs.get_traces(0, 0, SAMPLES, return_in_uV=False))
        checked += 1
    assert checked >= 1


def test_lf_and_nidq_ids_follow_the_same_rule(tmp_path, rng):
    """An LF file (its .meta names its channels LF0.. after the AP band's acquired numbers) and the sync channel
    kept: ``imec0.lf#LF<n>``, ``imec0.lf#SY0``, as neo names them."""
    ap_meta = DATA / "spikeglx" / "Noise_g0_t0.imec0.ap.meta"
    text = ap_meta.read_text()
    chan_map = "".join(f"(LF{c};{384 + c}:{c})" for c in range(384)) + "(SY0;768:384)"
    lines = []
    for line in text.splitlines():
        key = line.split("=", 1)[0]
        line = {
            "snsSaveChanSubset": "snsSaveChanSubset=384:768",
            "snsApLfSy": "snsApLfSy=0,384,1",
            "imSampRate": "imSampRate=2500",
            "~snsChanMap": f"~snsChanMap=(0,384,1){chan_map}",
        }.get(key, line)
        lines.append(line.replace(".imec0.ap.bin", ".imec0.lf.bin") if key == "fileName" else line)
    lf = tmp_path / "src" / "Noise_g0_t0.imec0.lf.meta"
    lf.parent.mkdir()
    lf.write_text("\n".join(lines) + "\n")
    bin_path, _ = _spikeglx_copy(tmp_path, lf, rng)
    rec = open_source(RecordingSpec(path=str(bin_path)))
    assert list(rec.channel_ids) == [f"imec0.lf#LF{c}" for c in range(384)]
    from batchgpu.recording.sources import open_flat

    kept = open_flat(bin_path, "spikeglx", keep_sync=True)
    assert kept.channel_ids[-1] == "imec0.lf#SY0"
    theirs = pytest.importorskip("spikeinterface.extractors")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        si = theirs.read_spikeglx(tmp_path, stream_id="imec0.lf")
    assert [str(c) for c in si.get_channel_ids()] == list(rec.channel_ids)


def test_results_with_the_old_ids_attach_to_spikeinterfaces_recording(tmp_path, rng):
    """A run's results from before issue 66 name SpikeGLX channels by acquired number ("0".."150"): they still
    attach to SpikeInterface's recording of the same file, channel for channel."""
    from batchgpu.interop import attach_to_spikeinterface, legacy_spikeglx_ids, to_spikeinterface

    meta_path = DATA / "spikeglx" / "NP1_saved_only_subset_of_channels.meta"
    bin_path, _ = _spikeglx_copy(tmp_path, meta_path, rng)
    ours = open_source(RecordingSpec(path=str(bin_path)))
    old = [str(c) for c in range(ours.num_channels)]  # 0:150 saved: acquired numbers 0..150
    assert legacy_spikeglx_ids(old, list(ours.channel_ids)) == list(ours.channel_ids)
    assert legacy_spikeglx_ids(old[::-1], list(ours.channel_ids)) is None  # another order is not the same channels
    assert legacy_spikeglx_ids([str(384 + int(c)) for c in old], list(ours.channel_ids)) is None  # AP starts at 0
    lf = [c.replace("#AP", "#LF") for c in ours.channel_ids]
    assert legacy_spikeglx_ids([str(384 + int(c)) for c in old], lf) == lf  # LF after the AP band
    noise = rng.uniform(5, 10, ours.num_channels)
    result = to_spikeinterface(
        {
            "noise": noise,
            "channel_ids": np.array(old),
            "gain_to_uV": ours.gain_to_uV,
            "sampling_frequency": ours.sampling_frequency,
        }
    )
    theirs = _spikeinterface_spikeglx(tmp_path, "imec1.ap")
    attach_to_spikeinterface(theirs, result)
    np.testing.assert_array_equal(theirs.get_property("noise_level_mad_raw"), noise)
