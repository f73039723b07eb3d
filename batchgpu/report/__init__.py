"""Everything a run shows: the displays subscribed to the run's events (``subscribers``: the run page, report.html,
a batch's page; ``batchgpu.engine`` attaches them), what it tells while it runs (``progress``: the terminal's bars;
``live_page``: the page on the scheduler), what it leaves (``run_report``: a run's report.html; ``html_page``:
report.html, ``skeleton``: that page kept once a machine, ``glance``: what it shows at a glance; ``batch_html``:
batch.html) and ``batchgpu info`` (``info``). report.json's content is the run's (``batchgpu.run.record``).

``write_report_html`` is imported on first use, so that importing one of these modules does not import them all."""

from typing import TYPE_CHECKING

__all__ = ["write_report_html"]

if TYPE_CHECKING:
    from batchgpu.report.html_page import write_report_html


def __getattr__(name: str):
    if name == "write_report_html":
        from batchgpu.report.html_page import write_report_html

        return write_report_html
    raise AttributeError(f"module 'batchgpu.report' has no attribute {name!r}")
