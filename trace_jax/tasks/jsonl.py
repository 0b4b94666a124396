"""`JsonlTask`: bring-your-own data as a JSONL file of {"prompt": ..., "answer": ...} lines,
scored by a named reward ("exact", "numeric", "contains"; see REWARDS).

Registered as "jsonl": `get_task("jsonl", path="data.jsonl", reward="numeric")`. The eval split
is either a second file (`eval_path`) or a fixed, seeded held-out subset of the file; training
never returns a prompt that is in the eval split.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Callable

import numpy as np

from trace_jax.tasks.base import Example, Task, check_split, exact_match, register_task

# The first number in a text: optional sign, digits with an optional fraction, optional exponent.
_NUMBER = re.compile(r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?")


def first_number(text: str) -> float | None:
  """The first number written in `text` ("1,000" reads as 1), or None if there is none."""
  match = _NUMBER.search(text)
  if match is None:
    return None
  value = float(match.group())
  return value if math.isfinite(value) else None


def numeric_match(completion: str, answer: str, rel_tol: float = 1e-6,
                  abs_tol: float = 1e-6) -> float:
  """1.0 when the first numbers of completion and answer agree within tolerance."""
  got, want = first_number(completion), first_number(answer)
  if got is None or want is None:
    return 0.0
  return 1.0 if math.isclose(got, want, rel_tol=rel_tol, abs_tol=abs_tol) else 0.0


def contains_match(completion: str, answer: str) -> float:
  """1.0 when the answer (without surrounding whitespace) appears anywhere in the completion."""
  needle = answer.strip()
  return 1.0 if needle and needle in completion else 0.0


REWARDS: dict[str, Callable[[str, str], float]] = {
    "exact": exact_match,
    "numeric": numeric_match,
    "contains": contains_match,
}


def _read_jsonl(path: str, reward_name: str | None) -> list[Example]:
  if not os.path.isfile(path):
    raise FileNotFoundError(f"JSONL task file not found: {path!r} (pass path= to a file of "
                            '{"prompt": ..., "answer": ...} lines)')
  examples = []
  with open(path, encoding="utf-8") as f:
    for lineno, line in enumerate(f, start=1):
      if not line.strip():
        continue  # blank lines (e.g. a trailing newline) are not records
      where = f"{path}:{lineno}"
      try:
        record = json.loads(line)
      except json.JSONDecodeError as e:
        raise ValueError(f"{where}: not valid JSON ({e.msg}); each line must be one object like "
                         '{"prompt": "...", "answer": "..."}') from None
      if not isinstance(record, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(record).__name__}")
      missing = [k for k in ("prompt", "answer") if k not in record]
      if missing:
        raise ValueError(f"{where}: missing key(s) {missing}; each line needs 'prompt' and "
                         "'answer'")
      prompt, answer = record["prompt"], record["answer"]
      # Numeric answers are common in hand-made files; accept them as their text.
      if isinstance(answer, (int, float)) and not isinstance(answer, bool):
        answer = str(answer)
      if not isinstance(prompt, str) or not isinstance(answer, str):
        raise ValueError(f"{where}: 'prompt' and 'answer' must be strings, got "
                         f"{type(prompt).__name__} and {type(answer).__name__}")
      if reward_name == "numeric" and first_number(answer) is None:
        raise ValueError(f"{where}: reward 'numeric' needs a number in the answer, got {answer!r}")
      if reward_name == "contains" and not answer.strip():
        raise ValueError(f"{where}: reward 'contains' needs a non-empty answer")
      examples.append(Example(prompt, answer))
  if not examples:
    raise ValueError(f"{path}: no examples (the file is empty)")
  return examples


@register_task("jsonl")
class JsonlTask(Task):
  """Examples from `path`; `reward` is a name in REWARDS or a callable(completion, answer).

  Without `eval_path`, `eval_size` distinct prompts (default: a tenth, at most 1000) chosen
  with `eval_seed` are held out. Training samples the remaining examples with replacement.
  """

  name = "jsonl"

  def __init__(self, path: str | os.PathLike, reward: str | Callable[[str, str], float] = "exact",
               eval_path: str | os.PathLike | None = None, eval_size: int | None = None,
               eval_seed: int = 1234):
    if callable(reward):
      self.reward_name, self._reward_fn = getattr(reward, "__name__", "custom"), reward
    elif reward in REWARDS:
      self.reward_name, self._reward_fn = reward, REWARDS[reward]
    else:
      raise ValueError(f"unknown reward {reward!r}; known rewards: {', '.join(REWARDS)} "
                       "(or pass a callable(completion, answer) -> float)")
    check = self.reward_name if not callable(reward) else None
    self.path = os.fspath(path)
    everything = _read_jsonl(self.path, check)
    if eval_path is not None:
      if eval_size is not None:
        raise ValueError("pass eval_path or eval_size, not both")
      self._eval = _read_jsonl(os.fspath(eval_path), check)
    else:
      self._eval = self._hold_out(everything, eval_size, eval_seed)
    eval_prompts = {ex.prompt for ex in self._eval}
    self._train = [ex for ex in everything if ex.prompt not in eval_prompts]
    if not self._train:
      raise ValueError(f"{self.path}: every example is in the eval split, none left to train on")
    self._all = everything + (self._eval if eval_path is not None else [])

  def _hold_out(self, examples: list[Example], eval_size: int | None,
                eval_seed: int) -> list[Example]:
    first_by_prompt: dict[str, Example] = {}
    for ex in examples:
      first_by_prompt.setdefault(ex.prompt, ex)
    distinct = list(first_by_prompt.values())
    if eval_size is None:
      if len(distinct) < 2:
        raise ValueError(f"{self.path}: needs at least 2 distinct prompts to hold some out for "
                         "eval (or pass eval_size=0, or eval_path=)")
      eval_size = min(1000, max(1, len(distinct) // 10))
    if not 0 <= eval_size < len(distinct):
      raise ValueError(f"{self.path}: eval_size={eval_size} must be in 0..{len(distinct) - 1} "
                       f"(the file has {len(distinct)} distinct prompts)")
    order = np.random.default_rng(eval_seed).permutation(len(distinct))
    return [distinct[i] for i in order[:eval_size]]

  def examples(self, split: str, n: int | None, seed: int = 0) -> list[Example]:
    """Train: `n` draws with replacement seeded by `seed`. Eval: the first `n` held-out
    examples in a fixed order (all for n=None); `seed` is ignored."""
    check_split(split)
    if split == "eval":
      if n is None:
        return list(self._eval)
      if n > len(self._eval):
        raise ValueError(f"asked for {n} eval examples but {self.path} holds out "
                         f"{len(self._eval)}")
      return self._eval[:n]
    if n is None:
      raise ValueError("the train split is sampled with replacement: pass n")
    picks = np.random.default_rng(seed).integers(0, len(self._train), size=n)
    return [self._train[i] for i in picks]

  def all_examples(self) -> list[Example]:
    """Every record of the file(s) in file order (e.g. a fixed prompt set to evaluate on)."""
    return list(self._all)

  def score(self, prompt: str, completion: str, answer: str) -> float:
    return float(self._reward_fn(completion, answer))

  @property
  def max_prompt_len(self) -> int:
    return max(len(ex.prompt) for ex in self._all)

  @property
  def max_answer_len(self) -> int:
    return max(len(ex.answer) for ex in self._all)

  @property
  def alphabet(self) -> str:
    return "".join(sorted({ch for ex in self._all for ch in ex.prompt + ex.answer}))
