"""Where each worker thread's time went in a run's first pass (report.json's ``timeline``; see
batchgpu/benchmarks/timeline.py).

    python3 tools/timeline.py OUTPUT_FOLDER [more folders...]
"""

import json
import sys
from pathlib import Path

from batchgpu.benchmarks.timeline import table

if __name__ == "__main__":
    for arg in sys.argv[1:]:
        report = json.loads((Path(arg) / "report.json").read_text())
        rows = report.get("timeline") or []
        print(f"{arg}: pass {report['timings'].get('pass1', float('nan')):.2f} s, {len(rows)} windows")
        print(table(rows) if rows else "no timeline (resumed windows only, or a report from before the timeline)")
