"""The `countdown` task: reach a target with some of the given numbers and + - * /.

Prompt `3,7,25:82=`; the completion is an arithmetic expression such as `3*25+7`. Reward 1.0 when
it evaluates exactly (rational arithmetic) to the target and uses each given number at most
once. Completions are parsed with `ast` and an allow-list (integer literals, the four binary
operators, parentheses), never `eval`: anything else scores 0.0.
"""

from __future__ import annotations

import ast
import collections
from fractions import Fraction

import numpy as np

from trace_jax.tasks.base import Example, GeneratedTask, register_task

# Checked before parsing, so names, calls, strings, floats ("1.5", "1e3") and "1_0" never reach
# the parser. What passes but is still not allowed ("**", "//", unary minus) parses to a node
# the evaluator rejects.
_EXPRESSION_CHARS = frozenset("0123456789+-*/() ")
# Longer completions are garbage for these sizes; the cap also bounds parser recursion depth.
MAX_COMPLETION_CHARS = 256

_OPS = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/"}
_PRECEDENCE = {"+": 1, "-": 1, "*": 2, "/": 2}
_ATOM_PRECEDENCE = 3


class UnsafeExpression(ValueError):
  """The text is not an expression of integer literals joined by + - * / and parentheses."""


def _evaluate(node: ast.AST, used: list[int]) -> Fraction:
  if isinstance(node, ast.Expression):
    return _evaluate(node.body, used)
  if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
    left = _evaluate(node.left, used)
    right = _evaluate(node.right, used)
    op = _OPS[type(node.op)]
    if op == "+":
      return left + right
    if op == "-":
      return left - right
    if op == "*":
      return left * right
    if right == 0:
      raise ZeroDivisionError("division by zero in the expression")
    return left / right
  # `type(...) is int` excludes True/False, which are ints to isinstance.
  if isinstance(node, ast.Constant) and type(node.value) is int:
    used.append(node.value)
    return Fraction(node.value)
  raise UnsafeExpression(f"{type(node).__name__} is not allowed in a countdown expression")


def parse_expression(text: str) -> tuple[Fraction, list[int]]:
  """Exact value of `text` and the integer literals it uses, in order of appearance.

  Raises UnsafeExpression for anything outside the allow-list, ZeroDivisionError for a
  division by zero, and SyntaxError for text that is not an expression at all.
  """
  if len(text) > MAX_COMPLETION_CHARS:
    raise UnsafeExpression(f"expression longer than {MAX_COMPLETION_CHARS} characters")
  bad = sorted(set(text) - _EXPRESSION_CHARS)
  if bad:
    raise UnsafeExpression(f"characters {''.join(bad)!r} are not allowed in a countdown expression")
  tree = ast.parse(text.strip(), mode="eval")
  used: list[int] = []
  value = _evaluate(tree, used)
  return value, used


def parse_prompt(prompt: str) -> tuple[list[int], int]:
  """(numbers, target) from a prompt such as `3,7,25:82=`."""
  try:
    numbers_text, target_text = prompt.rstrip("=").split(":")
    return [int(n) for n in numbers_text.split(",")], int(target_text)
  except ValueError as e:
    raise ValueError(f"not a countdown prompt (expected like '3,7,25:82='): {prompt!r}") from e


def countdown_reward(numbers: list[int], target: int, completion: str) -> float:
  """1.0 if `completion` reaches `target` using each of `numbers` at most once; never raises."""
  try:
    value, used = parse_expression(completion)
  except (UnsafeExpression, SyntaxError, ZeroDivisionError, ValueError, RecursionError,
          MemoryError, OverflowError):
    return 0.0
  if not used or collections.Counter(used) - collections.Counter(numbers):
    return 0.0  # a literal that was not given, or a given number used too often
  return 1.0 if value == target else 0.0


def _combine(op: str, left: tuple[Fraction, str, int],
             right: tuple[Fraction, str, int]) -> tuple[Fraction, str, int]:
  """Joins two (value, text, precedence) nodes, adding only the parentheses precedence needs."""
  prec = _PRECEDENCE[op]
  left_text = left[1] if left[2] >= prec else f"({left[1]})"
  # a-(b-c) and a/(b*c) need parentheses even at equal precedence.
  right_needs_parens = right[2] < prec or (right[2] == prec and op in "-/")
  right_text = f"({right[1]})" if right_needs_parens else right[1]
  value = {"+": left[0] + right[0], "-": left[0] - right[0], "*": left[0] * right[0],
           "/": left[0] / right[0] if right[0] else None}[op]
  return value, f"{left_text}{op}{right_text}", prec


@register_task("countdown")
class CountdownTask(GeneratedTask):
  """`min_numbers`..`max_numbers` numbers in 1..`max_number` and a reachable target in
  1..`max_target`. The reference answer is one random solution using 2 or more numbers;
  targets equal to a given number (a trivial answer) are not generated."""

  name = "countdown"

  def __init__(self, min_numbers: int = 3, max_numbers: int = 4, max_number: int = 20,
               max_target: int = 200, eval_size: int | None = None, eval_seed: int = 1234):
    if not 2 <= min_numbers <= max_numbers <= 6:
      raise ValueError(f"need 2 <= min_numbers <= max_numbers <= 6, got {min_numbers}, "
                       f"{max_numbers}")
    if max_number < 2 or max_target < 2:
      raise ValueError("max_number and max_target must be at least 2")
    self.min_numbers, self.max_numbers = int(min_numbers), int(max_numbers)
    self.max_number, self.max_target = int(max_number), int(max_target)
    super().__init__(eval_size=eval_size, eval_seed=eval_seed)

  def problem_key(self, example: Example):
    numbers, target = parse_prompt(example.prompt)
    return tuple(sorted(numbers)), target  # the same multiset in another order is the same problem

  def _random_solution(self, rng: np.random.Generator, numbers: list[int]):
    count = int(rng.integers(2, len(numbers) + 1))
    pool = [(Fraction(n), str(n), _ATOM_PRECEDENCE)
            for n in rng.permutation(numbers)[:count].tolist()]
    while len(pool) > 1:
      i, j = (int(k) for k in rng.choice(len(pool), size=2, replace=False))
      a, b = pool[i], pool[j]
      # Keep intermediates positive and divisions exact and non-trivial, like the game.
      ops = ["+", "*"]
      if a[0] > b[0]:
        ops.append("-")
      if b[0] not in (0, 1) and (a[0] / b[0]).denominator == 1:
        ops.append("/")
      node = _combine(ops[int(rng.integers(len(ops)))], a, b)
      pool = [p for k, p in enumerate(pool) if k not in (i, j)] + [node]
    return pool[0]

  def sample(self, rng: np.random.Generator) -> Example:
    while True:  # resample until the target is in range and not a given number
      count = int(rng.integers(self.min_numbers, self.max_numbers + 1))
      numbers = rng.integers(1, self.max_number + 1, size=count).tolist()
      value, text, _ = self._random_solution(rng, numbers)
      if value.denominator == 1 and 1 <= value <= self.max_target and int(value) not in numbers:
        prompt = ",".join(str(n) for n in numbers) + f":{int(value)}="
        return Example(prompt, text)

  def score(self, prompt: str, completion: str, answer: str) -> float:
    numbers, target = parse_prompt(prompt)
    return countdown_reward(numbers, target, completion)

  @property
  def max_prompt_len(self) -> int:
    k = self.max_numbers
    return k * len(str(self.max_number)) + (k - 1) + 1 + len(str(self.max_target)) + 1

  @property
  def max_answer_len(self) -> int:
    # Reference answers: k numbers, k-1 operators, at most one pair of parentheses around
    # each non-root operator node. Other correct completions may be longer.
    k = self.max_numbers
    return k * len(str(self.max_number)) + (k - 1) + 2 * (k - 2)

  @property
  def alphabet(self) -> str:
    return "0123456789,:=+-*/()"
