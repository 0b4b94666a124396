"""countdown: reference answers reach their targets (checked by an independent Fraction
evaluator), hand-made rewards, number-use rules, and the parser refusing unsafe input."""

import builtins
import re
from fractions import Fraction

import pytest

from trace_jax.tasks import CountdownTask, countdown_reward, parse_expression
from trace_jax.tasks.countdown import UnsafeExpression, parse_prompt


def _independent_value(expr):
  """Python's own arithmetic over Fractions, on trusted (generated) expressions only."""
  assert set(expr) <= set("0123456789+-*/()")
  as_fractions = re.sub(r"\d+", lambda m: f"F({m.group()})", expr)
  return eval(as_fractions, {"__builtins__": {}, "F": Fraction})


def test_reference_answers_reach_the_target_with_given_numbers():
  task = CountdownTask()
  examples = task.examples("train", 300, seed=1) + task.examples("eval", 200)
  for ex in examples:
    numbers, target = parse_prompt(ex.prompt)
    assert 3 <= len(numbers) <= 4 and all(1 <= n <= 20 for n in numbers)
    assert 1 <= target <= 200 and target not in numbers
    assert _independent_value(ex.answer) == target
    used = [int(t) for t in re.findall(r"\d+", ex.answer)]
    assert len(used) >= 2
    assert all(used.count(n) <= numbers.count(n) for n in used)
    assert len(ex.prompt) <= task.max_prompt_len and len(ex.answer) <= task.max_answer_len
  assert task.reward([e.prompt for e in examples], [e.answer for e in examples],
                     [e.answer for e in examples]) == [1.0] * len(examples)


@pytest.mark.parametrize("completion, want", [
    ("3*25+7", 1.0), ("(3*25)+7", 1.0), ("7+25*3", 1.0), (" 3 * 25 + 7 ", 1.0),
    ("25*3+7", 1.0),
    ("3*25+8", 0.0),        # wrong value
    ("82", 0.0),            # 82 is not a given number
    ("3*25+7+0", 0.0),      # 0 is not given
    ("3*25+7*1", 0.0),      # 1 is not given
    ("3*25+7-3+3", 0.0),    # 3 used three times
    ("3*(25+7)", 0.0),      # 96
])
def test_hand_made_rewards(completion, want):
  task = CountdownTask()
  assert task.reward(["3,7,25:82="], [completion], ["3*25+7"]) == [want]


def test_division_is_exact_and_numbers_may_repeat_when_given_twice():
  assert countdown_reward([6, 4, 3], 8, "6/3*4") == 1.0
  assert countdown_reward([6, 4, 3], 8, "4/3*6") == 1.0  # exact: 4/3 is not rounded
  assert countdown_reward([7, 2, 5], 1, "7/2-5/2") == 0.0  # 2 is given once, used twice
  assert countdown_reward([7, 2, 2, 5], 1, "7/2-5/2") == 1.0
  assert countdown_reward([5, 5, 2], 1, "2/(5-5)") == 0.0  # division by zero scores 0
  assert countdown_reward([3, 7], 3, "3") == 1.0  # "at most once": unused numbers are fine


@pytest.mark.parametrize("text", [
    "__import__('os').system('echo hi')", "3**2", "-3+85", "3//2", "1e2", "0x52", "3.0*25",
    "abs(82)", "[82][0]", "82 if 1 else 0", "lambda: 82", "3*25+7; 1", "3*25+7\n", "a+b",
    "3 == 3", "3 < 4", "3 % 2", "3 & 1", "~3", "+3",
])
def test_parser_refuses_anything_but_the_four_operators(text):
  with pytest.raises((UnsafeExpression, SyntaxError)):
    parse_expression(text)
  assert countdown_reward([3, 7, 25, 2, 1], 82, text) == 0.0


@pytest.mark.parametrize("text", [
    "", "(", "((((", "3+", "()", "(" * 300 + "3" + ")" * 300, "9" * 5000, "3" * 200 + "+1",
    "03+7", "3 7", "\x00", "🙂", "3*25+7=82",
])
def test_garbage_completions_score_zero(text):
  assert countdown_reward([3, 7, 25], 82, text) == 0.0


def test_parser_never_calls_eval(monkeypatch):
  def forbidden(*args, **kwargs):
    raise AssertionError("eval must not be called")
  monkeypatch.setattr(builtins, "eval", forbidden)
  monkeypatch.setattr(builtins, "exec", forbidden)
  assert parse_expression("(3+7)*25/5") == (Fraction(50), [3, 7, 25, 5])
  assert countdown_reward([3, 7, 25], 82, "3*25+7") == 1.0


def test_eval_problems_are_matched_up_to_number_order():
  task = CountdownTask()
  ex = task.examples("eval", 1)[0]
  numbers, target = parse_prompt(ex.prompt)
  reordered = type(ex)(",".join(map(str, reversed(numbers))) + f":{target}=", ex.answer)
  assert task.is_eval_problem(reordered)


def test_bad_prompt_and_parameters():
  with pytest.raises(ValueError, match="not a countdown prompt"):
    parse_prompt("12+34=")
  with pytest.raises(ValueError, match="min_numbers"):
    CountdownTask(min_numbers=1)


def test_too_small_a_problem_space_for_the_eval_size_fails_instead_of_hanging():
  task = CountdownTask(min_numbers=2, max_numbers=2, max_number=2, max_target=4, eval_size=50)
  with pytest.raises(RuntimeError, match="smaller eval_size"):
    task.examples("eval", None)
