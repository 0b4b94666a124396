"""Verifiable tasks with reward functions, held-out eval splits, and tokenizers for them.

Public API: `Example`, `Task`, `GeneratedTask`, `register_task`, `get_task`, `list_tasks`,
`TaskStream`; the built-in tasks "addition", "multiplication", "countdown", "sorting" and
"jsonl" (`AdditionTask`, `MultiplicationTask`, `CountdownTask`, `SortingTask`, `JsonlTask`);
`CharTokenizer`, `HFTokenizer`, `load_tokenizer`, `DEFAULT_ALPHABET`.
"""

# Importing the task modules registers them.
from trace_jax.tasks.arithmetic import AdditionTask, ArithmeticTask, MultiplicationTask
from trace_jax.tasks.base import (Example, GeneratedTask, Task, TaskStream, exact_match, get_task,
                                  list_tasks, register_task)
from trace_jax.tasks.countdown import CountdownTask, countdown_reward, parse_expression
from trace_jax.tasks.jsonl import REWARDS, JsonlTask, contains_match, numeric_match
from trace_jax.tasks.sorting import SortingTask
from trace_jax.tasks.tokenizer import (DEFAULT_ALPHABET, CharTokenizer, HFTokenizer,
                                       load_tokenizer)

__all__ = [
    "AdditionTask", "ArithmeticTask", "CharTokenizer", "CountdownTask", "DEFAULT_ALPHABET",
    "Example", "GeneratedTask", "HFTokenizer", "JsonlTask", "MultiplicationTask", "REWARDS",
    "SortingTask", "Task", "TaskStream", "contains_match", "countdown_reward", "exact_match",
    "get_task", "list_tasks", "load_tokenizer", "numeric_match", "parse_expression",
    "register_task",
]
