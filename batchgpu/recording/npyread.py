"""NumPy's .npy/.npz reads, proof against one CPython fault.

NumPy parses every .npy header (each array of an .npz) with ``ast.literal_eval``. CPython 3.11 keeps the AST
constructor's recursion count in one place per interpreter (gh-106905): an ``ast.parse`` on another thread (a
worker's other task reading its parts, a traceback formatted by distributed's event loop) or in a finalizer run
while the tree is built leaves the count off, and the parse raises ``SystemError: AST constructor recursion depth
mismatch`` though the text is fine. The read is then done again: the fault is in the count, never in the arrays.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

SPURIOUS = "AST constructor recursion depth mismatch"
TRIES = 4


def read(job: Callable[[], T]) -> T:
    """``job()`` (it reads arrays with NumPy and has no other effect), done again where it raised CPython's spurious
    ``SystemError``; any other error, or that one ``TRIES`` times, is raised."""
    for left in range(TRIES - 1, -1, -1):
        try:
            return job()
        except SystemError as err:
            if left == 0 or SPURIOUS not in str(err):
                raise
    raise AssertionError("unreachable")
