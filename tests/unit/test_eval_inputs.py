"""What an eval job reads: built-in and user datasets, checkpoints, confinement to allowed roots (and eval config)."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from pydantic import ValidationError

from rlep.common.dataset import question_id
from rlep.common.types import Verdict
from rlep.services.cli.eval import parse_datasets
from rlep.services.eval.accuracy import DatasetTally, SampleScore, score_question
from rlep.services.eval.config import EvalConfig, EvalLimits, HttpServerConfig, RolloutEndpoints, VerifierEndpoint
from rlep.services.eval.inputs import BOXED_INSTRUCTION, DatasetError, checkpoint_files, load_dataset
from rlep.services.verifier.judge import check_answer

SIZES = {"aime24": 30, "aime25": 30, "amc23": 40, "math500": 500, "gsm8k": 1319}


def sample(verdict: Verdict, answer: str = "", tokens: int = 10, truncated: bool = False) -> SampleScore:
    return SampleScore(verdict, answer, tokens, truncated)


@pytest.mark.parametrize("name", sorted(SIZES))
def test_builtin_datasets_ship_in_the_package_with_text_gold_answers(name):
    questions = load_dataset(name)
    assert len(questions) == SIZES[name]
    assert len({q.question_id for q in questions}) == len(questions)
    for q in questions:
        assert q.ground_truth and q.ground_truth == q.ground_truth.strip()
        [message] = q.chat()
        assert message["role"] == "user" and message["content"].endswith(BOXED_INSTRUCTION)
        assert q.question_id == question_id([message]) and q.data_source == name


def test_gold_answers_are_read_per_source_format():
    gsm8k = load_dataset("gsm8k")
    assert gsm8k[0].ground_truth == "18"  # "... #### 18" after the worked solution
    assert all("####" not in q.ground_truth and "," not in q.ground_truth for q in gsm8k)
    assert "114200" in {q.ground_truth for q in gsm8k}  # "#### 114,200" in the file
    assert load_dataset("amc23")[0].ground_truth == "27"  # stored as the float 27.0
    assert load_dataset("aime25")[0].ground_truth == "70"  # stored as an int
    assert load_dataset("math500")[0].ground_truth == "\\left( 3, \\frac{\\pi}{2} \\right)"


def test_limit_takes_the_first_questions_in_order():
    whole = load_dataset("amc23")
    assert load_dataset("amc23", limit=3) == whole[:3]
    assert load_dataset("amc23", limit=1000) == whole


def test_a_correct_boxed_answer_counts_against_every_builtin_gold_format():
    """The datasets' gold strings and the verifier agree: a right \\boxed{} answer scores 1."""
    cases = [
        (load_dataset("amc23", 1)[0], "They meet after 1.5 hours, so \\boxed{27}."),
        (load_dataset("gsm8k", 1)[0], "16 - 3 - 4 = 9 eggs, 9 * 2 = \\boxed{18}"),
        (load_dataset("aime25", 1)[0], "The answer is \\boxed{070}"),
        (load_dataset("math500", 1)[0], "So \\boxed{\\left(3, \\frac{\\pi}{2}\\right)}"),
    ]
    for question, response in cases:
        result = check_answer(response, question.ground_truth)
        assert result.verdict == Verdict.CORRECT, (question.question_id, result)
        wrong = check_answer("\\boxed{123456789}", question.ground_truth)
        assert wrong.verdict == Verdict.WRONG
        tally = DatasetTally()
        tally.add(score_question([sample(result.verdict, result.extracted_answer), sample(wrong.verdict, "123456789")]))
        assert tally.summary()["avg_at_n"] == 0.5 and tally.summary()["pass_at_n"] == 1.0


def test_unknown_and_unusable_names_say_what_is_accepted(tmp_path):
    with pytest.raises(DatasetError, match="unknown dataset 'aime23'.*aime24, aime25, amc23, math500, gsm8k"):
        load_dataset("aime23")
    with pytest.raises(DatasetError, match="does not exist"):
        load_dataset(str(tmp_path / "missing.jsonl"))
    with pytest.raises(DatasetError, match="not a usable path"):
        load_dataset("bad\x00name.jsonl")
    with pytest.raises(DatasetError, match="not a file"):
        (tmp_path / "dir.jsonl").mkdir()
        load_dataset(str(tmp_path / "dir.jsonl"))
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(DatasetError, match="no questions"):
        load_dataset(str(tmp_path / "empty.jsonl"))


def test_user_jsonl_reads_problem_and_answer(tmp_path):
    path = tmp_path / "mine.jsonl"
    rows = [
        {"problem": "1+1?", "answer": 2},
        {"problem": "Half?", "answer": "\\frac12"},
        {"question": "x", "answer": 3.5},
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    questions = load_dataset(str(path))
    assert [q.ground_truth for q in questions] == ["2", "\\frac12", "3.5"]
    assert questions[0].chat()[0]["content"].startswith("1+1?")
    assert questions[1].question_id == question_id(questions[1].chat()) and questions[1].data_source == str(path)


@pytest.mark.parametrize(
    ("line", "message"),
    [('{"problem": "p"}', "line 2 needs 'problem' and 'answer'"), ("{oops", "line 2 is not JSON"), ("[1]", "line 2")],
)
def test_bad_user_jsonl_names_the_line(tmp_path, line, message):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"problem": "ok", "answer": 1}\n' + line + "\n")
    with pytest.raises(DatasetError, match=message):
        load_dataset(str(path))


def _write_verl(path, rows):
    prompt_type = pa.list_(pa.struct([("content", pa.string()), ("role", pa.string())]))
    schema = pa.schema([("prompt", prompt_type), ("reward_model", pa.struct([("ground_truth", pa.string())]))])
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), path)


def test_verl_parquet_keeps_its_prompt_as_is(tmp_path):
    path = tmp_path / "train.parquet"
    chat = [{"role": "system", "content": "Answer: X"}, {"role": "user", "content": "2+2?"}]
    _write_verl(path, [{"prompt": chat, "reward_model": {"ground_truth": "4"}}])
    [question] = load_dataset(str(path))
    assert question.chat() == chat and question.ground_truth == "4"
    assert question.question_id == question_id(chat)  # the id training and replay give the same prompt
    _write_verl(path, [{"prompt": chat, "reward_model": {"ground_truth": None}}])
    with pytest.raises(DatasetError, match="row 0: reward_model.ground_truth"):
        load_dataset(str(path))
    pq.write_table(pa.table({"question": ["x"]}), path)
    with pytest.raises(DatasetError, match="not a verl parquet"):
        load_dataset(str(path))


UNAVAILABLE = "does not exist on the eval server under its allowed directories"


def test_allowed_roots_confine_user_files_and_checkpoints(tmp_path):
    inside, outside = tmp_path / "data", tmp_path / "elsewhere"
    inside.mkdir(), outside.mkdir()
    for folder in (inside, outside):
        (folder / "q.jsonl").write_text('{"problem": "p", "answer": 1}\n')
    (inside / "link.jsonl").symlink_to(outside / "q.jsonl")
    (outside / "model.safetensors").write_bytes(b"x")
    assert load_dataset(str(inside / "q.jsonl"), allowed_roots=[inside])
    # Outside, through "..", through a symlink, or missing: one answer, so existence cannot be probed.
    for name in (outside / "q.jsonl", f"{inside}/../elsewhere/q.jsonl", inside / "link.jsonl", outside / "no.jsonl"):
        with pytest.raises(DatasetError) as err:
            load_dataset(str(name), allowed_roots=[inside])
        assert str(err.value) == f"dataset file {str(name)!r} {UNAVAILABLE}"
    for model in (outside, outside / "model.safetensors", outside / "missing"):
        with pytest.raises(DatasetError) as err:
            checkpoint_files(str(model), allowed_roots=[inside])
        assert str(err.value) == f"model {str(model)!r} {UNAVAILABLE}"
    with pytest.raises(DatasetError, match=UNAVAILABLE):  # no roots: built-in sets only
        load_dataset(str(inside / "q.jsonl"), allowed_roots=[])
    assert len(load_dataset("amc23", allowed_roots=[])) == 40


def test_the_service_confines_user_files_to_its_working_directory_by_default(tmp_path, monkeypatch):
    (tmp_path / "work").mkdir()
    monkeypatch.chdir(tmp_path / "work")
    roots = EvalConfig().allowed_roots
    assert roots == [tmp_path / "work"]
    (tmp_path / "work" / "q.jsonl").write_text('{"problem": "p", "answer": 1}\n')
    (tmp_path / "other.jsonl").write_text('{"problem": "p", "answer": 1}\n')
    assert len(load_dataset("q.jsonl", allowed_roots=roots)) == 1
    with pytest.raises(DatasetError, match=UNAVAILABLE):
        load_dataset(str(tmp_path / "other.jsonl"), allowed_roots=roots)


def test_checkpoint_files_want_safetensors(tmp_path):
    (tmp_path / "b.safetensors").write_bytes(b"x")
    (tmp_path / "a.safetensors").write_bytes(b"x")
    assert [p.name for p in checkpoint_files(str(tmp_path))] == ["a.safetensors", "b.safetensors"]
    assert checkpoint_files(str(tmp_path / "a.safetensors")) == [tmp_path / "a.safetensors"]
    (tmp_path / "empty").mkdir()
    with pytest.raises(DatasetError, match="neither 'current' nor a checkpoint"):
        checkpoint_files(str(tmp_path / "empty"))
    with pytest.raises(DatasetError, match="does not exist"):
        checkpoint_files("currrent")


def test_parse_datasets_reads_optional_limits():
    parsed = parse_datasets("aime24, amc23:10,/data/my:file.jsonl:5,")
    assert [(d.name, d.limit) for d in parsed] == [("aime24", None), ("amc23", 10), ("/data/my:file.jsonl", 5)]


def test_eval_config_is_documented_and_keeps_the_training_policy_safe():
    for model in (EvalConfig, HttpServerConfig, RolloutEndpoints, VerifierEndpoint, EvalLimits):
        undocumented = [name for name, field in model.model_fields.items() if not field.description]
        assert not undocumented, f"{model.__name__}: {undocumented}"
    assert EvalConfig().server.host == "127.0.0.1" and EvalConfig().server.port == 8080
    with pytest.raises(ValidationError, match="replace the policy being trained"):
        EvalConfig(rollout={"addresses": ["a:1", "b:2"]}, checkpoint_rollout={"addresses": ["b:2"]})
    EvalConfig(rollout={"addresses": ["a:1"]}, checkpoint_rollout={"addresses": ["b:2"]})


def test_reading_a_user_file_stops_at_the_limit(tmp_path):
    """A submission reads only the questions it asks for: a bad row past `limit` is never reached."""
    jsonl = tmp_path / "q.jsonl"
    jsonl.write_text('{"problem": "a", "answer": 1}\n{"problem": "b", "answer": 2}\n{oops\n')
    assert [q.ground_truth for q in load_dataset(str(jsonl), limit=2)] == ["1", "2"]
    with pytest.raises(DatasetError, match="line 3 is not JSON"):
        load_dataset(str(jsonl))
    parquet = tmp_path / "q.parquet"
    rows = [
        {"prompt": [{"role": "user", "content": f"{i}?"}], "reward_model": {"ground_truth": str(i)}}
        for i in range(3000)
    ]
    rows[2500]["reward_model"]["ground_truth"] = None
    _write_verl(parquet, rows)
    assert [q.ground_truth for q in load_dataset(str(parquet), limit=3)] == ["0", "1", "2"]
    assert len(load_dataset(str(parquet), limit=2000)) == 2000
    with pytest.raises(DatasetError, match="row 2500: reward_model.ground_truth"):
        load_dataset(str(parquet))
