"""The environment settings: values parsed, bad ones refused with the variable named; the
registry of every setting, docs/settings.md written from it, misspelt names flagged."""

import pytest

from trace_jax import settings
from trace_jax.settings import choice_setting, int_setting


def test_int_setting(monkeypatch):
  monkeypatch.delenv("TRACE_JAX_TEST_INT", raising=False)
  assert int_setting("TRACE_JAX_TEST_INT", 7, minimum=1) == 7
  monkeypatch.setenv("TRACE_JAX_TEST_INT", "16")
  assert int_setting("TRACE_JAX_TEST_INT", 7, minimum=1) == 16
  for bad, why in (("0", ">= 1"), ("sixteen", "an integer"), ("1.5", "an integer")):
    monkeypatch.setenv("TRACE_JAX_TEST_INT", bad)
    with pytest.raises(ValueError, match=f"TRACE_JAX_TEST_INT must be {why}"):
      int_setting("TRACE_JAX_TEST_INT", 7, minimum=1)


def test_choice_setting(monkeypatch):
  monkeypatch.delenv("TRACE_JAX_TEST_CHOICE", raising=False)
  assert choice_setting("TRACE_JAX_TEST_CHOICE", "a", ("a", "b")) == "a"
  monkeypatch.setenv("TRACE_JAX_TEST_CHOICE", "b")
  assert choice_setting("TRACE_JAX_TEST_CHOICE", "a", ("a", "b")) == "b"
  monkeypatch.setenv("TRACE_JAX_TEST_CHOICE", "c")
  with pytest.raises(ValueError, match="TRACE_JAX_TEST_CHOICE must be a or b, got 'c'"):
    choice_setting("TRACE_JAX_TEST_CHOICE", "a", ("a", "b"))


def _package_names_in_sources() -> set[str]:
  """Every TRACE_JAX_* name the package's and launchers' sources spell out (code or comment)."""
  import pathlib
  import re
  root = pathlib.Path(__file__).resolve().parents[1]
  names = set()
  for path in [*(root / "trace_jax").rglob("*.py"), *(root / "launch").glob("*.py")]:
    names.update(re.findall(r"TRACE_JAX_[A-Z0-9_]*[A-Z0-9]", path.read_text()))
  return names


def test_registry_holds_every_setting_the_sources_name():
  """Each TRACE_JAX_* name in trace_jax/ and launch/ is a registered setting (a setting read
  past the registry, or a comment naming a removed one, fails here), and each registered one
  has a line of documentation."""
  settings.import_package()
  registered = {s.name for s in settings.package_settings()}
  assert _package_names_in_sources() - registered == set()
  assert len(registered) >= 60
  assert [s.name for s in settings.package_settings() if not s.doc.strip()] == []


def test_docs_settings_md_is_the_registry():
  """docs/settings.md is what `python -m trace_jax.settings` writes now."""
  import pathlib
  settings.import_package()
  docs = pathlib.Path(__file__).resolve().parents[1] / "docs" / "settings.md"
  assert docs.read_text() == settings.markdown_table(), (
      "docs/settings.md is stale: python -m trace_jax.settings > docs/settings.md")
  for s in settings.package_settings():
    assert f"| `{s.name}` |" in docs.read_text()


def test_unknown_names_flag_misspellings_with_the_nearest_setting(capsys):
  environ = {"TRACE_JAX_ATN_STAGES": "3", "TRACE_JAX_ATTN_STAGES": "3",
             "TRACE_JAX_NOTHING_LIKE_IT": "1", "HOME": "/root", "XLA_FLAGS": "--x"}
  assert settings.unknown_names(environ) == [
      "TRACE_JAX_ATN_STAGES (TRACE_JAX_ATTN_STAGES?)", "TRACE_JAX_NOTHING_LIKE_IT"]
  assert settings.warn_unknown(environ) == settings.unknown_names(environ)
  err = capsys.readouterr().err
  assert "TRACE_JAX_ATN_STAGES (TRACE_JAX_ATTN_STAGES?) is not a trace_jax setting" in err
  assert "TRACE_JAX_ATTN_STAGES is" not in err
  assert settings.unknown_names({"TRACE_JAX_SAMPLER": "gumbel"}) == []


def test_one_definition_of_each_setting(monkeypatch):
  """A second reader of a name with another default is refused, naming both; the same reader
  again (a module reloaded) is not."""
  monkeypatch.delenv("TRACE_JAX_TEST_TWICE", raising=False)
  monkeypatch.setattr(settings, "REGISTRY", {})
  assert choice_setting("TRACE_JAX_TEST_TWICE", "a", ("a", "b"), doc="x") == "a"
  assert choice_setting("TRACE_JAX_TEST_TWICE", "a", ("a", "b"), doc="x") == "a"
  with pytest.raises(ValueError, match="TRACE_JAX_TEST_TWICE is read by tests.test_settings "
                     r"\(default 'a', a, b\) and again by tests.test_settings \(default 'b'"):
    choice_setting("TRACE_JAX_TEST_TWICE", "b", ("a", "b"))
  assert settings.REGISTRY["TRACE_JAX_TEST_TWICE"].module == "tests.test_settings"


def test_import_package_leaves_out_modules_whose_dependency_is_missing():
  """On the GPU machine the package goes in without its dependencies (no starlette there):
  `unknown_names`, which every result header calls, must still work. A fresh process with
  starlette made unimportable: the server modules are listed as left out, the rest register."""
  import subprocess
  import sys
  code = ("import sys; sys.modules['starlette'] = None\n"
          "from trace_jax import settings\n"
          "missing = settings.import_package()\n"
          "print(sorted(missing))\n"
          "print('TRACE_JAX_ATTN_STAGES' in settings.REGISTRY, settings.unknown_names({}))\n")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       check=True).stdout.splitlines()
  assert "trace_jax.serving.server" in out[0]
  assert out[1] == "True []"
