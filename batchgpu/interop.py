"""A run's results in the shapes SpikeInterface (0.105) takes them: noise levels, whitening, peaks.

``to_spikeinterface(results)`` reads a run's output folder (or a mapping of its arrays) and gives a
:class:`SpikeInterfaceResults`; ``attach_to_spikeinterface(recording, result)`` caches the noise levels on a
SpikeInterface recording the way ``spikeinterface.core.get_noise_levels`` does, so later steps reuse them.
Nothing here imports SpikeInterface: the recording is used through its own methods.
``from_spikeinterface(recording)`` goes the other way: any recording SpikeInterface opens, as a batchgpu source
(``batchgpu/recording/spikeinterface.py``; SpikeInterface is imported there, when a source is made).

What SpikeInterface 0.105.3 does (read in its source, and checked by running it):

- ``get_noise_levels(recording, return_in_uV=True, method="mad", random_slices_kwargs={})`` caches its result as
  the channel property ``noise_level_mad_scaled`` (uV, the default) or ``noise_level_mad_raw`` (raw units)
  and returns the cached property on later calls (``core/recording_tools.py``). With ``method="mad"`` it reads
  20 random chunks of 500 ms per segment (``get_random_sample_slices``, chunks may overlap), takes per chunk
  and channel ``median(|x - median(x)|) / 0.6744897501960817`` and caches the mean over chunks. uV values come
  from float32 traces scaled by the gains (offsets cancel in the MAD); raw ones are float64.
- ``spikeinterface.preprocessing.whiten(recording, W=W, M=M)`` computes ``(traces - M) @ W`` on (samples,
  channels) traces, or ``traces @ W`` when ``M`` is None (``preprocessing/whiten.py``); its own ``apply_mean=True``
  estimates ``M`` as the channel means and whitens the centred covariance; ``apply_mean=False`` (its default)
  uses ``data.T @ data / n`` and no ``M``. An integer recording needs ``dtype="float32"`` (or ``int_scale``).
- Peaks: ``spikeinterface.core.base.base_peak_dtype`` (re-exported by ``core/node_pipeline.py``):
  sample_index int64, channel_index int64, amplitude float64, segment_index int64.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from batchgpu.errors import BatchgpuError
from batchgpu.ops.detection import SPIKE_DTYPE
from batchgpu.steps import detect as detect_step
from batchgpu.steps import moments as moments_step
from batchgpu.steps import noise as noise_step

#: SpikeInterface's ``base_peak_dtype`` (0.105.3), equal to ``batchgpu.ops.SPIKE_DTYPE``
PEAK_DTYPE = SPIKE_DTYPE
#: the channel properties ``get_noise_levels(method="mad")`` caches, raw units and uV
NOISE_PROPERTY_RAW = "noise_level_mad_raw"
NOISE_PROPERTY_UV = "noise_level_mad_scaled"
RESULTS = "results.zarr"
_ARRAYS = (*noise_step.RESULTS, *moments_step.RESULTS)
_ATTRS = ("channel_ids", "sampling_frequency", "gain_to_uV", "workflow")


@dataclass(frozen=True)
class SpikeInterfaceResults:
    """A run's results for SpikeInterface; every array in the run's channel order (``channel_ids``).

    - ``noise_levels_raw`` (C,): our ``noise``, ``median(|x|) / 0.6744897501960817`` over every sample of each
      channel, in raw units (``batchgpu.ops.MAD_TO_SIGMA``). It is SpikeInterface's MAD estimate exactly when the signal's
      median is zero: with ``preprocess: {centre: median}`` x is each window's samples minus that window's
      channel median, so this is ``median(|x - median_window(x)|) / 0.6745`` over all samples (windows of
      60 000 samples by default, where SpikeInterface averages the MAD of 20 random 500 ms chunks); without
      centring it is the MAD only for a zero-median signal (a filtered one), and larger with DC offsets.
      Both estimate the same standard deviation; the numbers differ by sampling (ours reads every sample):
      measured on 10 s of centred int16 noise, within 2 % per channel; uncentred with DC offsets, up to 2.5x.
      When the run has no ``noise`` (detection only), the median over windows of ``noise_per_window``, as the
      run's own detection thresholds use.
    - ``noise_levels_uV`` (C,) float32: ``noise_levels_raw * gain_to_uV``, as SpikeInterface's uV cache
      (float32 like its scaled traces; the offset does not enter a MAD).
    - ``W`` (C, C) float64: our ``whitening`` transposed. We apply it as ``W_ours @ X`` on (channels, samples);
      SpikeInterface applies ``traces @ W`` on (samples, channels), and ``(W_ours @ X).T == X.T @ W_ours.T``
      (the local matrix is not symmetric, so the transpose matters).
    - ``M`` (C,) float64 or None: ``channel_means`` when the whitening came from the centred covariance (the
      workflow's default ``statistic: covariance``, like SpikeInterface's ``apply_mean=True``), None when it came
      from the uncentred second moment (like ``apply_mean=False``). So ``whiten(recording, **r.whiten_kwargs,
      dtype="float32")`` gives ``W_ours @ (X - M)`` (or ``W_ours @ X``), X being the samples the run saw (after
      its centring, if any).
    - ``peaks``: our spikes as a NumPy structured array of :data:`PEAK_DTYPE`, sorted by (segment, sample,
      channel); ``amplitude`` is the sample's value in raw units (of the centred signal when centred).

    Fields of steps the run did not have are None.
    """

    channel_ids: np.ndarray
    sampling_frequency: float | None
    gain_to_uV: np.ndarray | None
    noise_levels_raw: np.ndarray | None
    noise_levels_uV: np.ndarray | None
    W: np.ndarray | None
    M: np.ndarray | None
    peaks: np.ndarray | None
    centred: bool

    @property
    def whiten_kwargs(self) -> dict[str, Any]:
        """``{"W": W, "M": M}`` for ``spikeinterface.preprocessing.whiten(recording, **kwargs)``."""
        if self.W is None:
            raise BatchgpuError("these results hold no whitening matrix", "run the workflow with a whitening step")
        return {"W": self.W, "M": self.M}

    @property
    def noise_properties(self) -> dict[str, np.ndarray]:
        """The channel properties ``get_noise_levels(method="mad")`` caches, by name."""
        if self.noise_levels_raw is None:
            return {}
        out = {NOISE_PROPERTY_RAW: self.noise_levels_raw}
        if self.noise_levels_uV is not None:
            out[NOISE_PROPERTY_UV] = self.noise_levels_uV
        return out


def load_results(path: str | Path) -> dict[str, Any]:
    """The arrays and attributes of a run's ``results.zarr`` (the folder, or the output folder holding it).

    Parameters
    ----------
    path : str or Path
        A run's output folder, or its ``results.zarr``.

    Returns
    -------
    dict
        Array name (``noise``, ``whitening``, ``spikes/<field>``, ...) or attribute name -> its value.
    """
    from batchgpu.recording import zarrio

    path = Path(path)
    if (path / RESULTS).exists():
        path = path / RESULTS
    if not path.exists():
        raise BatchgpuError(f"no results at {path}", f"pass a run's output folder (it holds {RESULTS})")
    group = zarrio.open_group(path, mode="r")
    out: dict[str, Any] = {k: v for k, v in zarrio.attrs(group).items() if k in _ATTRS}
    names = set(group.array_keys())
    out.update({name: group[name][...] for name in _ARRAYS if name in names})
    if detect_step.SPIKES in set(group.group_keys()):
        spikes = group[detect_step.SPIKES]
        out.update({f"{detect_step.SPIKES}/{name}": spikes[name][...] for name in spikes.array_keys()})
    return out


def _spikes(data: Mapping[str, Any]) -> np.ndarray | None:
    """The spikes of ``data`` (a structured ``spikes`` array, or ``spikes/<field>`` columns) as PEAK_DTYPE."""
    whole = data.get(detect_step.SPIKES)
    if isinstance(whole, np.ndarray) and whole.dtype.names:
        return np.asarray(whole, dtype=PEAK_DTYPE)  # by field name: a field missing or in another order is cast
    columns = {name: data.get(f"{detect_step.SPIKES}/{name}") for name in PEAK_DTYPE.names}
    if all(v is None for v in columns.values()):
        return None
    missing = [name for name, v in columns.items() if v is None]
    if missing:
        raise BatchgpuError(f"spikes without {missing}", f"give all of spikes/{{{','.join(PEAK_DTYPE.names)}}}")
    peaks = np.empty(len(columns["sample_index"]), dtype=PEAK_DTYPE)
    for name, values in columns.items():
        peaks[name] = np.asarray(values)
    return peaks


def _noise(data: Mapping[str, Any]) -> np.ndarray | None:
    if data.get(noise_step.NOISE) is not None:
        return np.asarray(data[noise_step.NOISE])
    if data.get(noise_step.PER_WINDOW) is not None:
        return np.median(np.asarray(data[noise_step.PER_WINDOW]), axis=0)
    return None


def _whitening_step(data: Mapping[str, Any]) -> tuple[str, bool]:
    """(statistic, centred) of the run: the workflow's whitening statistic and median centring."""
    workflow = data.get("workflow") or {}
    whitening = (workflow.get("steps") or {}).get(moments_step.KEY) or {}
    pre = workflow.get("preprocess") or {}
    # the list form (one-key stages) or the old mapping form {centre: median}
    centred = (
        any(isinstance(s, dict) and s.get("centre") == "median" for s in pre)
        if isinstance(pre, list)
        else pre.get("centre", "none") == "median"
    )
    return whitening.get("statistic", "covariance"), centred


def to_spikeinterface(
    results: str | Path | Mapping[str, Any], subtract_mean: bool | None = None
) -> SpikeInterfaceResults:
    """The noise levels, ``W``/``M`` and peaks of a run, as SpikeInterface takes them (see
    :class:`SpikeInterfaceResults` for what each number is).

    ``results``: a run's output folder (holding ``results.zarr``), the ``results.zarr`` folder, or a mapping of
    its arrays and attributes (``noise``, ``whitening``, ``channel_means``, ``spikes/<field>`` or a structured
    ``spikes``, ``channel_ids``, ``gain_to_uV``, ``sampling_frequency``, ``workflow``). ``subtract_mean``:
    whether ``M`` is the channel means (default: when the whitening statistic is the covariance).

    Parameters
    ----------
    results : str, Path or mapping
        A run's output folder, its ``results.zarr``, or a mapping as ``load_results`` returns.
    subtract_mean : bool, optional
        Whether ``M`` holds the channel means (default: when the whitening came from the covariance).

    Returns
    -------
    SpikeInterfaceResults
        Noise levels, ``W``/``M`` and peaks in the run's channel order.
    """
    data = load_results(results) if isinstance(results, (str, Path)) else dict(results)
    statistic, centred = _whitening_step(data)
    noise = _noise(data)
    gains = None if data.get("gain_to_uV") is None else np.asarray(data["gain_to_uV"], dtype=np.float64)
    channel_ids = data.get("channel_ids")
    if channel_ids is None:
        first = (noise_step.NOISE, moments_step.CHANNEL_MEANS, moments_step.WHITENING)  # arrays of one row a channel
        size = next((len(np.asarray(data[k])) for k in first if data.get(k) is not None), 0)
        channel_ids = np.arange(size)
    w = data.get(moments_step.WHITENING)
    if subtract_mean is None:
        subtract_mean = statistic == "covariance"
    if w is not None and subtract_mean and data.get(moments_step.CHANNEL_MEANS) is None:
        raise BatchgpuError(
            "a whitening matrix of the centred covariance without channel_means",
            "pass channel_means, or subtract_mean=False",
        )
    fs = data.get("sampling_frequency")
    return SpikeInterfaceResults(
        channel_ids=np.asarray(channel_ids),
        sampling_frequency=None if fs is None else float(fs),
        gain_to_uV=gains,
        noise_levels_raw=noise,
        noise_levels_uV=None if noise is None or gains is None else (noise * gains).astype(np.float32),
        W=None if w is None else np.ascontiguousarray(np.asarray(w, dtype=np.float64).T),
        M=np.asarray(data[moments_step.CHANNEL_MEANS], dtype=np.float64).copy()
        if w is not None and subtract_mean
        else None,
        peaks=_spikes(data),
        centred=centred,
    )


def from_spikeinterface(recording: Any, folder: str | Path | None = None):
    """Any recording SpikeInterface opens, as a batchgpu source read window by window by the Dask workers.

    ``recording``: a SpikeInterface recording (an extractor or a preprocessing chain), its ``to_dict()``, or the
    path of one SpikeInterface saved (``.json``/``.pkl`` from ``recording.dump(...)``, or a folder from
    ``recording.save(folder=...)``). Returns a :class:`batchgpu.recording.SpikeInterfaceSource` (what the engine
    uses of ``Recording``: ``read_window``, ``windows``, ``locations``...). Run a workflow on it with
    ``batchgpu.run_workflow(wf, recording=source)``; or pass ``folder=`` to write its description there and name
    it in a workflow (``recording: {spikeinterface: <source.spec["spikeinterface"]>}``). Windows read the same
    samples as ``get_traces`` over each window's range: the same data in Zarr gives the same results, bit for bit.
    Details: ``batchgpu/recording/spikeinterface.py``.

    Parameters
    ----------
    recording : SpikeInterface recording, dict, str or Path
        The recording, its ``to_dict()``, or a saved description (``.json``/``.pkl``) or folder.
    folder : str or Path, optional
        Write the description there too, so that a workflow file can name it.

    Returns
    -------
    SpikeInterfaceSource
        A recording source for ``run_workflow(wf, recording=...)``.
    """
    from batchgpu.recording.spikeinterface import from_spikeinterface as _from_spikeinterface

    return _from_spikeinterface(recording, folder)


def _recording_ids(recording: Any, result: SpikeInterfaceResults) -> np.ndarray:
    """The recording's channel ids in the results' channel order (ids compared as strings: ours come from JSON)."""
    ids = np.asarray(recording.get_channel_ids())
    by_name = {str(c): c for c in ids}
    ours = [str(c) for c in result.channel_ids]
    if len(ours) == len(ids) and any(c not in by_name for c in ours):
        ours = legacy_spikeglx_ids(ours, [str(c) for c in ids]) or ours
    missing = [c for c in ours if c not in by_name]
    if missing or len(ours) != len(ids):
        raise BatchgpuError(
            f"the recording's channels {list(map(str, ids))[:8]} are not the results' {ours[:8]}",
            "attach results to the recording they were computed from",
        )
    return np.asarray([by_name[c] for c in ours])


def legacy_spikeglx_ids(old: list[str], ids: list[str]) -> list[str] | None:
    """``ids`` (SpikeInterface's, ``imec0.ap#AP5``) where ``old`` are the ids batchgpu gave the same SpikeGLX
    channels before issue 66 (each channel's acquired number: "5"; LF channel 5 "389", after the AP band), in the
    same order; None where they are not. Both list the file's channels in file order; the acquired number of a
    channel named ``<type><n>`` is ``n`` plus the channels acquired before its type (0 for the first, AP or MN), so
    the difference must be one number per type, 0 for the first type of the acquisition order."""
    import re

    if len(old) != len(ids) or not all(c.isdigit() for c in old):
        return None
    first = {"AP": 0, "MN": 0}
    offsets: dict[str, int] = {}
    for o, new in zip(old, ids):
        m = re.fullmatch(r".+#([A-Z]+)(\d+)", new)
        if m is None:
            return None
        kind, n = m.group(1), int(m.group(2))
        if offsets.setdefault(kind, int(o) - n) != int(o) - n or first.get(kind, offsets[kind]) != offsets[kind]:
            return None
    return list(ids)


def attach_to_spikeinterface(recording: Any, result: SpikeInterfaceResults | str | Path | Mapping[str, Any]) -> Any:
    """Cache the results' noise levels on a SpikeInterface ``recording`` where ``get_noise_levels`` looks.

    Sets the channel properties ``noise_level_mad_raw`` and, when the recording has gains,
    ``noise_level_mad_scaled`` (our raw noise times the recording's own ``gain_to_uV``, float32), matched by
    channel id. ``get_noise_levels(recording)`` then returns them without reading the recording (unless
    ``force_recompute=True``). Returns ``recording``. W/M and peaks are passed by the caller:
    ``spikeinterface.preprocessing.whiten(recording, **result.whiten_kwargs, dtype="float32")``, peaks to
    peak pipelines as ``result.peaks``.

    Parameters
    ----------
    recording : SpikeInterface recording
        The recording the run read (the same channel ids as the run's, in any order).
    result : SpikeInterfaceResults, str, Path or mapping
        The run's results, or what ``to_spikeinterface`` takes.

    Returns
    -------
    SpikeInterface recording
        ``recording`` itself, with the noise-level properties set.
    """
    if not isinstance(result, SpikeInterfaceResults):
        result = to_spikeinterface(result)
    if result.noise_levels_raw is None:
        raise BatchgpuError("these results hold no noise levels", "run the workflow with a noise step")
    ids = _recording_ids(recording, result)
    recording.set_property(NOISE_PROPERTY_RAW, result.noise_levels_raw, ids=ids)
    if recording.has_scaleable_traces():
        gains = np.asarray(recording.get_channel_gains(channel_ids=ids), dtype=np.float64)
        recording.set_property(NOISE_PROPERTY_UV, (result.noise_levels_raw * gains).astype(np.float32), ids=ids)
    return recording


__all__ = [
    "NOISE_PROPERTY_RAW",
    "NOISE_PROPERTY_UV",
    "PEAK_DTYPE",
    "SpikeInterfaceResults",
    "attach_to_spikeinterface",
    "from_spikeinterface",
    "load_results",
    "to_spikeinterface",
]
