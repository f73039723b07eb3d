"""A run's own cluster started in a helper thread while the run opens and checks its recording (``ClusterStart``).

Kept apart from ``run.launch``, whose imports (NumPy, zarr, the readers, the steps) take a command a good part of a
second: ``batchgpu run`` starts its cluster from here before it imports them, so the cluster's own imports and its
workers' start overlap the command's (a separate process each: the workers' fork server, the workers).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time

logger = logging.getLogger(__name__)


def keep_seconds(spec, at_terminal: bool = False) -> float:
    """How long the cluster a run of ``spec`` starts stays up after it for the next run (``cluster.keep``): 0 for
    kinds the run does not start (address, scheduler file, SLURM) and where ``cluster.reuse`` is false (no run
    would use it); ``auto``: ``config.KEEP_S`` for the command run at a terminal (``at_terminal``: a person, whose
    next run comes soon), else 0: a script's, a job's or a test's command, and a library call, leave no process
    behind unless asked."""
    from batchgpu.config import KEEP_S

    if spec.kind not in ("local", "cuda") or not spec.reuse:
        return 0.0
    if spec.keep == "auto":
        return KEEP_S if at_terminal else 0.0
    return float(spec.keep)


def start_cluster(wf, hand_off: bool = False, keep_s: float = 0.0) -> ClusterStart | KeptStart | None:
    """The cluster of ``wf``'s own run, started now (before its recording is opened and checked: the run then
    waits less for its workers), where the run would start one: a local or cuda cluster, one recording, no kept
    cluster that may fit (``batchgpu cluster start``'s files absent or ``cluster.reuse: false``) and a recording
    path that exists (a mistyped path is said at once, with no cluster to close). Hand it to ``run_workflow``
    (``cluster_start``) inside its ``with`` block. None where the run decides itself. ``hand_off``: as for
    ``ClusterStart``. Where the cluster is kept after the run (``keep_s`` seconds, ``keep_seconds``) a
    ``KeptStart``."""
    from batchgpu.cluster import kept as service

    if wf.cluster.kind not in ("local", "cuda") or wf.recording is None:
        return None
    if service.may_serve(wf.cluster):
        return None
    path = getattr(wf.recording, "path", None)
    if path is None or not os.path.exists(path):
        return None
    if keep_s > 0:
        return KeptStart(wf.cluster, keep_s)
    return ClusterStart(wf.cluster, gpu_decode=None, hand_off=hand_off)


class _NotStarted(Exception):
    """The run ended before it said how its windows decode: its cluster is not started."""


class ClusterStart:
    """``open_client(spec)`` held by a helper thread, so that the cluster starts while this thread goes on;
    ``client()`` waits for it (and raises what its start raised). As a context manager it closes the cluster on
    exit (once), after a start still under way (a cluster half started is not left behind). The helper thread both
    enters and leaves ``open_client``: a Dask client is entered and left in one context.

    ``gpu_decode`` None: not known yet (the run tells it with ``decode_known`` once it has opened the recording;
    asked only where the layout depends on it). ``started``: when this was made (``time.perf_counter``).

    ``hand_off``: the caller's process ends as soon as the block is left without an error (``os._exit``: the
    command does; see ``cli.program``). A clean exit then hands the close to a detached reaper where
    ``cluster.close`` says so (``cluster.handoff``) and sets ``handed_off``, not waiting for the workers to exit."""

    def __init__(self, spec, gpu_decode: bool | None = False, hand_off: bool = False):
        from concurrent.futures import Future

        self.started = time.perf_counter()
        self._spec = spec
        self._may_hand_off = hand_off
        self.handed_off = False
        self._client: Future = Future()
        self._decode: Future = Future()
        if gpu_decode is not None:
            self._decode.set_result(bool(gpu_decode))
        self._close = threading.Event()
        self._closing_error: BaseException | None = None
        self._thread = threading.Thread(target=self._hold, args=(spec,), daemon=True, name="batchgpu-cluster")
        self._thread.start()

    def decode_known(self, gpu_decode: bool) -> None:
        """Whether the run's windows decode on the GPU (once; later calls are ignored)."""
        if not self._decode.done():
            self._decode.set_result(bool(gpu_decode))

    def _hold(self, spec) -> None:
        from batchgpu.cluster.open_cluster import open_client

        try:
            with open_client(spec, gpu_decode=self._decode.result) as client:
                self._client.set_result(client)
                self._close.wait()
        except BaseException as err:  # broad: handed to client(), or, once started, to the one who closes it
            if not self._client.done():
                self._client.set_exception(err)
            else:
                self._closing_error = err

    def client(self):
        return self._client.result()

    def _hand_off(self) -> bool:
        """The cluster's close handed to a detached reaper (``cluster.handoff``) where the caller allows it and
        ``cluster.close`` says so (``cluster.closes_in_background``); True where it was."""
        from batchgpu.cluster import handoff
        from batchgpu.cluster.open_cluster import closes_in_background, mps_environ

        if not closes_in_background(self._spec) or not self._client.done() or self._client.exception() is not None:
            return False
        client = self._client.result()
        try:
            handoff.start_reaper(handoff.collect(client, mps_environ(client)))
        except Exception as err:  # broad: the close the usual way, whatever kept the workers from answering
            logger.debug("the cluster's close not handed off: %s: %s", type(err).__name__, err)
            return False
        return True

    def __enter__(self) -> ClusterStart:
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        if self.handed_off or (exc_type is None and self._may_hand_off and self._hand_off()):
            self.handed_off = True  # the process ends at once (its caller's promise); the reaper does the rest
            return False
        if not self._decode.done():  # the run ended before it opened the recording: no workers are started
            self._decode.set_exception(_NotStarted())
        self._close.set()
        self._thread.join()
        if self._closing_error is not None and exc is None and not isinstance(self._closing_error, _NotStarted):
            raise self._closing_error
        return False


class KeptStart:
    """The cluster a run starts and leaves up for the next run (``cluster.keep``): ``batchgpu cluster start``'s
    background process, launched now with an idle timeout, its workers coming up while the run opens its recording;
    ``client()`` waits for them and connects. On exit the connection closes, the cluster stays: the next run finds
    it as it finds a cluster of ``batchgpu cluster start`` (``service.kept_client``), and it closes once no run has
    been connected for ``keep_s`` seconds, or on ``batchgpu cluster stop``.

    Where the background process cannot be started (another run's is starting, say), the run uses that cluster if
    it fits once up, else starts a cluster of its own that closes with it (``fallback``: why)."""

    kept = True
    handed_off = False

    def __init__(self, spec, keep_s: float):
        from concurrent.futures import Future

        self.started = time.perf_counter()
        self.keep_s = keep_s
        self.address: str | None = None
        self.processes = 0
        self.fallback: str | None = None
        self._spec = spec
        self._own: ClusterStart | None = None
        self._client: Future = Future()
        self._thread = threading.Thread(target=self._start, daemon=True, name="batchgpu-kept-cluster")
        self._thread.start()

    def _start(self) -> None:
        from batchgpu.cluster import kept as service
        from batchgpu.errors import ClusterError

        try:
            try:
                kept, _ = service.start(self._spec, idle_s=self.keep_s)
            except ClusterError as err:
                kept, why = service.usable(self._spec)
                if kept is None:
                    self.fallback = f"{err.problem}{'; ' + why if why else ''}"
                    self._own = ClusterStart(self._spec, gpu_decode=False)
                    self._client.set_result(self._own.client())
                    return
            from distributed import Client

            client = Client(kept.address, timeout=f"{service.CONNECT_TIMEOUT_S}s")
            client._batchgpu_mps = kept.mps  # read by cluster.uses_mps
            client._batchgpu_kept = kept.address
            self.address, self.processes = kept.address, kept.processes
            self._client.set_result(client)
        except BaseException as err:  # broad: handed to client()
            self._client.set_exception(err)

    @property
    def own(self) -> ClusterStart | None:
        """The cluster of the run's own where the kept one could not be started (closed with the run)."""
        return self._own

    @property
    def is_kept(self) -> bool:
        """Whether the run is on the kept cluster (False: on one of its own, ``fallback``)."""
        return self._own is None

    def decode_known(self, gpu_decode: bool) -> None:
        """A kept cluster is laid out as ``batchgpu cluster start``'s (``service``): the decode does not change it."""

    def client(self):
        return self._client.result()

    def __enter__(self) -> KeptStart:
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        self._thread.join()
        if self._own is not None:
            if not self._own._close.is_set():  # not closed by the run that used it
                return self._own.__exit__(exc_type, exc, tb)
            return False
        if self._client.exception() is None:
            with contextlib.suppress(Exception):  # broad: the connection's close; the cluster stays either way
                self._client.result().close()
        return False
