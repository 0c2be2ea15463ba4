"""Reading a service's /metrics in tests: by series name and a subset of labels (the `service` label and
any others not named are ignored)."""

from __future__ import annotations

import re
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

_SERIES = re.compile(r"^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(?P<labels>.*)\})?$")


def scrape(port: int, token: str | None = None) -> str:
    request = urllib.request.Request(f"http://127.0.0.1:{port}/metrics")
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    return urllib.request.urlopen(request, timeout=10).read().decode()


def samples(text: str) -> list:
    return [s for family in text_string_to_metric_families(text) for s in family.samples]


def series_value(text: str, series: str) -> float:
    """Value of `name{k="v",...}` (labels matched as a subset); AssertionError when not exported."""
    match = _SERIES.match(series)
    if not match:
        raise ValueError(f"not a series: {series}")
    wanted = dict(re.findall(r'(\w+)="([^"]*)"', match["labels"] or ""))
    found = [s.value for s in samples(text) if s.name == match["name"] and wanted.items() <= s.labels.items()]
    if not found:
        raise AssertionError(f"{series} not exported")
    return sum(found)


def service_labels(text: str) -> set[str]:
    return {s.labels.get("service", "") for s in samples(text)}
