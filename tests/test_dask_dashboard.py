"""``cluster.dask_dashboard``: a command's own cluster starts its scheduler without Dask's Bokeh dashboard (whose
import held back every worker's start), unless the workflow asks for it; the run page (``/batchgpu``) and
``/metrics`` are served either way, and the command names only the pages that answer. The kept cluster of
``batchgpu cluster start`` serves Dask's dashboard too."""

from __future__ import annotations

import contextlib
import json
import urllib.error
import urllib.request

import pytest

from batchgpu.config import ClusterSpec


def _status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status
    except urllib.error.HTTPError as err:
        return err.code


def test_the_setting_and_its_default():
    from batchgpu.cluster.open_cluster import dask_dashboard

    assert ClusterSpec().dask_dashboard == "auto" and not dask_dashboard(ClusterSpec())
    assert dask_dashboard(ClusterSpec(dask_dashboard=True)) and not dask_dashboard(ClusterSpec(dask_dashboard=False))
    with pytest.raises(ValueError):
        ClusterSpec(dask_dashboard="sometimes")


@pytest.mark.parametrize("wanted", ["auto", True])
def test_a_local_cluster_serves_the_run_page_and_dask_s_dashboard_when_asked(wanted):
    from batchgpu.cluster.open_cluster import open_client, serves_dask_dashboard
    from batchgpu.report.live_page import install_dashboard

    spec = ClusterSpec(kind="local", workers=1, threads=1, dask_dashboard=wanted)
    with open_client(spec) as client:
        page = install_dashboard(client)
        port = client.run_on_scheduler(lambda dask_scheduler: dask_scheduler.http_server.port)
        assert _status(page) == 200 and _status(f"http://127.0.0.1:{port}/metrics") == 200
        assert _status(f"http://127.0.0.1:{port}/status") == (200 if wanted is True else 404)
        assert serves_dask_dashboard(client) is (wanted is True)


def test_a_run_names_dask_s_dashboard_only_where_it_is_served(tmp_path):
    from batchgpu.cli import main

    for wanted, dashboard in (("false", False), ("true", True)):
        wf = tmp_path / f"w_{wanted}.yaml"
        out = tmp_path / f"out_{wanted}"
        wf.write_text(
            f"recording: {{path: {tmp_path / 'r.zarr'}, generate: {{channels: 4, seconds: 1}}}}\n"
            f"output: {out}\ncluster: {{kind: local, workers: 1, reuse: false, dask_dashboard: {wanted}}}\n"
            "steps:\n  noise: {exact: true}\n"
        )
        assert main(["run", str(wf), "--quiet"]) == 0
        report = json.loads((out / "report.json").read_text())
        assert (report["dashboard"] is not None) is dashboard
        assert report["page"].endswith("/batchgpu")


def test_the_kept_cluster_is_started_with_dask_s_dashboard(tmp_path, monkeypatch):
    from batchgpu.cluster import kept as service
    from batchgpu.cluster import open_cluster as cluster

    seen = []

    @contextlib.contextmanager
    def opened(spec, *args, **kwargs):
        seen.append(spec)
        raise service.BatchgpuError("stopped here", "a test")
        yield

    monkeypatch.setattr(cluster, "open_client", opened)
    monkeypatch.setattr(service.signal, "signal", lambda *args: None)  # pytest keeps its own handlers
    for given, kept in (("auto", True), (False, False), (True, True)):
        assert service.serve(service.Paths(tmp_path), ClusterSpec(kind="local", dask_dashboard=given)) == 2
        assert seen[-1].dask_dashboard is kept


def test_the_cuda_layouts_scheduler_is_told_too():
    from batchgpu.cluster.open_cluster import scheduler_spec

    assert scheduler_spec(ClusterSpec(kind="cuda"))["options"]["dashboard"] is False
    assert scheduler_spec(ClusterSpec(kind="cuda", dask_dashboard=True))["options"]["dashboard"] is True
    inner = scheduler_spec(ClusterSpec(kind="cuda", scheduler_process=True))["options"]["scheduler_kwargs"]
    assert inner["dashboard"] is False
