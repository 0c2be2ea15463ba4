"""Training questions from verl/DAPO parquet (read by `rlep.common.dataset`), and a resumable cursor over them.

The cursor walks a seeded permutation of the questions, epoch after epoch; its state is two
integers (epoch, position), saved with every checkpoint, so a resumed run neither skips nor repeats
a prompt.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from rlep.common.dataset import Question, read_verl_parquet

__all__ = ["DataCursor", "Question", "load_questions"]


def load_questions(paths: Sequence[Path]) -> list[Question]:
    """The questions of verl-schema parquet files, in order (`read_verl_parquet` says what is refused)."""
    questions = [question for path in paths for question in read_verl_parquet(path)]
    if not questions:
        raise ValueError(f"no questions in {[str(p) for p in paths]}")
    return questions


class DataCursor:
    def __init__(self, count: int, seed: int, shuffle: bool = True):
        if count <= 0:
            raise ValueError("no questions to iterate over")
        self.count, self.seed, self.shuffle = count, seed, shuffle
        self.epoch, self.position = 0, 0
        self._order = self._permutation(0)

    def _permutation(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(self.count)
        return np.random.default_rng([self.seed, epoch]).permutation(self.count)

    def next_indices(self, size: int) -> list[int]:
        """The next `size` question indices, crossing into the next epoch's permutation when needed."""
        out: list[int] = []
        while len(out) < size:
            take = min(size - len(out), self.count - self.position)
            out.extend(int(i) for i in self._order[self.position : self.position + take])
            self.position += take
            if self.position == self.count:
                self.epoch, self.position = self.epoch + 1, 0
                self._order = self._permutation(self.epoch)
        return out

    def state(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position, "count": self.count, "seed": self.seed}

    def restore(self, state: dict[str, int]) -> None:
        if state["count"] != self.count or state["seed"] != self.seed:
            raise ValueError(f"checkpoint cursor is for {state['count']} questions / seed {state['seed']}")
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        self._order = self._permutation(self.epoch)
