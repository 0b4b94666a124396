"""CharTokenizer and load_tokenizer: ids, round trips, eos/pad handling, fixed-shape batches,
and the errors for unknown characters and bad specs."""

import numpy as np
import pytest

from trace_jax.tasks import DEFAULT_ALPHABET, CharTokenizer, get_task, load_tokenizer
from trace_jax.tasks.tokenizer import UNKNOWN_CHAR


def test_special_ids_and_vocab():
  tok = CharTokenizer("ab")
  assert (tok.pad_id, tok.bos_id, tok.eos_id) == (0, 1, 2)
  assert tok.vocab_size == 5
  assert tok.encode("ba") == [4, 3]
  assert tok.encode("ab", add_bos=True) == [1, 3, 4]
  assert tok.encode("ab", add_eos=True) == [3, 4, 2]


def test_default_alphabet_covers_the_documented_characters():
  for ch in "0123456789+-*=,:() abcdefghijklmnopqrstuvwxyz[]/":
    assert ch in DEFAULT_ALPHABET
  assert len(set(DEFAULT_ALPHABET)) == len(DEFAULT_ALPHABET)
  assert CharTokenizer().vocab_size == 3 + len(DEFAULT_ALPHABET)


def test_round_trip_random_text():
  tok = CharTokenizer()
  rng = np.random.default_rng(0)
  for _ in range(50):
    text = "".join(rng.choice(list(DEFAULT_ALPHABET), size=int(rng.integers(0, 20))))
    assert tok.decode(tok.encode(text, add_bos=True, add_eos=True)) == text


@pytest.mark.parametrize("name", ["addition", "multiplication", "countdown", "sorting"])
def test_every_task_round_trips_with_the_default_tokenizer(name):
  task = get_task(name)
  tok = CharTokenizer()
  assert set(task.alphabet) <= set(DEFAULT_ALPHABET)
  for ex in task.examples("train", 100, seed=3) + task.examples("eval", 100):
    assert tok.decode(tok.encode(ex.prompt)) == ex.prompt
    assert tok.decode(tok.encode(ex.answer, add_eos=True) + tok.encode("99")) == ex.answer


def test_decode_stops_at_eos_and_skips_pad_and_bos():
  tok = CharTokenizer()
  ids = [tok.pad_id, tok.bos_id] + tok.encode("55") + [tok.pad_id] + tok.encode("1")
  ids += [tok.eos_id] + tok.encode("999")
  assert tok.decode(ids) == "551"
  assert tok.decode(np.asarray(ids, dtype=np.int32)) == "551"  # arrays decode like lists
  assert tok.decode([tok.eos_id] + tok.encode("1")) == ""


def test_decode_unknown_ids_become_a_marker_not_an_error():
  tok = CharTokenizer("01")
  assert tok.decode([3, 99, -1, 4]) == "0" + UNKNOWN_CHAR + UNKNOWN_CHAR + "1"


def test_unknown_character_error_names_it():
  with pytest.raises(ValueError, match="'%'"):
    CharTokenizer().encode("12%3")
  with pytest.raises(ValueError, match="'A'"):
    CharTokenizer().encode("A")


def test_bad_alphabets():
  with pytest.raises(ValueError, match="repeats"):
    CharTokenizer("aba")
  with pytest.raises(ValueError, match="non-empty"):
    CharTokenizer("")


def test_encode_batch_pads_to_a_fixed_shape():
  tok = CharTokenizer()
  left = tok.encode_batch(["1+2=", "12+3="], 6, add_bos=True)
  assert left.shape == (2, 6) and left.dtype == np.int32
  assert left[0].tolist() == [0] + [1] + tok.encode("1+2=")
  assert left[1].tolist() == [1] + tok.encode("12+3=")
  right = tok.encode_batch(["55"], 4, add_eos=True, pad_side="right")
  assert right[0].tolist() == tok.encode("55") + [2, 0]
  assert tok.decode_batch(right) == ["55"]
  with pytest.raises(ValueError, match="more than length"):
    tok.encode_batch(["123456"], 5)
  with pytest.raises(ValueError, match="pad_side"):
    tok.encode_batch(["1"], 2, pad_side="middle")


def test_load_tokenizer_char_and_errors(tmp_path):
  assert load_tokenizer("char").vocab_size == CharTokenizer().vocab_size
  assert load_tokenizer("char", alphabet="xy").alphabet == "xy"
  with pytest.raises(ValueError, match="neither 'char' nor an existing directory"):
    load_tokenizer(str(tmp_path / "nope"))
  with pytest.raises(ValueError, match="only applies"):
    load_tokenizer(str(tmp_path), alphabet="xy")
