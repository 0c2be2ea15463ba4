"""A call that keeps failing is logged once, and once more when it works again (services/eval/runner.py)."""

from __future__ import annotations

import logging

from rlep.services.eval.runner import OutageLog


def test_an_outage_is_two_lines_however_long_it_lasts(caplog):
    outage = OutageLog("cannot claim eval jobs")
    with caplog.at_level(logging.WARNING, logger="rlep.services.eval.runner"):
        for _ in range(50):
            outage.failed(ConnectionError("Connection refused"))
        outage.worked()
        outage.worked()
        outage.failed(ConnectionError("again"))
    lines = [(r.levelname, r.getMessage()) for r in caplog.records]
    assert lines == [
        ("ERROR", "cannot claim eval jobs (retrying; said again when it works): Connection refused"),
        ("WARNING", "cannot claim eval jobs: works again after 50 failed tries"),
        ("ERROR", "cannot claim eval jobs (retrying; said again when it works): again"),
    ]
    assert caplog.records[0].exc_info is not None  # the first failure keeps its traceback
