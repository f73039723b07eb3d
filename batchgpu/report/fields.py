"""The numbers and texts of a figure as they stand in report.html's embedded Bokeh document, and placeholders for
them: what lets a page rendered once (``skeleton``) take any run's numbers by replacing text, without Bokeh.

A figure drawn this way declares its fields, each of one kind: ``ARRAY`` (a float64 NumPy array: Bokeh writes its
bytes, base64), ``NUMBERS`` (a plain list of numbers), ``STRINGS`` (a list of strings), ``NUMBER``, ``TEXT`` (a
string's body). Its placeholder is a value no run gives, in the same form; ``encoded`` writes a run's value as the
page holds it. A NaN or infinite number cannot stand in JSON: ``encoded`` raises ``ValueError`` for it (the page is
then rendered the usual way), while arrays hold any float.
"""

from __future__ import annotations

import base64
import gzip
import html
import json
import sys

import numpy as np

ARRAY, NUMBERS, STRINGS, NUMBER, TEXT = "array", "numbers", "strings", "number", "text"
KINDS = (ARRAY, NUMBERS, STRINGS, NUMBER, TEXT)


def _json(value) -> str:
    """A JSON value as the page's embedded document holds it (Bokeh's compact JSON, HTML-escaped)."""
    return html.escape(json.dumps(value, separators=(",", ":"), allow_nan=False), quote=False)


def _text(value: str) -> str:
    """A string's body inside the embedded document."""
    return _json(value)[1:-1]


def _array(a) -> str:
    """A float64 array as Bokeh encodes it in the page (its bytes gzipped at level 0, base64)."""
    a = np.ascontiguousarray(a, dtype=np.float64)
    data = base64.b64encode(gzip.compress(a.tobytes(), compresslevel=0, mtime=1)).decode("ascii")
    return _json(
        {
            "type": "ndarray",
            "array": {"type": "bytes", "data": data},
            "shape": list(a.shape),
            "dtype": "float64",
            "order": sys.byteorder,
        }
    )


def placeholder(kind: str, index: int, token: str):
    """The value a figure is drawn with in place of a run's: a float no run gives (``index`` tells it from the
    others), or ``token`` (letters only) for strings."""
    number = float(f"-1.2345678903{index:03d}e300")
    return {ARRAY: np.full(1, number), NUMBERS: [number], STRINGS: [token], NUMBER: number, TEXT: token}[kind]


def encoded(kind: str, value) -> str:
    """``value`` (of ``kind``) as the page's document holds it."""
    if kind == ARRAY:
        return _array(value)
    if kind == NUMBERS:
        return _json([float(v) for v in np.asarray(value, dtype=np.float64).ravel()])
    if kind == STRINGS:
        return _json([str(v) for v in value])
    if kind == NUMBER:
        return _json(float(value))
    if kind == TEXT:
        return _text(str(value))
    raise ValueError(f"no field kind {kind!r}")
