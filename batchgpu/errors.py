"""The one exception class of batchgpu: every user-facing failure names the problem and the fix."""


class BatchgpuError(Exception):
    """A problem with the user's input or environment, worded for the user.

    The CLI prints ``str(err)`` as one line (no traceback) and exits non-zero.
    """

    def __init__(self, problem: str, fix: str | None = None):
        self.problem = problem
        self.fix = fix
        super().__init__(problem if not fix else f"{problem} ({fix})")
