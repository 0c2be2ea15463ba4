"""Question identity survives the relabelling real datasets do (data_source, whitespace, Unicode form)."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rlep.common.dataset import question_id
from rlep.common.pool_parquet import read_pool_rows
from rlep.services.learner.cursor import load_questions
from tests.conftest import TEST_DATA


def test_id_ignores_data_source_whitespace_and_unicode_form():
    base = [{"role": "user", "content": "Find $x$ if\n\n  $x^2 = 4$. Caf\u00e9"}]
    rewrapped = [{"role": "User", "content": " Find $x$ if $x^2 = 4$.  Cafe\u0301\n"}]  # NFD é, other spacing
    assert question_id(base) == question_id(rewrapped)
    assert question_id(base) != question_id([{"role": "system", "content": base[0]["content"]}])
    assert question_id(base) != question_id([{"role": "user", "content": "Find $y$ if $y^2 = 4$."}])


def test_released_pool_spelling_matches_dapo17k_training_rows(tmp_path):
    """RLEP's pool says `dapo_math` where DAPO-17k says `DAPO-17k`: the same prompts must share ids."""
    rows = pq.read_table(TEST_DATA / "dapo_math_17k.parquet").slice(0, 40).to_pylist()
    assert {r["data_source"] for r in rows} == {"DAPO-17k"}
    released = [
        {
            "data_source": "dapo_math",
            "prompt": r["prompt"],
            "ability": "MATH",
            "reward_model": {
                "ground_truth": r["reward_model"]["ground_truth"],
                "style": "rule-lighteval/MATH_v2",
                "candidates": ["\\boxed{" + r["reward_model"]["ground_truth"] + "}"] * 2,
            },
            "extra_info": {"index": str(i)},
        }
        for i, r in enumerate(rows)
    ]
    pool_file = tmp_path / "pool.parquet"
    pq.write_table(pa.Table.from_pylist(released), pool_file)
    train_file = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(rows), train_file)

    training_ids = [q.question_id for q in load_questions([train_file])]
    pool_ids = [q.question_id for chunk in read_pool_rows(pool_file, "p") for q in chunk.questions]
    assert pool_ids == training_ids  # all 40 match, in order


def test_training_and_eval_read_verl_parquet_alike(tmp_path):
    """One reader: ids hash the prompt (or keep our export's), and bad rows are refused by row number."""
    from rlep.common.dataset import DatasetError, read_verl_parquet
    from rlep.services.eval.inputs import load_dataset

    chat = [{"role": "user", "content": "2+2?"}]
    rows = [{"prompt": chat, "reward_model": {"ground_truth": " 4 "}, "data_source": "mine"}]
    path, text_path = tmp_path / "t.parquet", tmp_path / "text.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    text_row = {"prompt": "3+3?", "reward_model": {"ground_truth": "6"}, "extra_info": {"question_id": "kept"}}
    pq.write_table(pa.Table.from_pylist([text_row]), text_path)
    training = load_questions([path, text_path])
    assert training == load_dataset(str(path)) + load_dataset(str(text_path))
    assert [q.question_id for q in training] == [question_id(chat), "kept"]
    assert training[0].ground_truth == "4" and training[0].data_source == "mine"
    assert training[1].chat() == [{"role": "user", "content": "3+3?"}]  # a text prompt is one user message

    for bad, message in [
        ({"prompt": chat, "reward_model": {"ground_truth": "  "}}, "row 1: reward_model.ground_truth is missing"),
        ({"prompt": [{"role": "user", "content": ""}], "reward_model": {"ground_truth": "1"}}, "row 1: prompt"),
        ({"prompt": [], "reward_model": {"ground_truth": "1"}}, "row 1: prompt must be a non-empty list"),
    ]:
        pq.write_table(pa.Table.from_pylist([rows[0], bad]), path)
        with pytest.raises(DatasetError, match=message):
            load_questions([path])
    pq.write_table(pa.table({"prompt": ["x"]}), path)
    with pytest.raises(DatasetError, match="not a verl parquet file.*no reward_model column"):
        read_verl_parquet(path)
