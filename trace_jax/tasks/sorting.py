"""The `sorting` task: sort a short sequence of digits and/or letters.

Prompt `sort:q3a9=`, answer `39aq` (character order: digits before letters; repeats kept).
Reward: 1.0 for an exact match, else 0.0.
"""

from __future__ import annotations

import numpy as np

from trace_jax.tasks.base import Example, GeneratedTask, exact_match, register_task

PROMPT_PREFIX = "sort:"
SYMBOL_SETS = {
    "digits": "0123456789",
    "letters": "abcdefghijklmnopqrstuvwxyz",
    "both": "0123456789abcdefghijklmnopqrstuvwxyz",
}


@register_task("sorting")
class SortingTask(GeneratedTask):
  """Sequences of `min_len`..`max_len` symbols drawn with replacement from `symbols`
  ("digits", "letters", "both", or an explicit string of characters)."""

  name = "sorting"

  def __init__(self, min_len: int = 3, max_len: int = 6, symbols: str = "both",
               eval_size: int | None = None, eval_seed: int = 1234):
    if not 1 <= min_len <= max_len:
      raise ValueError(f"need 1 <= min_len <= max_len, got {min_len}, {max_len}")
    self.symbols = "".join(sorted(set(SYMBOL_SETS.get(symbols, symbols))))
    if len(self.symbols) < 2:
      raise ValueError(f"symbols must name a set in {sorted(SYMBOL_SETS)} or be a string of 2+ "
                       f"distinct characters, got {symbols!r}")
    self.min_len, self.max_len = int(min_len), int(max_len)
    super().__init__(eval_size=eval_size, eval_seed=eval_seed)

  @property
  def num_problems(self) -> int:
    return sum(len(self.symbols) ** n for n in range(self.min_len, self.max_len + 1))

  def sample(self, rng: np.random.Generator) -> Example:
    length = int(rng.integers(self.min_len, self.max_len + 1))
    seq = "".join(self.symbols[i] for i in rng.integers(0, len(self.symbols), size=length))
    return Example(f"{PROMPT_PREFIX}{seq}=", "".join(sorted(seq)))

  def score(self, prompt: str, completion: str, answer: str) -> float:
    return exact_match(completion, answer)

  @property
  def max_prompt_len(self) -> int:
    return len(PROMPT_PREFIX) + self.max_len + 1

  @property
  def max_answer_len(self) -> int:
    return self.max_len

  @property
  def alphabet(self) -> str:
    return "".join(sorted(set(self.symbols + PROMPT_PREFIX + "=")))
