"""Chaos tests (issue #8 item 6): run by ``make chaos`` only.

They are collected only when ``ACTORSERVE_CHAOS=1`` (``make chaos`` sets it), so ``make test`` and a
plain ``pytest`` never start them. At the end of the session the per-fault table is printed (and the
JSON report's path), whatever pytest's output capture.
"""

from __future__ import annotations

import os

from tests.chaos import report

if os.environ.get("ACTORSERVE_CHAOS") != "1":
    collect_ignore_glob = ["test_*.py"]


def pytest_configure(config) -> None:
    """Register the ``chaos`` marker."""
    config.addinivalue_line("markers", "chaos: fault injection under load (make chaos; ACTORSERVE_CHAOS=1)")


def pytest_terminal_summary(terminalreporter) -> None:
    """Print the chaos table (and where the JSON report is) after the test summary."""
    if not report.RESULTS:
        return
    terminalreporter.section("chaos: requests and jobs per fault")
    terminalreporter.write_line(report.render_table(report.RESULTS))
    for p in report.WRITTEN:
        terminalreporter.write_line(f"JSON report: {p}")
