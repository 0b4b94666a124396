"""HFTokenizer over a tiny byte-level BPE tokenizer built and saved locally (nothing downloaded):
round trips, bos/eos/pad, the chat template, extra stop ids from generation_config.json."""

import json

import pytest

pytest.importorskip("tokenizers")
pytest.importorskip("transformers")

from trace_jax.tasks import HFTokenizer, load_tokenizer  # noqa: E402
from trace_jax.tasks.tokenizer import UNKNOWN_CHAR  # noqa: E402

CHAT_TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant:{% endif %}")


def _save_tiny_tokenizer(path, chat_template=None, generation_eos=None):
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
  from transformers import PreTrainedTokenizerFast
  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<pad>", "<s>", "</s>", "<end>"],
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
  tok.train_from_iterator(["12+34=46", "what is 2 plus 2? it is 4", "sort:cab=abc"] * 3, trainer)
  fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                 pad_token="<pad>")
  if chat_template:
    fast.chat_template = chat_template
  fast.save_pretrained(str(path))
  if generation_eos is not None:
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": generation_eos}))
  return path


@pytest.fixture(scope="module")
def plain_dir(tmp_path_factory):
  return _save_tiny_tokenizer(tmp_path_factory.mktemp("plain_tok"))


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory):
  path = tmp_path_factory.mktemp("chat_tok")
  return _save_tiny_tokenizer(path, CHAT_TEMPLATE, generation_eos=[2, 3])


def test_round_trip_and_special_ids(plain_dir):
  tok = load_tokenizer(str(plain_dir))
  assert isinstance(tok, HFTokenizer)
  assert (tok.pad_id, tok.bos_id, tok.eos_id) == (0, 1, 2)
  assert tok.vocab_size == len(tok._tok)
  for text in ["12+34=46", "sort:zyx=", "héllo wörld", ""]:
    assert tok.decode(tok.encode(text)) == text
  ids = tok.encode("46", add_bos=True, add_eos=True)
  assert ids[0] == tok.bos_id and ids[-1] == tok.eos_id
  assert tok.decode(ids + tok.encode("99")) == "46"  # stops at eos, skips bos
  assert tok.decode([tok.pad_id, tok.pad_id] + tok.encode("4")) == "4"


def test_unknown_ids_decode_to_a_marker(plain_dir):
  tok = HFTokenizer(plain_dir)
  assert tok.decode(tok.encode("4") + [10**6] + tok.encode("5")) == "4" + UNKNOWN_CHAR + "5"


def test_chat_template_wraps_prompts_only_when_asked(chat_dir):
  chat = HFTokenizer(chat_dir, chat=True)
  assert chat.chat and chat.has_chat_template
  assert chat.render("12+34=") == "<s>user: 12+34=\nassistant:"
  assert chat.encode("12+34=") == chat._tok.encode("<s>user: 12+34=\nassistant:",
                                                   add_special_tokens=False)
  # The template already starts with bos: add_bos must not add a second one.
  assert chat.encode("1", add_bos=True).count(chat.bos_id) == 1
  plain = HFTokenizer(chat_dir, chat=False)
  assert plain.render("12+34=") == "12+34="
  # A whole conversation (what the server's chat endpoint renders), generation prompt last.
  msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2="}]
  assert plain.chat_text(msgs) == "<s>system: be brief\n<s>user: 2+2=\nassistant:"


def test_chat_without_a_template_encodes_the_prompt_as_is(plain_dir):
  tok = HFTokenizer(plain_dir, chat=True)
  assert not tok.chat
  with pytest.raises(ValueError, match="no chat template"):
    tok.chat_text([{"role": "user", "content": "1"}])
  assert tok.decode(tok.encode("12+34=")) == "12+34="


def test_generation_config_eos_ids_also_stop_decoding(chat_dir):
  tok = HFTokenizer(chat_dir)
  assert tok.stop_ids == {2, 3}
  assert tok.decode(tok.encode("46") + [3] + tok.encode("7")) == "46"


def test_batch_encoding_left_pads(plain_dir):
  tok = HFTokenizer(plain_dir)
  batch = tok.encode_batch(["12+34=", "2"], 8)
  assert batch.shape == (2, 8)
  assert batch[1, :-len(tok.encode("2"))].tolist() == [tok.pad_id] * (8 - len(tok.encode("2")))


def test_missing_directory(tmp_path):
  with pytest.raises(FileNotFoundError, match="tokenizer directory not found"):
    HFTokenizer(tmp_path / "missing")
