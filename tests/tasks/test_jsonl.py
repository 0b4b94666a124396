"""JsonlTask: loading, the three named rewards, the eval hold-out, and clear errors for a
missing file or a malformed line."""

import json

import pytest

from trace_jax.tasks import JsonlTask, TaskStream, get_task, numeric_match


def _write(path, records):
  path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in records) + "\n")
  return path


@pytest.fixture
def data_file(tmp_path):
  records = [{"prompt": f"what is {a} plus {a}?", "answer": str(2 * a)} for a in range(40)]
  return _write(tmp_path / "data.jsonl", records)


def test_get_task_builds_it_and_splits_are_disjoint(data_file):
  task = get_task("jsonl", path=str(data_file), reward="exact")
  assert isinstance(task, JsonlTask)
  eval_set = task.examples("eval", None)
  assert len(eval_set) == 4  # a tenth of 40
  assert task.examples("eval", 2, seed=5) == eval_set[:2]
  eval_prompts = {ex.prompt for ex in eval_set}
  train = task.examples("train", 500, seed=0)
  assert not eval_prompts & {ex.prompt for ex in train}
  assert len({ex.prompt for ex in train}) == 36  # everything else gets drawn
  assert task.examples("train", 10, seed=1) == task.examples("train", 10, seed=1)
  assert task.max_prompt_len == max(len(f"what is {a} plus {a}?") for a in range(40))
  assert task.max_answer_len == 2
  assert set("what is plus?0123456789") == set(task.alphabet)


def test_stream_over_jsonl_resumes(data_file):
  task = JsonlTask(data_file)
  stream = TaskStream(task, seed=0, batch_size=3)
  want = [stream.next_batch() for _ in range(4)]
  resumed = TaskStream(task, seed=0, batch_size=3)
  resumed.restore({**stream.state(), "step": 2})
  assert [resumed.next_batch() for _ in range(2)] == want[2:]


def test_exact_reward(data_file):
  task = JsonlTask(data_file, reward="exact")
  assert task.reward(["p"] * 4, ["84", " 84\n", "84.0", "the answer is 84"], ["84"] * 4) == [
      1.0, 1.0, 0.0, 0.0]


def test_numeric_reward(data_file):
  task = JsonlTask(data_file, reward="numeric")
  completions = ["84", "the answer is 84.", "84.0000001", "8.4e1", "-84", "85", "no idea", "",
                 "1e999", "84 or 85"]
  want = [1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0]
  assert task.reward(["p"] * len(want), completions, ["84"] * len(want)) == want
  assert numeric_match("0.333", "1/3", abs_tol=1e-3) == 0.0  # "1/3" reads as 1
  assert numeric_match("x=-2.5", "-2.5") == 1.0


def test_contains_reward(data_file):
  task = JsonlTask(data_file, reward="contains")
  assert task.reward(["p"] * 3, ["so it is Paris.", "paris", ""], ["Paris"] * 3) == [1.0, 0.0, 0.0]


def test_callable_reward_and_eval_path(tmp_path, data_file):
  eval_file = _write(tmp_path / "eval.jsonl", [{"prompt": "what is 0 plus 0?", "answer": 0}])
  task = JsonlTask(data_file, reward=lambda completion, answer: float(len(completion)),
                   eval_path=eval_file)
  assert task.examples("eval", None)[0].answer == "0"  # numeric answers are read as text
  assert "what is 0 plus 0?" not in {ex.prompt for ex in task.examples("train", 300, seed=0)}
  assert task.reward(["p"], ["abc"], ["x"]) == [3.0]


def test_missing_file():
  with pytest.raises(FileNotFoundError, match="JSONL task file not found: '/no/such.jsonl'"):
    get_task("jsonl", path="/no/such.jsonl")


@pytest.mark.parametrize("bad_line, message", [
    ('{"prompt": "a", "answer": ', "data.jsonl:3: not valid JSON"),
    ('["a", "b"]', "data.jsonl:3: expected a JSON object"),
    ('{"prompt": "a"}', r"data.jsonl:3: missing key\(s\) \['answer'\]"),
    ('{"prompt": 5, "answer": "b"}', "data.jsonl:3: 'prompt' and 'answer' must be strings"),
    ('{"prompt": "a", "answer": true}', "data.jsonl:3: 'prompt' and 'answer' must be strings"),
])
def test_malformed_line_names_the_line(tmp_path, bad_line, message):
  path = _write(tmp_path / "data.jsonl", [{"prompt": "x", "answer": "1"}, "",
                                          bad_line, {"prompt": "y", "answer": "2"}])
  with pytest.raises(ValueError, match=message):
    JsonlTask(path)


def test_reward_specific_checks_and_bad_arguments(tmp_path, data_file):
  path = _write(tmp_path / "small.jsonl", [{"prompt": "x", "answer": "1"},
                                           {"prompt": "y", "answer": "two"}])
  with pytest.raises(ValueError, match="small.jsonl:2: reward 'numeric' needs a number"):
    JsonlTask(path, reward="numeric")
  with pytest.raises(ValueError, match="unknown reward 'fuzzy'; known rewards: exact, numeric"):
    JsonlTask(data_file, reward="fuzzy")
  empty = tmp_path / "empty.jsonl"
  empty.write_text("\n")
  with pytest.raises(ValueError, match="no examples"):
    JsonlTask(empty)
  one = _write(tmp_path / "one.jsonl", [{"prompt": "x", "answer": "1"}])
  with pytest.raises(ValueError, match="at least 2 distinct prompts"):
    JsonlTask(one)
  assert JsonlTask(one, eval_size=0).examples("eval", None) == []
  with pytest.raises(ValueError, match="eval_size=40 must be in 0..39"):
    JsonlTask(data_file, eval_size=40)
