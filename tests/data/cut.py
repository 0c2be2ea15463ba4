"""Cut the small data slices in tests/data/ from the full public data sets (see tests/data/README.md).

    python tests/data/cut.py SOURCE_DIR

SOURCE_DIR holds the full files: dapo_math_17k.parquet (verl schema) and aime24/aime25/amc23/math500.jsonl.
The slices are written beside this script. No test runs it: the tests read the slices it wrote.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pyarrow.parquet as pq

OUT_DIR = Path(__file__).resolve().parent
DAPO_ROWS = 200  # rows 35 and 179 repeat one prompt, which tests/unit/test_learner_batch.py relies on
# The verifier test reads every gold answer of these four sets, and nothing else.
ANSWER_SETS = {"aime24": "id", "aime25": "id", "amc23": "id", "math500": "unique_id"}


def cut_dapo(source: Path) -> None:
    """The first DAPO_ROWS rows, every column, the source's own schema (metadata included)."""
    table = pq.read_table(source / "dapo_math_17k.parquet")
    pq.write_table(table.slice(0, DAPO_ROWS), OUT_DIR / "dapo_math_17k.parquet", compression="zstd")


def cut_answers(source: Path, name: str, id_field: str) -> None:
    """Every row, keeping only its id and its gold answer (with the answer's JSON type: int, float or str)."""
    lines = (source / f"{name}.jsonl").read_text().splitlines()
    rows = [json.loads(line) for line in lines if line.strip()]
    kept = [{id_field: row[id_field], "answer": row["answer"]} for row in rows]
    (OUT_DIR / f"{name}.jsonl").write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in kept))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("source", type=Path, help="folder holding the full data sets")
    source = parser.parse_args().source
    cut_dapo(source)
    for name, id_field in ANSWER_SETS.items():
        cut_answers(source, name, id_field)


if __name__ == "__main__":
    main()
