"""sorting: answers are the sorted prompt symbols (checked with Python's sorted), rewards on
hand-made completions, and the symbol-set options."""

import pytest

from trace_jax.tasks import SortingTask


@pytest.mark.parametrize("symbols", ["digits", "letters", "both", "xyz"])
def test_answers_are_sorted_prompt_symbols(symbols):
  task = SortingTask(symbols=symbols, min_len=2, max_len=5)
  for ex in task.examples("train", 200, seed=0) + task.examples("eval", None)[:100]:
    assert ex.prompt.startswith("sort:") and ex.prompt.endswith("=")
    seq = ex.prompt[len("sort:"):-1]
    assert 2 <= len(seq) <= 5
    assert ex.answer == "".join(sorted(seq))
    assert set(ex.prompt + ex.answer) <= set(task.alphabet)
    assert len(ex.prompt) <= task.max_prompt_len and len(ex.answer) <= task.max_answer_len


def test_hand_made_rewards():
  task = SortingTask()
  prompts = ["sort:q3a9="] * 6
  completions = ["39aq", " 39aq", "39qa", "39a", "39aqq", "sort:39aq"]
  assert task.reward(prompts, completions, ["39aq"] * 6) == [1.0, 1.0, 0.0, 0.0, 0.0, 0.0]


def test_repeats_are_kept():
  task = SortingTask()
  assert task.reward(["sort:bab="], ["abb"], ["abb"]) == [1.0]
  assert task.reward(["sort:bab="], ["ab"], ["abb"]) == [0.0]


def test_bad_symbols():
  with pytest.raises(ValueError, match="symbols"):
    SortingTask(symbols="a")
