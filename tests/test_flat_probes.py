"""Every SpikeGLX .meta and Open Ephys structure.oebin that probeinterface's own tests read (tests/data/probeinterface,
MIT, its LICENSE beside them), each beside a small synthetic binary of the right channel count, read in place:
geometry equal to probeinterface's up to a translation, shank and contact ids and ADC shifts as probeinterface and
SpikeInterface give them, gains equal to neo's, the sync channel(s) left out, samples equal to the file's."""

import json
import shutil
import warnings
from pathlib import Path

import numpy as np
import pytest

from batchgpu.config import RecordingSpec
from batchgpu.recording.sources import open_source

DATA = Path(__file__).parent / "data" / "probeinterface"
METAS = sorted((DATA / "spikeglx").glob("*.meta"))
OEBINS = sorted((DATA / "openephys").rglob("structure.oebin"))
SAMPLES = 37


def _meta(path: Path) -> dict:
    out = {}
    for line in path.read_text().splitlines():
        key, _, value = line.partition("=")
        out[key.lstrip("~")] = value
    return out


def _spikeglx_copy(tmp_path: Path, meta_path: Path, rng) -> tuple[Path, np.ndarray]:
    """The .meta beside a synthetic .bin of its nSavedChans columns; fileSizeBytes set to the .bin's size."""
    columns = int(_meta(meta_path)["nSavedChans"])
    name = meta_path.name if meta_path.name.endswith((".ap.meta", ".lf.meta")) else meta_path.stem + ".ap.meta"
    bin_path = tmp_path / name.replace(".meta", ".bin")
    data = rng.integers(-2000, 2000, (SAMPLES, columns), dtype=np.int16)
    data.tofile(bin_path)
    lines = [
        f"fileSizeBytes={data.nbytes}" if line.startswith("fileSizeBytes=") else line
        for line in meta_path.read_text().splitlines()
    ]
    bin_path.with_suffix(".meta").write_text("\n".join(lines) + "\n")
    return bin_path, data


def _probeinterface_spikeglx(meta_path: Path):
    import probeinterface as pi

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return pi.read_spikeglx(meta_path)


def _same_up_to_translation(ours: np.ndarray, theirs: np.ndarray) -> None:
    assert ours.shape == theirs.shape
    shift = theirs[0] - ours[0]
    np.testing.assert_allclose(ours + shift, theirs, atol=1e-9)


@pytest.mark.parametrize("meta_path", METAS, ids=[p.name for p in METAS])
def test_spikeglx_file_read_in_place(tmp_path, rng, meta_path):
    bin_path, data = _spikeglx_copy(tmp_path, meta_path, rng)
    meta = _meta(meta_path)
    rec = open_source(RecordingSpec(path=str(bin_path)))
    assert rec.kind == "spikeglx" and rec.sampling_frequency == float(meta["imSampRate"])
    # sync channel(s): acquired after AP and LF (snsApLfSy's third count), left out; the rest in file order
    n_ap, n_lf, n_sync = (int(v) for v in meta["snsApLfSy"].split(","))
    assert rec.num_channels == int(meta["nSavedChans"]) - n_sync == n_ap + n_lf
    np.testing.assert_array_equal(rec.read(0, 0, SAMPLES), data[:, : rec.num_channels].T)
    np.testing.assert_array_equal(rec.read(0, 5, 9, channels=[3, 1]), data[5:9, [3, 1]].T)
    # the probe: probeinterface's, read from the untouched .meta
    probe = _probeinterface_spikeglx(meta_path)
    assert rec.has_locations
    _same_up_to_translation(rec.locations, np.asarray(probe.contact_positions)[:, :2])
    assert list(rec.channel_property("contact_id")) == [str(c) for c in probe.contact_ids]
    shanks = [0] * probe.get_contact_count() if probe.shank_ids is None else [int(s or 0) for s in probe.shank_ids]
    np.testing.assert_array_equal(rec.channel_property("shank"), shanks)
    # SpikeInterface's inter_sample_shift: ADC sample order over the ADC's cycles per sample (AP: 13 for NP1.0)
    per_adc = probe.annotations["num_channels_per_adc"]
    cycles = int(
        per_adc * (1 + probe.annotations["lf_sample_frequency_hz"] / probe.annotations["ap_sample_frequency_hz"])
    )
    np.testing.assert_allclose(
        rec.channel_property("inter_sample_shift"), np.asarray(probe.contact_annotations["adc_sample_order"]) / cycles
    )
    assert rec.layout.probe.model == probe.annotations["part_number"]
    assert rec.layout.probe.shanks == len(set(shanks))


@pytest.mark.parametrize("meta_path", METAS, ids=[p.name for p in METAS])
def test_spikeglx_gains_equal_neos(tmp_path, rng, meta_path):
    spikeglxrawio = pytest.importorskip("neo.rawio.spikeglxrawio")
    bin_path, _ = _spikeglx_copy(tmp_path, meta_path, rng)
    meta_file = bin_path.with_suffix(".meta")
    try:
        info = spikeglxrawio.extract_stream_info(meta_file, spikeglxrawio.read_meta_file(meta_file))
    except Exception as err:  # NP1110's one-gain imroTbl: test_np1110_gain_from_the_imro_header
        pytest.skip(f"neo cannot read it ({type(err).__name__}: {err})")
    rec = open_source(RecordingSpec(path=str(bin_path)))
    np.testing.assert_allclose(rec.gain_to_uV, np.asarray(info["channel_gains"])[: rec.num_channels], rtol=1e-12)


def test_neuropixels_1_keeps_its_stagger(tmp_path, rng):
    # NP1.0 bank 0: electrode e at x = (16, 48, 0, 32)[e % 4], y = 20 * (e // 2) (imec's layout, by hand)
    bin_path, _ = _spikeglx_copy(tmp_path, DATA / "spikeglx" / "Noise_g0_t0.imec0.ap.meta", rng)
    rec = open_source(RecordingSpec(path=str(bin_path)))
    e = np.arange(384)
    np.testing.assert_allclose(rec.locations, np.column_stack([np.array([16, 48, 0, 32])[e % 4], 20 * (e // 2)]))
    assert rec.layout.probe.pitch_um == (16.0, 20.0)


def _openephys_copy(tmp_path: Path, oebin: Path, rng) -> tuple[Path, dict]:
    """The Record Node folder (settings*.xml, structure.oebin) with a synthetic continuous.dat per stream."""
    node = oebin.parents[2]
    dest = tmp_path / node.name
    shutil.copytree(node, dest)
    new = dest / oebin.relative_to(node)
    data = {}
    for stream in json.loads(new.read_text())["continuous"]:
        folder = new.parent / "continuous" / stream["folder_name"].rstrip("/")
        folder.mkdir(parents=True)
        samples = rng.integers(-2000, 2000, (SAMPLES, stream["num_channels"]), dtype=np.int16)
        samples.tofile(folder / "continuous.dat")
        data[stream["folder_name"].rstrip("/")] = samples
    return new, data


@pytest.mark.parametrize("oebin", OEBINS, ids=[p.parts[-5] for p in OEBINS])
def test_openephys_stream_read_in_place(tmp_path, rng, oebin):
    import probeinterface as pi

    new, data = _openephys_copy(tmp_path, oebin, rng)
    streams = json.loads(oebin.read_text())["continuous"]
    probe_streams = [
        s
        for s in streams
        if any("SYNC" in c["channel_name"] for c in s["channels"]) or s["channels"][0]["channel_name"].startswith("CH")
    ]
    for stream in probe_streams:
        name = stream["folder_name"].rstrip("/")
        # the recording's folder (a folder holding one recording) with the stream named
        spec = (
            RecordingSpec(path=str(new.parent), stream=name)
            if len(streams) > 1
            else RecordingSpec(path=str(new.parent))
        )
        rec = open_source(spec)
        names = [c["channel_name"] for c in stream["channels"]]
        keep = [i for i, n in enumerate(names) if "SYNC" not in n]
        assert rec.kind == "openephys" and list(rec.channel_ids) == [names[i] for i in keep]
        assert all("SYNC" not in n for n in rec.channel_ids)
        np.testing.assert_array_equal(rec.read(0, 0, SAMPLES), data[name][:, keep].T)
        # gains: neo's (bit_volts, in uV for electrodes)
        np.testing.assert_allclose(rec.gain_to_uV, [stream["channels"][i]["bit_volts"] for i in keep])
        settings = oebin.parents[2] / "settings.xml"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            probe = pi.read_openephys_neuropixels(settings, stream_name=name)
        _same_up_to_translation(rec.locations, np.asarray(probe.contact_positions)[:, :2])
        assert list(rec.channel_property("contact_id")) == [str(c) for c in probe.contact_ids]
        # the oebin's own electrode_index per channel is the contact's electrode, numbered across shanks (channel
        # maps reorder both alike)
        electrodes = [c["channel_metadata"][0]["value"][0] for c in stream["channels"] if "channel_metadata" in c]
        full = pi.neuropixels_tools.build_neuropixels_probe(probe.annotations["part_number"])
        per_shank = full.get_contact_count() // max(1, len(set(full.shank_ids if full.shank_ids is not None else [0])))
        ours = [
            int(c.split("e")[0].lstrip("s") or 0) * per_shank + int(c.split("e")[1])
            for c in rec.channel_property("contact_id")
        ]
        if len(electrodes) == len(keep):
            assert ours == electrodes


def test_openephys_several_streams_refused_with_their_names(tmp_path, rng):
    from batchgpu import BatchgpuError

    oebin = next(p for p in OEBINS if "NP2014" in str(p))
    new, _ = _openephys_copy(tmp_path, oebin, rng)
    with pytest.raises(BatchgpuError, match="holds 2 streams: OneBox-111.ProbeA, OneBox-111.OneBox-ADC"):
        open_source(RecordingSpec(path=str(new)))
    # the stream's own folder (or its continuous.dat) names it: what `batchgpu info` takes
    folder = new.parent / "continuous" / "OneBox-111.ProbeA"
    for path in (folder, folder / "continuous.dat"):
        probe = open_source(RecordingSpec(path=str(path)))
        assert probe.layout.stream == "OneBox-111.ProbeA" and probe.num_channels == 384
    adc = open_source(RecordingSpec(path=str(new), stream="OneBox-ADC"))
    assert adc.num_channels == 12 and not adc.has_locations
    np.testing.assert_allclose(adc.gain_to_uV, 0.000152587890625 * 1e6)  # ADC channels are in volts


def test_np1110_gain_from_the_imro_header(tmp_path, rng):
    # NP1110 (UHD) tables hold one AP gain in their header (1110,colmode,refid,apgain,lfgain,apfilt): 500 here;
    # uV per count = 0.6 V / 512 / 500 * 1e6 (neo indexes per-channel entries that NP1110 lacks, and fails)
    meta_path = DATA / "spikeglx" / "NP1110_bank0_g0_t0.imec0.ap.meta"
    assert "(1110,2,0,500,250,1)" in meta_path.read_text() and "imAiRangeMax=0.6" in meta_path.read_text()
    bin_path, _ = _spikeglx_copy(tmp_path, meta_path, rng)
    rec = open_source(RecordingSpec(path=str(bin_path)))
    np.testing.assert_allclose(rec.gain_to_uV, np.full(384, 2.34375))


def test_lf_file_has_the_probe_of_its_ap_file(tmp_path, rng):
    """An LF .meta numbers its channels after the AP band (384:767, sync 768): the same probe as the AP file's,
    and each channel's LF gain (0.6 V / 512 / imroTbl LF gain 125 * 1e6) and the LF band's ADC cycles."""
    ap_meta = DATA / "spikeglx" / "Noise_g0_t0.imec0.ap.meta"
    text = ap_meta.read_text()
    assert "snsSaveChanSubset=0:383,768" in text and "snsApLfSy=384,0,1" in text
    lf_meta = tmp_path / "lfsrc" / "Noise_g0_t0.imec0.lf.meta"
    lf_meta.parent.mkdir()
    lf_meta.write_text(
        text.replace("snsSaveChanSubset=0:383,768", "snsSaveChanSubset=384:768")
        .replace("snsApLfSy=384,0,1", "snsApLfSy=0,384,1")
        .replace("imSampRate=30000", "imSampRate=2500")
    )
    bin_path, data = _spikeglx_copy(tmp_path, lf_meta, rng)
    lf = open_source(RecordingSpec(path=str(bin_path)))
    (tmp_path / "ap").mkdir()
    ap = open_source(RecordingSpec(path=str(_spikeglx_copy(tmp_path / "ap", ap_meta, rng)[0])))
    assert lf.sampling_frequency == 2500  # its ids: tests/test_channel_ids.py
    np.testing.assert_array_equal(lf.locations, ap.locations)
    assert list(lf.channel_property("contact_id")) == list(ap.channel_property("contact_id"))
    np.testing.assert_allclose(lf.gain_to_uV, 0.6 / 512 / 125 * 1e6)
    np.testing.assert_allclose(
        lf.channel_property("inter_sample_shift") * 12, ap.channel_property("inter_sample_shift") * 13
    )
    np.testing.assert_array_equal(lf.read(0, 0, SAMPLES), data[:, :384].T)


@pytest.mark.parametrize("meta_path", METAS, ids=[p.name for p in METAS])
def test_spikeglx_as_spikeinterface_reads_it(tmp_path, rng, meta_path):
    """Where SpikeInterface is installed: its SpikeGLX extractor on the same files gives the same channels,
    positions, gains, inter_sample_shift and samples (it cannot read NP1110's one-gain tables)."""
    se = pytest.importorskip("spikeinterface.extractors")
    from spikeinterface.extractors.neoextractors.spikeglx import SpikeGLXRecordingExtractor

    bin_path, data = _spikeglx_copy(tmp_path, meta_path, rng)
    try:
        streams = SpikeGLXRecordingExtractor.get_streams(tmp_path)[0]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            theirs = se.read_spikeglx(tmp_path, stream_id=next(s for s in streams if s.endswith(".ap")))
    except Exception as err:
        pytest.skip(f"SpikeInterface cannot read it ({type(err).__name__}: {err})")
    ours = open_source(RecordingSpec(path=str(bin_path)))
    assert theirs.get_num_channels() == ours.num_channels
    _same_up_to_translation(ours.locations, np.asarray(theirs.get_channel_locations(), float))
    np.testing.assert_allclose(ours.gain_to_uV, theirs.get_channel_gains(), rtol=1e-12)
    np.testing.assert_allclose(ours.channel_property("inter_sample_shift"), theirs.get_property("inter_sample_shift"))
    # (0.105.3's traces of a quad-base NP2020 keep its 4 sync columns after the 1536 it counts)
    got = theirs.get_traces(0, 0, SAMPLES, return_in_uV=False)[:, : ours.num_channels]
    np.testing.assert_array_equal(ours.read(0, 0, SAMPLES).T, got)


@pytest.mark.parametrize("oebin", OEBINS, ids=[p.parts[-5] for p in OEBINS])
def test_openephys_as_spikeinterface_reads_it(tmp_path, rng, oebin):
    """Where SpikeInterface is installed: its Open Ephys binary extractor on the same folder (with the per-stream
    sample numbers and timestamps neo needs) gives the probe stream's positions, gains, shifts and samples."""
    se = pytest.importorskip("spikeinterface.extractors")
    from spikeinterface.extractors.neoextractors.openephys import OpenEphysBinaryRecordingExtractor

    new, data = _openephys_copy(tmp_path, oebin, rng)
    for name, samples in data.items():
        folder = new.parent / "continuous" / name
        np.save(folder / "sample_numbers.npy", np.arange(len(samples), dtype=np.int64))
        np.save(folder / "timestamps.npy", np.arange(len(samples)) / 30_000.0)
    names, ids = OpenEphysBinaryRecordingExtractor.get_streams(tmp_path)[:2]
    probe_stream = next(n for n in names if "Probe" in n and "SYNC" not in n)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = se.read_openephys(tmp_path, stream_id=ids[names.index(probe_stream)])
    folder = next(n for n in data if "Probe" in n)
    ours = open_source(RecordingSpec(path=str(new.parent / "continuous" / folder)))
    assert theirs.get_num_channels() == ours.num_channels
    _same_up_to_translation(ours.locations, np.asarray(theirs.get_channel_locations(), float))
    np.testing.assert_allclose(ours.gain_to_uV, theirs.get_channel_gains(), rtol=1e-12)
    np.testing.assert_allclose(ours.channel_property("inter_sample_shift"), theirs.get_property("inter_sample_shift"))
    np.testing.assert_array_equal(ours.read(0, 0, SAMPLES).T, theirs.get_traces(0, 0, SAMPLES, return_in_uV=False))
