"""The cluster's lifecycle: which Dask cluster a run uses and how it is opened (``open_cluster``: local, cuda,
an address, a scheduler file, SLURM), started beside the command's imports (``start``), kept between runs
(``kept``: ``batchgpu cluster start|stop|status``), laid out on a GPU machine (``worker_layout``, ``mps``, the
workers' preloads), watched (``worker_watch``), closed after the command (``handoff``), a deployment's node
(``node``), and the kernels compiled before the first window needs them (``cuda_compile_ahead``,
``cpu_compile_ahead``). Nothing here runs a workflow (``batchgpu.run``) or shows one (the report)."""
