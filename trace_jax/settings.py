"""Environment settings (A/B switches and bounds), read at import: one parser each for a choice
and an integer, with errors that name the variable, and the registry of every setting the
package reads (`REGISTRY`), from which `docs/settings.md` is written
(`python -m trace_jax.settings > docs/settings.md`; a test keeps the two equal) and against
which the environment's TRACE_JAX_* names are checked, so that a misspelt A/B side does not run
the default unnoticed (`unknown_names`). Imports nothing of the package at import, so any module
may use it (the numerics core included)."""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import os
import pkgutil
import sys

PREFIX = "TRACE_JAX_"


@dataclasses.dataclass(frozen=True)
class Setting:
  name: str
  default: str
  values: str  # the accepted values: "on, off", "integer >= 1", "a directory"
  module: str  # the module that reads it
  doc: str  # one line: what it switches
  # whether its value changes the compiled programs (every process of a job must agree on it;
  # `parallel.distributed.check_settings_agree`); not so for paths, keys, provenance
  shapes_programs: bool = True


REGISTRY: dict[str, Setting] = {}


def _caller_module() -> str:
  """The module that called the setting function that calls this."""
  return sys._getframe(2).f_globals.get("__name__", "?")


def _register(setting: Setting) -> None:
  known = REGISTRY.get(setting.name)
  if known is not None and (known.module, known.default, known.values) != (
      setting.module, setting.default, setting.values):
    raise ValueError(f"{setting.name} is read by {known.module} (default {known.default!r}, "
                     f"{known.values}) and again by {setting.module} (default "
                     f"{setting.default!r}, {setting.values}): one definition of each setting")
  REGISTRY[setting.name] = setting


def choice_setting(name: str, default: str, choices: tuple[str, ...], doc: str = "") -> str:
  """The value of environment variable `name` (`default` if unset), one of `choices`."""
  _register(Setting(name, default, ", ".join(choices), _caller_module(), doc))
  value = os.environ.get(name, default)
  if value not in choices:
    raise ValueError(f"{name} must be {', '.join(choices[:-1])} or {choices[-1]}, "
                     f"got {value!r}")
  return value


def int_setting(name: str, default: int, minimum: int, doc: str = "") -> int:
  """The integer value of environment variable `name` (`default` if unset), >= `minimum`."""
  _register(Setting(name, str(default), f"integer >= {minimum}", _caller_module(), doc))
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


def declare(name: str, default: str, values: str, doc: str,
            shapes_programs: bool = True) -> str:
  """Registers a setting that its module reads itself (when called, or free-form text);
  returns `name`."""
  _register(Setting(name, default, values, _caller_module(), doc, shapes_programs))
  return name


def program_settings(environ=None) -> dict[str, str]:
  """The value (set, else the default) of every registered setting of the package that shapes
  the compiled programs: what the processes of one job must agree on. Imports the package."""
  import_package()
  environ = os.environ if environ is None else environ
  return {s.name: environ.get(s.name, s.default) for s in package_settings()
          if s.shapes_programs}


def import_package() -> dict[str, str]:
  """Imports every module of trace_jax, so that `REGISTRY` holds every setting. A module whose
  optional dependency is missing here (the GPU machine installs the package without its
  dependencies: no HTTP server there) is left out; returns those, each with its error."""
  import trace_jax  # noqa: PLC0415 - deferred: this module is imported by the package itself
  missing = {}
  for info in pkgutil.walk_packages(trace_jax.__path__, "trace_jax.",
                                    onerror=lambda name: None):
    try:
      importlib.import_module(info.name)
    except ImportError as e:
      missing[info.name] = str(e)
  return missing


def package_settings() -> list[Setting]:
  """The registered settings of trace_jax's modules, by name (those of other callers, tests,
  left out)."""
  return sorted((s for s in REGISTRY.values() if s.module.startswith("trace_jax.")),
                key=lambda s: s.name)


def unknown_names(environ=None) -> list[str]:
  """The environment's TRACE_JAX_* names that no module of trace_jax reads, each with the
  nearest known name where one is close (a misspelt "..._ATN_STAGES" gets
  "(TRACE_JAX_ATTN_STAGES?)").
  Imports the whole package first."""
  import_package()
  known = [s.name for s in package_settings()]
  environ = os.environ if environ is None else environ
  out = []
  for name in sorted(environ):
    if name.startswith(PREFIX) and name not in known:
      close = difflib.get_close_matches(name, known, n=1, cutoff=0.8)
      out.append(f"{name} ({close[0]}?)" if close else name)
  return out


def warn_unknown(environ=None) -> list[str]:
  """`unknown_names`, each also printed to stderr as a warning (launchers and benchmarks call it
  at start)."""
  unknown = unknown_names(environ)
  for entry in unknown:
    print(f"warning: environment variable {entry} is not a trace_jax setting; it changes "
          "nothing (the settings: docs/settings.md)", file=sys.stderr)
  return unknown


def markdown_table() -> str:
  """`docs/settings.md`: every setting of the package, its default, values and module."""
  lines = [
      "# Environment settings",
      "",
      "Every `TRACE_JAX_*` variable trace_jax reads, from the registry in",
      "`trace_jax/settings.py`; written by `python -m trace_jax.settings > docs/settings.md`",
      "(a test keeps this file equal to the registry). Most are read once, when their module",
      "is imported (set them before the process starts); a bad value stops the import with an",
      "error that names the variable. Most are A/B switches whose other side was measured",
      "slower, or opt-ins waiting for a measurement: the comment above each one's definition",
      "gives the figures. Result JSONs record the ones set (`provenance.settings()`), and",
      "launchers warn of `TRACE_JAX_*` names that are none of these.",
      "",
      "Every process of a multi-process job must read the same values of those that shape the",
      "compiled programs, all but " + ", ".join(
          f"`{s.name}`" for s in package_settings() if not s.shapes_programs) + ":",
      "`parallel.initialize` checks that, and stops every process naming the ones that differ.",
      "",
      "| setting | default | values | module | what |",
      "|---|---|---|---|---|",
  ]
  for s in package_settings():
    default = f"`{s.default}`" if s.default else "(unset)"
    module = s.module.removeprefix("trace_jax.")
    lines.append(f"| `{s.name}` | {default} | {s.values} | `{module}` | {s.doc} |")
  return "\n".join(lines) + "\n"


if __name__ == "__main__":
  # the package's modules register in `trace_jax.settings`, not in this `__main__` copy
  from trace_jax import settings as _registry
  _registry.import_package()
  sys.stdout.write(_registry.markdown_table())
