"""The environment settings: values parsed, bad ones refused with the variable named."""

import pytest

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
