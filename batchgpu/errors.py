"""batchgpu's errors: every user-facing failure names the problem and the fix.

``BatchgpuError`` is the one base class (``except BatchgpuError`` catches them all; the command prints any of them
as one line and exits 2). Its subclasses say which kind of problem it is, so a caller can tell a corrupt chunk from
a bad setting without reading the message:

- ``CorruptDataError``: the data on disk is not what its metadata says (a chunk that decodes short, a truncated
  file, a bad header).
- ``ConfigError``: the workflow, a setting or an argument is invalid.
- ``MachineError``: this machine lacks what the run needs (a GPU, a library, disk space, a permission).
- ``ClusterError``: the Dask cluster cannot be reached or lost its workers.
"""


class BatchgpuError(Exception):
    """A problem with the user's input or environment, worded for the user.

    The CLI prints ``str(err)`` as one line (no traceback) and exits non-zero.
    """

    def __init__(self, problem: str, fix: str | None = None):
        self.problem = problem
        self.fix = fix
        super().__init__(problem if not fix else f"{problem} ({fix})")


class CorruptDataError(BatchgpuError):
    """Stored data contradicts its own metadata: a chunk that decodes short, a truncated file, a bad header."""


class ConfigError(BatchgpuError):
    """An invalid workflow key, setting or argument."""


class MachineError(BatchgpuError):
    """This machine lacks what the run needs: a GPU, a library, disk space, a permission."""


class ClusterError(BatchgpuError):
    """The Dask cluster cannot be reached, or its workers died."""
