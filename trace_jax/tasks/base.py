"""The task contract, the task registry and the deterministic training-data stream.

Owns `Example`, `Task` (what every task provides: examples per split, a plain-Python reward,
fixed prompt/answer length bounds, its alphabet), `GeneratedTask` (a Task built from a seeded
one-example sampler, with a held-out eval set that training never sees), `register_task` /
`get_task` / `list_tasks`, and `TaskStream` (training batches with a resumable position).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Hashable, Iterator, Sequence

import numpy as np

SPLITS = ("train", "eval")


@dataclasses.dataclass(frozen=True)
class Example:
  """One problem: the prompt the model sees and the reference answer (without any end token)."""
  prompt: str
  answer: str


def check_split(split: str) -> None:
  if split not in SPLITS:
    raise ValueError(f"unknown split {split!r}; expected one of {SPLITS}")


class Task:
  """A verifiable task. Subclasses implement `examples`, `score` (or `reward`), the two length
  bounds and `alphabet`.

  - `examples(split, n, seed)`: "train" examples are drawn with `seed`; "eval" is a fixed
    held-out set (the same for every seed) that "train" never returns.
  - `reward(prompts, completions, answers)`: one float per completion, in plain Python. A
    completion is the model's decoded text up to its end token.
  - `max_prompt_len` / `max_answer_len`: upper bounds in characters over every example, so
    callers can pad to fixed shapes.
  - `alphabet`: every character that prompts, answers and correct completions use.
  """

  name: str = "task"

  def examples(self, split: str, n: int | None, seed: int = 0) -> list[Example]:
    raise NotImplementedError

  def score(self, prompt: str, completion: str, answer: str) -> float:
    """Reward of one completion; built-in tasks never raise on garbage completions."""
    raise NotImplementedError

  def reward(self, prompts: Sequence[str], completions: Sequence[str],
             answers: Sequence[str]) -> list[float]:
    if not len(prompts) == len(completions) == len(answers):
      raise ValueError(f"reward got {len(prompts)} prompts, {len(completions)} completions and "
                       f"{len(answers)} answers; they must be the same length")
    # A non-string completion (e.g. None from a failed decode) is a wrong answer, not a crash.
    return [float(self.score(p, c, a)) if isinstance(c, str) else 0.0
            for p, c, a in zip(prompts, completions, answers)]

  @property
  def max_prompt_len(self) -> int:
    raise NotImplementedError

  @property
  def max_answer_len(self) -> int:
    raise NotImplementedError

  @property
  def alphabet(self) -> str:
    raise NotImplementedError

  def __repr__(self) -> str:
    return f"{type(self).__name__}(name={self.name!r})"


def exact_match(completion: str, answer: str) -> float:
  """1.0 when the completion equals the answer, ignoring surrounding whitespace."""
  return 1.0 if completion.strip() == answer.strip() else 0.0


class GeneratedTask(Task):
  """A Task made from a seeded sampler of single examples.

  Subclasses implement `sample(rng) -> Example`, and may override `problem_key` (which
  examples count as the same problem; default: the prompt) and `num_problems` (the size of a
  finite problem space, or None when it is too large to matter). The eval set is the first
  `eval_size` distinct problems drawn with `eval_seed`; training draws reject every problem in
  it, so train and eval are disjoint by construction.
  """

  DEFAULT_EVAL_SIZE = 1000
  # With a finite space, hold out at most this share by default, so training keeps most problems.
  DEFAULT_MAX_EVAL_FRACTION = 0.2

  def __init__(self, eval_size: int | None = None, eval_seed: int = 1234):
    limit = self.num_problems
    if eval_size is None:
      eval_size = self.DEFAULT_EVAL_SIZE
      if limit is not None:
        eval_size = min(eval_size, max(1, int(limit * self.DEFAULT_MAX_EVAL_FRACTION)))
    if eval_size < 0:
      raise ValueError(f"eval_size must be >= 0, got {eval_size}")
    if limit is not None and eval_size > limit // 2:
      raise ValueError(f"eval_size={eval_size} would hold out more than half of the "
                       f"{limit} problems of task {self.name!r}; use at most {limit // 2}")
    self.eval_size = int(eval_size)
    self.eval_seed = int(eval_seed)
    self._eval: list[Example] | None = None
    self._eval_keys: frozenset | None = None

  def sample(self, rng: np.random.Generator) -> Example:
    raise NotImplementedError

  def problem_key(self, example: Example) -> Hashable:
    return example.prompt

  @property
  def num_problems(self) -> int | None:
    return None

  def _eval_set(self) -> list[Example]:
    if self._eval is None:  # built lazily: tasks used only for rewards never pay for it
      rng = np.random.default_rng(self.eval_seed)
      chosen, keys = [], set()
      draws, max_draws = 0, 100 * self.eval_size + 1000
      while len(chosen) < self.eval_size:
        draws += 1
        if draws > max_draws:  # a problem space smaller than it looked: fail, don't hang
          raise RuntimeError(f"task {self.name!r}: found only {len(chosen)} distinct problems "
                             f"in {max_draws} draws; pass a smaller eval_size")
        ex = self.sample(rng)
        key = self.problem_key(ex)
        if key not in keys:
          keys.add(key)
          chosen.append(ex)
      self._eval, self._eval_keys = chosen, frozenset(keys)
    return self._eval

  def is_eval_problem(self, example: Example) -> bool:
    self._eval_set()
    return self.problem_key(example) in self._eval_keys

  def examples(self, split: str, n: int | None, seed: int = 0) -> list[Example]:
    """Train: `n` draws (with replacement) seeded by `seed`, never from the eval set.
    Eval: the first `n` held-out examples (all of them for n=None); `seed` is ignored so
    every run evaluates on the same problems."""
    check_split(split)
    held_out = self._eval_set()
    if split == "eval":
      if n is None:
        return list(held_out)
      if n > len(held_out):
        raise ValueError(f"asked for {n} eval examples but task {self.name!r} holds out "
                         f"{len(held_out)}; construct it with eval_size >= {n}")
      return held_out[:n]
    if n is None:
      raise ValueError("the train split is unbounded: pass n")
    rng = np.random.default_rng(seed)
    out: list[Example] = []
    # Rejection is cheap because at most half the space is held out; the cap turns a buggy
    # sampler (one that only produces eval problems) into an error instead of a hang.
    max_draws = 100 * n + 1000
    draws = 0
    while len(out) < n:
      draws += 1
      if draws > max_draws:
        raise RuntimeError(f"task {self.name!r}: {draws} draws yielded only {len(out)} "
                           "non-eval examples; its sampler keeps producing held-out problems")
      ex = self.sample(rng)
      if self.problem_key(ex) not in self._eval_keys:
        out.append(ex)
    return out


# ---------------------------------------------------------------------------------------------
# Registry

_REGISTRY: dict[str, Callable[..., Task]] = {}


def register_task(name: str, *, overwrite: bool = False):
  """Decorator registering a Task factory (a Task subclass or a function returning a Task)
  under `name`, so `get_task(name, **kwargs)` and `--config.task.name` can build it."""
  def decorator(factory: Callable[..., Task]) -> Callable[..., Task]:
    if name in _REGISTRY and _REGISTRY[name] is not factory and not overwrite:
      raise ValueError(f"task name {name!r} is already registered; pick another name or pass "
                       "overwrite=True")
    _REGISTRY[name] = factory
    return factory
  return decorator


def list_tasks() -> list[str]:
  return sorted(_REGISTRY)


def get_task(name: str, **kwargs) -> Task:
  """Builds the task registered as `name` with `kwargs`."""
  if name not in _REGISTRY:
    raise ValueError(f"unknown task {name!r}; known tasks: {', '.join(list_tasks())} "
                     "(register your own with trace_jax.tasks.register_task)")
  task = _REGISTRY[name](**kwargs)
  if not isinstance(task, Task):
    raise TypeError(f"factory registered as {name!r} returned {type(task).__name__}, not a Task")
  return task


# ---------------------------------------------------------------------------------------------
# Training stream

class TaskStream:
  """Deterministic training batches: batch k depends only on (seed, k), never on history.

  `state()` is the data position (a small dict of ints and strings, checkpointable as is);
  `restore(state)` jumps there, so a killed run resumes with exactly the batches it would have
  seen.
  """

  def __init__(self, task: Task, seed: int, batch_size: int):
    if batch_size <= 0:
      raise ValueError(f"batch_size must be positive, got {batch_size}")
    self.task = task
    self.seed = int(seed)
    self.batch_size = int(batch_size)
    self.step = 0

  def batch_seed(self, step: int) -> int:
    # SeedSequence mixes (seed, step) so neighbouring seeds/steps give unrelated batches.
    return int(np.random.SeedSequence([self.seed, step]).generate_state(1, np.uint64)[0])

  def batch_at(self, step: int) -> list[Example]:
    return self.task.examples("train", self.batch_size, seed=self.batch_seed(step))

  def next_batch(self) -> list[Example]:
    batch = self.batch_at(self.step)
    self.step += 1
    return batch

  def __iter__(self) -> Iterator[list[Example]]:
    return self

  def __next__(self) -> list[Example]:
    return self.next_batch()

  def state(self) -> dict:
    return {"task": self.task.name, "seed": self.seed, "batch_size": self.batch_size,
            "step": self.step}

  def restore(self, state: dict) -> None:
    """Continues from `state`; refuses a state from a different task, seed or batch size,
    because resuming would then silently change the data."""
    mine = self.state()
    for key in ("task", "seed", "batch_size"):
      theirs = state.get(key)
      # Checkpoints may hand scalars back as numpy values: compare as Python values.
      theirs = theirs.item() if isinstance(theirs, (np.generic, np.ndarray)) else theirs
      if theirs != mine[key]:
        raise ValueError(f"cannot restore TaskStream: saved {key}={theirs!r} but this stream "
                         f"has {key}={mine[key]!r}; use the same task, seed and batch size")
    step = int(state["step"])
    if step < 0:
      raise ValueError(f"cannot restore TaskStream: negative step {step}")
    self.step = step

