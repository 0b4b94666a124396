"""addition and multiplication: prompt format, answers checked with Python int arithmetic,
rewards on hand-made right and wrong completions."""

import numpy as np
import pytest

from trace_jax.tasks import AdditionTask, MultiplicationTask, get_task


def _operands(prompt, op):
  assert prompt.endswith("=")
  left, right = prompt[:-1].split(op)
  return left, right


@pytest.mark.parametrize("n_digits", [1, 2, 3])
def test_addition_examples_match_python_arithmetic(n_digits):
  task = AdditionTask(n_digits=n_digits)
  for ex in task.examples("train", 300, seed=n_digits) + task.examples("eval", None)[:300]:
    left, right = _operands(ex.prompt, "+")
    assert len(left) == len(right) == n_digits  # zero-padded to a fixed width
    assert len(ex.prompt) == task.max_prompt_len
    assert ex.answer == str(int(left) + int(right))
    assert len(ex.answer) <= task.max_answer_len
  assert task.max_answer_len == n_digits + 1


@pytest.mark.parametrize("n_digits", [1, 2])
def test_multiplication_examples_match_python_arithmetic(n_digits):
  task = MultiplicationTask(n_digits=n_digits)
  for ex in task.examples("train", 300, seed=0) + task.examples("eval", None):
    left, right = _operands(ex.prompt, "*")
    assert len(left) == len(right) == n_digits
    assert ex.answer == str(int(left) * int(right))
    assert len(ex.answer) <= task.max_answer_len
  assert task.max_answer_len == 2 * n_digits


def test_format_matches_the_feasibility_probe():
  task = get_task("addition", n_digits=2)
  assert task.format_prompt(7, 48) == "07+48="
  assert task.reward(["07+48="], ["55"], ["55"]) == [1.0]
  assert task.reward(["00+00="], ["0"], ["0"]) == [1.0]


def test_addition_rewards_on_hand_made_completions():
  rng = np.random.default_rng(7)
  task = AdditionTask(n_digits=2)
  a, b = rng.integers(0, 100, size=(2, 40))
  prompts = [f"{x:02d}+{y:02d}=" for x, y in zip(a, b)]
  answers = [str(int(x) + int(y)) for x, y in zip(a, b)]
  assert task.reward(prompts, answers, answers) == [1.0] * 40
  assert task.reward(prompts, [f" {s} " for s in answers], answers) == [1.0] * 40
  wrong = [str(int(s) + 1) for s in answers]
  assert task.reward(prompts, wrong, answers) == [0.0] * 40
  for bad in ["0" + answers[0], answers[0] + "0", answers[0] + "+", "", "5 5", "x", "=55"]:
    assert task.reward(prompts[:1], [bad], answers[:1]) == [0.0]


def test_multiplication_rewards_on_hand_made_completions():
  task = MultiplicationTask(n_digits=2)
  assert task.reward(["12*34=", "99*99=", "05*00="], ["408", "9801", "0"],
                     ["408", "9801", "0"]) == [1.0, 1.0, 1.0]
  assert task.reward(["12*34=", "99*99=", "05*00="], ["407", "09801", "00"],
                     ["408", "9801", "0"]) == [0.0, 0.0, 0.0]


def test_bad_parameters():
  with pytest.raises(ValueError, match="n_digits"):
    AdditionTask(n_digits=0)
  with pytest.raises(ValueError, match="more than half"):
    MultiplicationTask(n_digits=1, eval_size=60)
