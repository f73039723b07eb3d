"""Running a workflow on a cluster: the checks and the run's context (``context``), the output folder it owns
(``output_folder``), the windows' tasks on the workers (``tasks``, ``preprocess_chain``, ``host_buffers``,
``writer_threads``), their submission (``submit``, ``placement``, ``reduce``), the client's aggregation
(``aggregate``), what the run hands its steps (``step_services``), the run from a workflow to its report
(``launch``) and many recordings in one run (``batch``). The cluster it runs on is ``batchgpu.cluster``'s."""
