"""Environment settings (A/B switches and bounds), read at import: one parser each for a choice
and an integer, with errors that name the variable. Imports nothing of the package, so any
module may use it (the numerics core included)."""

from __future__ import annotations

import os


def choice_setting(name: str, default: str, choices: tuple[str, ...]) -> str:
  """The value of environment variable `name` (`default` if unset), one of `choices`."""
  value = os.environ.get(name, default)
  if value not in choices:
    raise ValueError(f"{name} must be {', '.join(choices[:-1])} or {choices[-1]}, "
                     f"got {value!r}")
  return value


def int_setting(name: str, default: int, minimum: int) -> int:
  """The integer value of environment variable `name` (`default` if unset), >= `minimum`."""
  raw = os.environ.get(name)
  if raw is None:
    return default
  try:
    value = int(raw)
  except ValueError:
    raise ValueError(f"{name} must be an integer, got {raw!r}") from None
  if value < minimum:
    raise ValueError(f"{name} must be >= {minimum}, got {value}")
  return value
