"""The task contract shared by every task: train/eval disjointness, a fixed eval set, seeded
train draws, rewards that survive garbage, the registry, and TaskStream's resumable position."""

import json

import numpy as np
import pytest

from trace_jax.tasks import (Example, GeneratedTask, Task, TaskStream, get_task, list_tasks,
                             register_task)
from trace_jax.tasks import base

BUILT_IN = ["addition", "multiplication", "countdown", "sorting"]


@pytest.mark.parametrize("name", BUILT_IN)
def test_train_never_returns_eval_problems(name):
  task = get_task(name)
  eval_keys = {task.problem_key(ex) for ex in task.examples("eval", None)}
  assert len(eval_keys) == task.eval_size  # eval problems are distinct
  for seed in range(3):
    train = task.examples("train", 1000, seed=seed)
    assert not eval_keys & {task.problem_key(ex) for ex in train}


def test_finite_space_exclusion_is_explicit():
  # 1-digit multiplication has 100 problems: 20 held out, training covers exactly the other 80.
  task = get_task("multiplication", n_digits=1)
  eval_prompts = {ex.prompt for ex in task.examples("eval", None)}
  train_prompts = {ex.prompt for ex in task.examples("train", 3000, seed=0)}
  all_prompts = {f"{a}*{b}=" for a in range(10) for b in range(10)}
  assert len(eval_prompts) == 20
  assert train_prompts == all_prompts - eval_prompts


@pytest.mark.parametrize("name", BUILT_IN)
def test_eval_set_is_fixed_and_train_is_seeded(name):
  first, second = get_task(name), get_task(name)
  assert first.examples("eval", 50, seed=0) == second.examples("eval", 50, seed=99)
  assert first.examples("train", 20, seed=5) == second.examples("train", 20, seed=5)
  assert first.examples("train", 20, seed=5) != first.examples("train", 20, seed=6)
  assert get_task(name, eval_seed=7).examples("eval", 50) != first.examples("eval", 50)


@pytest.mark.parametrize("name", BUILT_IN)
def test_rewards_never_raise_on_garbage(name):
  task = get_task(name)
  rng = np.random.default_rng(0)
  examples = task.examples("train", 200, seed=0)
  chars = list("0123456789+-*/=,:() abcxyz[]._'\"\\\n\t") + ["🙂", "\x00", "é"]
  garbage = ["".join(rng.choice(chars, size=int(rng.integers(0, 40)))) for _ in examples]
  garbage[:6] = ["", "(" * 500, "9" * 5000, "__import__('os')", "1/0", "2**1000"]
  rewards = task.reward([e.prompt for e in examples], garbage, [e.answer for e in examples])
  assert set(rewards) <= {0.0, 1.0}
  assert task.reward([examples[0].prompt], [None], [examples[0].answer]) == [0.0]


def test_reward_length_mismatch_is_an_error():
  with pytest.raises(ValueError, match="same length"):
    get_task("addition").reward(["01+02="], ["3", "3"], ["3"])


def test_bad_split_and_counts():
  task = get_task("addition")
  with pytest.raises(ValueError, match="unknown split"):
    task.examples("test", 5)
  with pytest.raises(ValueError, match="eval_size >= 2000"):
    task.examples("eval", 2000)
  with pytest.raises(ValueError, match="pass n"):
    task.examples("train", None)


def test_example_is_frozen():
  ex = Example("1+1=", "2")
  with pytest.raises(AttributeError):
    ex.answer = "3"


# --- registry -------------------------------------------------------------------------------

@pytest.fixture
def scratch_registry(monkeypatch):
  monkeypatch.setattr(base, "_REGISTRY", dict(base._REGISTRY))


def test_unknown_task_lists_known_names():
  with pytest.raises(ValueError, match="unknown task 'nope'.*addition, countdown, jsonl"):
    get_task("nope")
  assert set(BUILT_IN + ["jsonl"]) <= set(list_tasks())


def test_user_task_registers_and_builds(scratch_registry):
  @register_task("parity")
  class ParityTask(GeneratedTask):
    name = "parity"
    num_problems = 1000

    def sample(self, rng):
      n = int(rng.integers(0, 1000))
      return Example(f"{n:03d}=", "even" if n % 2 == 0 else "odd")

    def score(self, prompt, completion, answer):
      return float(completion == answer)

  task = get_task("parity", eval_size=10)
  assert isinstance(task, ParityTask) and "parity" in list_tasks()
  assert len(task.examples("eval", None)) == 10
  assert task.reward(["004="], ["even"], ["even"]) == [1.0]
  with pytest.raises(ValueError, match="already registered"):
    register_task("parity")(lambda: task)
  register_task("parity", overwrite=True)(lambda: task)
  assert get_task("parity") is task


def test_factory_must_return_a_task(scratch_registry):
  register_task("not_a_task")(lambda: object())
  with pytest.raises(TypeError, match="not a Task"):
    get_task("not_a_task")


def test_base_task_is_abstract():
  with pytest.raises(NotImplementedError):
    Task().examples("train", 1)


# --- TaskStream -----------------------------------------------------------------------------

def test_stream_is_deterministic_and_seed_dependent():
  task = get_task("addition")
  first = [next(TaskStream(task, seed=3, batch_size=8)) for _ in range(2)]
  a, b = TaskStream(task, 3, 8), TaskStream(task, 3, 8)
  assert [next(a) for _ in range(5)] == [next(b) for _ in range(5)]
  assert first[0] == first[1]
  assert next(TaskStream(task, 4, 8)) != first[0]
  batches = [next(a) for _ in range(5)]
  assert all(len(batch) == 8 for batch in batches)
  assert len({tuple(batch) for batch in batches}) == 5  # steps differ from each other


def test_stream_resumes_with_exactly_the_same_batches():
  task = get_task("countdown")
  uninterrupted = TaskStream(task, seed=11, batch_size=4)
  want = [uninterrupted.next_batch() for _ in range(8)]

  killed = TaskStream(task, seed=11, batch_size=4)
  for _ in range(5):
    killed.next_batch()
  saved = json.loads(json.dumps(killed.state()))  # the state survives serialization
  assert saved["step"] == 5

  resumed = TaskStream(get_task("countdown"), seed=11, batch_size=4)  # a fresh process
  resumed.restore(saved)
  assert [resumed.next_batch() for _ in range(3)] == want[5:]
  # Checkpoint libraries may hand scalars back as numpy values.
  again = TaskStream(task, seed=11, batch_size=4)
  again.restore({k: (np.asarray(v) if k != "task" else v) for k, v in saved.items()})
  assert again.next_batch() == want[5]


def test_stream_refuses_a_state_from_another_run():
  task = get_task("addition")
  state = TaskStream(task, seed=1, batch_size=4).state()
  with pytest.raises(ValueError, match="seed"):
    TaskStream(task, seed=2, batch_size=4).restore(state)
  with pytest.raises(ValueError, match="batch_size"):
    TaskStream(task, seed=1, batch_size=8).restore(state)
  with pytest.raises(ValueError, match="task"):
    TaskStream(get_task("sorting"), seed=1, batch_size=4).restore(state)
  with pytest.raises(ValueError, match="batch_size must be positive"):
    TaskStream(task, seed=1, batch_size=0)
