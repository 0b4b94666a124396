"""Procedural integer arithmetic tasks: `addition` and `multiplication`.

Prompts zero-pad both operands to `n_digits` (`07+48=`), so every prompt has the same length
(fixed shapes, no recompiles; the CPU feasibility probe learned addition in exactly this
format). Answers have no leading zeros. Reward: 1.0 for an exact match, else 0.0.
"""

from __future__ import annotations

import numpy as np

from trace_jax.tasks.base import Example, GeneratedTask, exact_match, register_task

DIGITS = "0123456789"


class ArithmeticTask(GeneratedTask):
  """`a <op> b` over non-negative `n_digits`-digit operands (uniform, zero-padded)."""

  op_symbol: str = "?"

  def __init__(self, n_digits: int = 2, eval_size: int | None = None, eval_seed: int = 1234):
    if not 1 <= int(n_digits) <= 9:  # 9 keeps operands inside int64 for numpy sampling
      raise ValueError(f"n_digits must be in 1..9, got {n_digits}")
    self.n_digits = int(n_digits)
    super().__init__(eval_size=eval_size, eval_seed=eval_seed)

  def apply(self, a: int, b: int) -> int:
    raise NotImplementedError

  @property
  def num_problems(self) -> int:
    return 10 ** (2 * self.n_digits)

  def format_prompt(self, a: int, b: int) -> str:
    return f"{a:0{self.n_digits}d}{self.op_symbol}{b:0{self.n_digits}d}="

  def sample(self, rng: np.random.Generator) -> Example:
    a, b = (int(v) for v in rng.integers(0, 10 ** self.n_digits, size=2))
    return Example(self.format_prompt(a, b), str(self.apply(a, b)))

  def score(self, prompt: str, completion: str, answer: str) -> float:
    return exact_match(completion, answer)

  @property
  def max_prompt_len(self) -> int:
    return 2 * self.n_digits + 2

  @property
  def max_answer_len(self) -> int:
    largest = 10 ** self.n_digits - 1
    return len(str(self.apply(largest, largest)))

  @property
  def alphabet(self) -> str:
    return DIGITS + self.op_symbol + "="


@register_task("addition")
class AdditionTask(ArithmeticTask):
  name = "addition"
  op_symbol = "+"

  def apply(self, a: int, b: int) -> int:
    return a + b


@register_task("multiplication")
class MultiplicationTask(ArithmeticTask):
  name = "multiplication"
  op_symbol = "*"

  def apply(self, a: int, b: int) -> int:
    return a * b
