"""trace_jax.provenance: the source-tree fingerprint against git's own tree id; the settings a
run records."""

import os
import shutil
import subprocess

import pytest

from trace_jax import provenance


def _git(cwd, *args):
  return subprocess.check_output(["git", *args], cwd=cwd, text=True).strip()


def test_source_tree_is_gits_tree_id(tmp_path):
  """A directory with nested and executable files and names that sort differently as files
  and as directories (git orders a directory `foo` as `foo/`): `source_tree` equals the tree
  id git records for it, and caches added afterwards do not change it."""
  if shutil.which("git") is None:
    pytest.skip("git not installed")
  root = tmp_path / "src"
  (root / "foo").mkdir(parents=True)
  (root / "foo" / "inner.py").write_text("x = 1\n")
  (root / "foo.py").write_text("import foo\n")
  (root / "foo-bar").write_bytes(b"\x00\xff binary")
  (root / "run.sh").write_text("#!/bin/sh\n")
  os.chmod(root / "run.sh", 0o755)
  (root / "empty").mkdir()  # git keeps no empty directories
  _git(root, "init", "-q")
  _git(root, "add", "-A")
  _git(root, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "x")
  want = _git(root, "rev-parse", "HEAD^{tree}")
  assert provenance.source_tree(str(root / "foo")) == _git(root, "rev-parse", "HEAD:foo")
  shutil.rmtree(root / ".git")
  assert provenance.source_tree(str(root)) == want
  (root / "foo" / "__pycache__").mkdir()
  (root / "foo" / "__pycache__" / "inner.cpython-311.pyc").write_bytes(b"cache")
  assert provenance.source_tree(str(root)) == want
  (root / "foo.py").write_text("import foo  # changed\n")
  assert provenance.source_tree(str(root)) != want


def test_settings_are_the_trace_jax_and_xla_flags_variables(monkeypatch):
  for name in list(os.environ):
    if name.startswith("TRACE_JAX_") or name == "XLA_FLAGS":
      monkeypatch.delenv(name)
  monkeypatch.setenv("TRACE_JAX_GROUPED_REF", "ragged_dot")
  monkeypatch.setenv("XLA_FLAGS", "--xla_dump_to=/tmp/x")
  monkeypatch.setenv("NOT_TRACE_JAX_X", "1")
  assert provenance.settings() == {"TRACE_JAX_GROUPED_REF": "ragged_dot",
                                   "XLA_FLAGS": "--xla_dump_to=/tmp/x"}


def test_run_info_says_which_path_ran_and_which_settings_nothing_reads(monkeypatch):
  """`run_info` records whether the kernels ran (none on a CPU) and the TRACE_JAX_* names that
  no setting reads, beside the ones set."""
  import jax
  monkeypatch.setenv("TRACE_JAX_ATTN_STAGE", "3")  # misspelt: TRACE_JAX_ATTN_STAGES
  info = provenance.run_info()
  assert info["settings"]["TRACE_JAX_ATTN_STAGE"] == "3"
  assert "TRACE_JAX_ATTN_STAGE (TRACE_JAX_ATTN_STAGES?)" in info["unknown_settings"]
  if jax.default_backend() == "cpu":
    assert info["kernels_on"] is False and info["compute_capability"] is None
