"""Reading experiment-tracking output back: TensorBoard scalars with TensorBoard's own reader, and the values
the JSONL step log says they should hold (services/learner/tracking.py)."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from rlep.services.learner.records import LogRecord
from rlep.services.learner.tracking import flatten_numbers


def read_scalars(log_dir: Path) -> dict[str, dict[int, float]]:
    """name -> step -> value of every scalar in the event files of `log_dir`."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(log_dir))
    events.Reload()
    return {tag: {e.step: e.value for e in events.Scalars(tag)} for tag in events.Tags()["scalars"]}


def read_texts(log_dir: Path, tag: str) -> dict[int, str]:
    """step -> the text summary `tag` holds at that step (TensorBoard stores text as a string tensor)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(log_dir), size_guidance={"tensors": 0})
    events.Reload()
    return {e.step: e.tensor_proto.string_val[0].decode() for e in events.Tensors(f"{tag}/text_summary")}


def jsonl_scalars(records: Iterable[LogRecord]) -> dict[str, dict[int, float]]:
    """name -> step -> value that the records' JSONL lines hold: numeric leaves, nested names joined by `/`."""
    expected: dict[str, dict[int, float]] = {}
    for record in records:
        line = json.loads(json.dumps(record.to_json()))
        for name, value in flatten_numbers(line).items():
            if name != "step":
                expected.setdefault(name, {})[record.step] = value
    return expected
