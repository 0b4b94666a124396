"""Tokenizers that turn task text into model ids and back.

Owns `CharTokenizer` (one id per character; the default for the procedural tasks), `HFTokenizer`
(a local Hugging Face / `tokenizers` directory next to an imported checkpoint, with its chat
template) and `load_tokenizer`, which picks one from a spec string. Both share one interface:
`encode`, `decode`, `encode_batch`, `vocab_size`, `pad_id`, `bos_id`, `eos_id`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence

import numpy as np

# The order is part of a checkpoint's meaning (id = 3 + position), so append, never reorder.
# "/" is here because countdown answers divide.
DEFAULT_ALPHABET = "0123456789" + "+-*/=,:() " + "abcdefghijklmnopqrstuvwxyz" + "[]"

# What `decode` emits for an id the tokenizer does not know (e.g. from a model whose vocabulary
# is padded past the tokenizer's): no task answer contains it, so the reward is 0, not a crash.
UNKNOWN_CHAR = "\ufffd"


def _as_int_list(ids) -> list[int]:
  """Accepts lists, numpy arrays and jax arrays of ids (1-D)."""
  return [int(i) for i in np.asarray(ids).reshape(-1)]


class _BatchEncodeMixin:
  """Fixed-shape batch encoding shared by both tokenizers (fixed shapes avoid recompiles)."""

  def encode_batch(self, texts: Sequence[str], length: int, *, add_bos: bool = False,
                   add_eos: bool = False, pad_side: str = "left") -> np.ndarray:
    """Encodes `texts` into an int32 array of shape (len(texts), length), padded with `pad_id`.

    Left padding (the default) keeps every prompt's last token in the last column, which is
    what a batched decoder continues from. A text longer than `length` raises ValueError
    instead of being truncated silently.
    """
    if pad_side not in ("left", "right"):
      raise ValueError(f"pad_side must be 'left' or 'right', got {pad_side!r}")
    out = np.full((len(texts), length), self.pad_id, dtype=np.int32)
    for row, text in enumerate(texts):
      ids = self.encode(text, add_bos=add_bos, add_eos=add_eos)
      if len(ids) > length:
        raise ValueError(f"text {row} encodes to {len(ids)} tokens, more than length={length}: "
                         f"{text!r}; raise the length (e.g. from the task's max_prompt_len)")
      if pad_side == "left":
        out[row, length - len(ids):] = ids
      else:
        out[row, :len(ids)] = ids
    return out

  def decode_batch(self, rows: Iterable) -> list[str]:
    """Decodes each row with `decode` (each stops at its own first eos)."""
    return [self.decode(row) for row in rows]


class CharTokenizer(_BatchEncodeMixin):
  """One id per character: pad=0, bos=1, eos=2, then the alphabet's characters in order."""

  pad_id = 0
  bos_id = 1
  eos_id = 2
  _NUM_SPECIAL = 3

  def __init__(self, alphabet: str = DEFAULT_ALPHABET):
    if not alphabet:
      raise ValueError("CharTokenizer needs a non-empty alphabet")
    seen = set()
    for ch in alphabet:
      if ch in seen:
        raise ValueError(f"CharTokenizer alphabet repeats the character {ch!r}")
      seen.add(ch)
    self.alphabet = alphabet
    self._char_to_id = {ch: i + self._NUM_SPECIAL for i, ch in enumerate(alphabet)}

  @property
  def vocab_size(self) -> int:
    return self._NUM_SPECIAL + len(self.alphabet)

  def encode(self, text: str, add_bos: bool = False, add_eos: bool = False) -> list[int]:
    ids = [self.bos_id] if add_bos else []
    for pos, ch in enumerate(text):
      tok = self._char_to_id.get(ch)
      if tok is None:
        raise ValueError(f"character {ch!r} at position {pos} of {text!r} is not in the "
                         f"tokenizer's alphabet {self.alphabet!r}; build the CharTokenizer with "
                         "an alphabet that contains it (e.g. the task's `alphabet`)")
      ids.append(tok)
    if add_eos:
      ids.append(self.eos_id)
    return ids

  def decode(self, ids) -> str:
    """Text up to the first eos; pad and bos are skipped; unknown ids become UNKNOWN_CHAR."""
    chars = []
    for tok in _as_int_list(ids):
      if tok == self.eos_id:
        break
      if tok in (self.pad_id, self.bos_id):
        continue
      idx = tok - self._NUM_SPECIAL
      chars.append(self.alphabet[idx] if 0 <= idx < len(self.alphabet) else UNKNOWN_CHAR)
    return "".join(chars)

  def __repr__(self) -> str:
    return f"CharTokenizer(vocab_size={self.vocab_size}, alphabet={self.alphabet!r})"


class HFTokenizer(_BatchEncodeMixin):
  """A local Hugging Face tokenizer directory behind the CharTokenizer interface.

  `chat=True` wraps each prompt as one user turn of the tokenizer's chat template (with the
  generation prompt) when the tokenizer has one; without a template, prompts are encoded as is.
  Decoding stops at the first stop id: `eos_id`, plus any `eos_token_id` listed in the
  directory's `generation_config.json` (chat models end turns with a token other than eos).
  """

  def __init__(self, path: str | os.PathLike, chat: bool = False):
    path = os.fspath(path)
    if not os.path.isdir(path):
      raise FileNotFoundError(f"tokenizer directory not found: {path!r}")
    from transformers import AutoTokenizer  # lazy: transformers is heavy and optional
    self.path = path
    self._tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    if self._tok.eos_token_id is None:
      raise ValueError(f"tokenizer in {path!r} has no eos token; generation needs one to stop "
                       "(set eos_token in its tokenizer_config.json)")
    self.eos_id = int(self._tok.eos_token_id)
    self.bos_id = None if self._tok.bos_token_id is None else int(self._tok.bos_token_id)
    # Padding is masked out downstream, so eos is a safe stand-in when there is no pad token.
    self.pad_id = self.eos_id if self._tok.pad_token_id is None else int(self._tok.pad_token_id)
    self.has_chat_template = bool(getattr(self._tok, "chat_template", None))
    self.chat = bool(chat) and self.has_chat_template
    self.stop_ids = frozenset([self.eos_id, *self._generation_config_eos_ids(path)])

  @staticmethod
  def _generation_config_eos_ids(path: str) -> list[int]:
    config_path = os.path.join(path, "generation_config.json")
    if not os.path.isfile(config_path):
      return []
    with open(config_path, encoding="utf-8") as f:
      eos = json.load(f).get("eos_token_id")
    if eos is None:
      return []
    return [int(e) for e in (eos if isinstance(eos, list) else [eos])]

  @property
  def vocab_size(self) -> int:
    return len(self._tok)  # includes added tokens, unlike tokenizer.vocab_size

  def render(self, text: str) -> str:
    """The text actually encoded: `text` inside the chat template when chat is on."""
    if not self.chat:
      return text
    return self._tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                         add_generation_prompt=True)

  def chat_text(self, messages) -> str:
    """A whole conversation (`[{"role": ..., "content": ...}]`) in the chat template, ending
    with the generation prompt (for serving chat requests)."""
    if not self.has_chat_template:
      raise ValueError(f"tokenizer in {self.path!r} has no chat template")
    return self._tok.apply_chat_template(list(messages), tokenize=False,
                                         add_generation_prompt=True)

  def encode(self, text: str, add_bos: bool = False, add_eos: bool = False) -> list[int]:
    """`add_bos` is a no-op for tokenizers without a bos token (e.g. Qwen)."""
    ids = list(self._tok.encode(self.render(text), add_special_tokens=False))
    if add_bos and self.bos_id is not None and (not ids or ids[0] != self.bos_id):
      ids.insert(0, self.bos_id)
    if add_eos:
      ids.append(self.eos_id)
    return ids

  def decode(self, ids) -> str:
    """Text up to the first stop id, without special tokens; unknown ids become UNKNOWN_CHAR."""
    kept, unknown_at = [], []
    size = self.vocab_size
    for tok in _as_int_list(ids):
      if tok in self.stop_ids:
        break
      if tok in (self.pad_id, self.bos_id):
        continue
      if not 0 <= tok < size:
        unknown_at.append(len(kept))
        kept.append(None)
        continue
      kept.append(tok)
    if not unknown_at:
      return self._tok.decode(kept, skip_special_tokens=True)
    # Decode the known runs separately so an out-of-range id shows up where it was sampled.
    pieces, run = [], []
    for tok in kept:
      if tok is None:
        pieces.append(self._tok.decode(run, skip_special_tokens=True))
        pieces.append(UNKNOWN_CHAR)
        run = []
      else:
        run.append(tok)
    pieces.append(self._tok.decode(run, skip_special_tokens=True))
    return "".join(pieces)

  def __repr__(self) -> str:
    return f"HFTokenizer({self.path!r}, chat={self.chat}, vocab_size={self.vocab_size})"


Tokenizer = CharTokenizer | HFTokenizer


def load_tokenizer(spec: str | os.PathLike = "char", *, alphabet: str | None = None,
                   chat: bool = False) -> Tokenizer:
  """`"char"` gives a CharTokenizer (over `alphabet`, default DEFAULT_ALPHABET); a directory
  path gives an HFTokenizer over that directory."""
  spec_str = os.fspath(spec)
  if spec_str == "char":
    return CharTokenizer(alphabet if alphabet is not None else DEFAULT_ALPHABET)
  if alphabet is not None:
    raise ValueError("alphabet= only applies to the 'char' tokenizer")
  if os.path.isdir(spec_str):
    return HFTokenizer(spec_str, chat=chat)
  raise ValueError(f"tokenizer spec {spec_str!r} is neither 'char' nor an existing directory "
                   "holding a Hugging Face tokenizer (tokenizer.json + tokenizer_config.json)")
