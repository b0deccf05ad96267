"""SentencePiece-style GGUF vocabularies: tiny files written with the `gguf` package pin down the
rules (merge order by score, byte fallback, special tokens, the BOS/EOS and space-prefix flags,
stop tokens), and the real Gemma 3 file is checked against transformers' tokenizer for the same
file on a few thousand varied texts."""

from __future__ import annotations

import os
import random

import gguf
import numpy as np
import pytest

from brisk.model.gguf_file import GGUFFile
from brisk.model.gguf_tokenizer import gguf_tokenizer
from brisk.model.tokenizer import Tokenizer
from tests.helpers import gemma_path

# Laid out as Gemma's file is: special tokens, the 256 bytes, then the pieces in merge order.
SPECIAL = ["<unk>", "<s>", "</s>", "<start_of_turn>", "<end_of_turn>", "\n", "  ", "   "]
WORDS = ["\u2581", "a", "b", "c", "ab", "bc", "\u2581a", "\u2581b"]
TOKENS = [*SPECIAL, *(f"<0x{b:02X}>" for b in range(256)), *WORDS]
TYPES = [2, 3, 3, 3, 3, 4, 4, 4] + [6] * 256 + [1] * len(WORDS)  # unknown, control, user-defined, byte, normal
ID = {token: i for i, token in enumerate(TOKENS)}


def _scores(**overrides: float) -> list[float]:
    """Scores falling with the id (SentencePiece's order), -1000 for the special tokens (llama.cpp's
    converter's), but for the tokens named."""
    scores = [-1000.0] * len(SPECIAL) + [0.0] * 256 + [-1.0 - i for i in range(len(WORDS))]
    for token, score in overrides.items():
        scores[ID[token]] = score
    return scores


def write_vocab(path, scores: list[float], architecture: str = "llama", tokens: list[str] = TOKENS,
                types: list[int] = TYPES, model: str = "llama", **metadata) -> str:
    """A GGUF file holding only a vocabulary (and one tensor, as every GGUF file has one);
    metadata: GGUFWriter's add_* methods by the rest of their name (add_space_prefix=False)."""
    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_tokenizer_model(model)
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    for key, value in {"bos_token_id": ID["<s>"], "eos_token_id": ID["</s>"], "unk_token_id": ID["<unk>"],
                       **metadata}.items():
        getattr(writer, f"add_{key}")(value)
    writer.add_tensor("token_embd.weight", np.zeros((len(tokens), 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


def read(path: str) -> Tokenizer:
    return gguf_tokenizer(GGUFFile(path).fields)


@pytest.fixture
def vocab(tmp_path) -> Tokenizer:
    return read(write_vocab(tmp_path / "v.gguf", _scores(), add_space_prefix=False))


def test_the_highest_scoring_pair_merges_first_whatever_the_ids(tmp_path):
    """"ab" comes before "bc" in the file; which one "abc" keeps is the scores' choice alone."""
    bc_first = read(write_vocab(tmp_path / "bc.gguf", _scores(ab=-20.0, bc=-10.0), add_space_prefix=False))
    ab_first = read(write_vocab(tmp_path / "ab.gguf", _scores(ab=-10.0, bc=-20.0), add_space_prefix=False))
    assert bc_first.encode("abc", add_special_tokens=False) == [ID["a"], ID["bc"]]
    assert ab_first.encode("abc", add_special_tokens=False) == [ID["ab"], ID["c"]]
    assert bc_first.decode([ID["a"], ID["bc"]]) == ab_first.decode([ID["ab"], ID["c"]]) == "abc"


def test_a_character_outside_the_vocabulary_falls_back_to_its_bytes(vocab):
    ids = vocab.encode("aé😀", add_special_tokens=False)
    assert ids == [ID["a"]] + [ID[f"<0x{b:02X}>"] for b in "é😀".encode()]
    assert vocab.decode(ids) == "aé😀"
    detokenizer = vocab.detokenizer()
    pieces = [detokenizer.step(i) for i in ids]
    assert "".join(pieces) == "aé😀" and pieces[1] == "" and "\ufffd" not in "".join(pieces)  # no half character


def test_spaces_are_written_as_the_sentencepiece_marker(vocab):
    assert vocab.token_strs(vocab.encode(" a b", add_special_tokens=False)) == ["\u2581a", "\u2581b"]
    assert vocab.decode(vocab.encode(" a b")) == " a b"


def test_control_and_user_defined_tokens_in_the_text_stay_whole(vocab):
    text = "<start_of_turn>ab\n<end_of_turn>"
    ids = vocab.encode(text, add_special_tokens=False)
    assert ids == [ID["<start_of_turn>"], ID["ab"], ID["\n"], ID["<end_of_turn>"]]
    assert vocab.decode(ids, skip_special_tokens=False) == text
    assert vocab.decode(ids) == "ab\n"  # control tokens are special; user-defined ones are text


def test_bos_eos_and_space_prefix_follow_the_file(tmp_path):
    default = read(write_vocab(tmp_path / "default.gguf", _scores()))  # llama.cpp's SPM defaults: BOS, prefix
    assert default.encode("a") == [ID["<s>"], ID["\u2581a"]]
    ids = default.encode("a b é")
    assert default.decode(ids) == "a b é"  # the prefix space is taken off again, also when streamed
    detokenizer = default.detokenizer()
    assert "".join(detokenizer.step(i) for i in ids) == "a b é"
    plain = read(write_vocab(tmp_path / "plain.gguf", _scores(), add_bos_token=False, add_eos_token=True,
                             add_space_prefix=False))
    assert plain.encode("a") == [ID["a"], ID["</s>"]]
    assert plain.encode("a", add_special_tokens=False) == [ID["a"]]
    assert plain.encode("") == [ID["</s>"]] and default.encode("") == [ID["<s>"]]


def test_gemma_runs_of_spaces_merge_like_pieces_in_file_order(tmp_path):
    """As transformers builds Gemma's tokenizer: the user-defined runs of spaces are ▁ pieces,
    merged first, and merges follow the file's order rather than the scores."""
    gemma = read(write_vocab(tmp_path / "gemma.gguf", _scores(ab=-20.0, bc=-10.0), architecture="gemma3",
                             add_space_prefix=False))
    assert gemma.encode("abc", add_special_tokens=False) == [ID["ab"], ID["c"]]  # "ab" is first in the file
    assert gemma.encode("a  b", add_special_tokens=False) == [ID["a"], ID["  "], ID["b"]]
    assert gemma.encode("a     b", add_special_tokens=False) == [ID["a"], ID["  "], ID["   "], ID["b"]]
    assert gemma.decode(gemma.encode("a     b")) == "a     b"


def test_transformers_reads_the_tiny_files_alike(tmp_path):
    from transformers import AutoTokenizer

    texts = ["abc", " abc b", "a  b", "a   b    c", "é😀", "<start_of_turn>a\nab<end_of_turn>\n", "", " ", "\n a"]
    for name, architecture, scores in (("llama.gguf", "llama", _scores(ab=-20.0, bc=-10.0)),
                                       ("gemma3.gguf", "gemma3", _scores(ab=-20.0, bc=-10.0))):
        path = write_vocab(tmp_path / name, scores, architecture=architecture,
                           add_space_prefix=architecture == "llama")
        ours, theirs = read(path), AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=name)
        for text in texts:
            ids = ours.encode(text)
            assert ids == theirs(text).input_ids, (name, text)
            assert ours.decode(ids, skip_special_tokens=False) == theirs.decode(ids), (name, text)


def test_stop_tokens_are_the_eos_and_the_control_end_of_turn_tokens(tmp_path):
    """<end_of_turn> is control: a stop token though the file names only </s>. A user-defined
    token of a stop token's text is text (Gemma 3's HTML tag "</s>")."""
    types = list(TYPES)
    types[ID["</s>"]] = 4
    tokenizer = read(write_vocab(tmp_path / "v.gguf", _scores(), types=types, eos_token_id=ID["a"]))
    assert tokenizer.eos_token_ids == [ID["a"], ID["<end_of_turn>"]]
    assert tokenizer.eos_token_id == ID["a"]  # the file's own first


def test_llama_cpps_exceptions_to_the_stop_tokens(tmp_path):
    """gpt-oss ends a message with <|end|> and the turn with <|return|> or <|call|>."""
    harmony = ["<|end|>", "<|return|>", "<|call|>"]
    tokens, types = TOKENS + harmony, TYPES + [3] * 3
    tokenizer = read(write_vocab(tmp_path / "v.gguf", _scores() + [-1000.0] * 3, tokens=tokens, types=types))
    assert tokenizer.eos_token_ids == [ID["</s>"], ID["<end_of_turn>"], len(TOKENS) + 1, len(TOKENS) + 2]


@pytest.mark.parametrize("model", ["bert", "rwkv", "t5", "gemma4"])
def test_another_tokenizer_model_is_refused_naming_it(tmp_path, model):
    path = write_vocab(tmp_path / "v.gguf", _scores(), model=model)
    with pytest.raises(ValueError, match=f"tokenizer.ggml.model '{model}' is not supported"):
        read(path)


# ----- the real Gemma 3 270M file ------------------------------------------------------------

# Pieces the random texts are made of: scripts, emoji, digits, code, whitespace runs (past the
# vocabulary's longest: 31), the file's control and user-defined tokens written in the text, and
# near-misses of them.
PIECES = ["hello", "world", "The", " quick", "Mr. Darcy", "I'm", "don't", "日本語", "中文字符", "한국어", "😀",
          "🚀👍🏽", "👨\u200d👩\u200d👧", "é", "ñ", "Ελληνικά", "русский", "עברית", "العربية", "हिन्दी", "ǅ", "ﬁ",
          "Å", "A\u030a", "𝔘𝔫𝔦𝔠𝔬𝔡𝔢", "Z̤͔ͧ̑̓ä͖̭̈̇", "1234567", "3.14159", "2026-11-21", "0x1F",
          "def f(x):\n    return x ** 2", "{}[]()", "''", '"', "\\", "$€™", "\u200b", "\u00a0", "\ufeff", "\x00", "\x7f",
          " ", "  ", "   ", " " * 40, "\t", "\t" * 35, "\n", "\n\n", "\r\n", "\n" * 40, "a" * 40,
          "<start_of_turn>", "<end_of_turn>", "<bos>", "<eos>", "<pad>", "<unk>", "<mask>", "<start_of_image>",
          "<unused5>", "[multimodal]", "<table>", "</td>", "<s>", "</s>", "<0x41>", "<start_of_turn", "end_of_turn>"]


def varied_texts(count: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    texts = ["", " ", "  ", "\n", "\t", "a", " a", "a ", " a ", " " * 32,
             "<start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n"]
    while len(texts) < count:
        if rng.random() < 0.7:
            texts.append("".join(rng.choice(PIECES) + rng.choice(["", "", " ", "  ", "\n", "\t"])
                                 for _ in range(rng.randrange(1, 10))))
        else:  # any character: ASCII, Latin to CJK, emoji, with whitespace between
            ranges = [(32, 127), (0xA0, 0x3000), (0x4E00, 0x9FFF), (0x1F300, 0x1FAFF), (9, 11), (32, 33)]
            texts.append("".join(chr(rng.randrange(*rng.choice(ranges))) for _ in range(rng.randrange(1, 60))))
    return texts


TEXTS = varied_texts(3000)


@pytest.fixture(scope="module")
def gemma() -> Tokenizer:
    return read(gemma_path())


@pytest.fixture(scope="module")
def gemma_hf():
    """transformers' tokenizer built from the same file (about 20 s: it derives 500k merges)."""
    from transformers import AutoTokenizer

    path = gemma_path()
    return AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))


@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_gemma_ids_equal_transformers(gemma, gemma_hf, add_special_tokens):
    theirs = gemma_hf(TEXTS, add_special_tokens=add_special_tokens)["input_ids"]
    ours = gemma.encode_batch(TEXTS, add_special_tokens=add_special_tokens)
    mismatched = [(text, a, b) for text, a, b in zip(TEXTS, ours, theirs) if a != b]
    assert not mismatched, f"{len(mismatched)} of {len(TEXTS)} texts differ, first: {mismatched[0]}"


def test_gemma_decodes_as_transformers_and_gives_the_text_back(gemma, gemma_hf):
    """A ▁ written in the text reads as a space (SentencePiece's own spelling of one): the only
    text that does not come back."""
    for text in TEXTS:
        ids = gemma.encode(text)
        assert gemma.decode(ids, skip_special_tokens=False) == gemma_hf.decode(ids), text
        assert gemma.decode(ids) == gemma_hf.decode(ids, skip_special_tokens=True), text
        if "\u2581" not in text:
            assert gemma.decode(ids, skip_special_tokens=False) == "<bos>" + text


def test_gemma_streaming_detokenization_equals_the_full_decode(gemma):
    for text in TEXTS:
        ids = gemma.encode(text)
        for skip_special_tokens in (True, False):
            detokenizer = gemma.detokenizer(skip_special_tokens)
            assert "".join(detokenizer.step(i) for i in ids) == gemma.decode(ids, skip_special_tokens), text


def test_gemma_special_tokens_and_stop_tokens(gemma):
    assert gemma.encode("<start_of_turn>user\nHi<end_of_turn>\n") == [2, 105, 2364, 107, 10979, 106, 107]
    assert gemma.special_tokens == {"bos_token": "<bos>", "eos_token": "<eos>", "unk_token": "<unk>",
                                    "pad_token": "<pad>"}
    assert gemma.eos_token_ids == [1, 106]  # <eos>, then <end_of_turn>, which the file does not name
    assert gemma.chat_template is None  # the pretrained model has none


def test_gemma_long_runs_of_spaces_split_as_transformers_splits_them(gemma):
    """Where llama.cpp differs: it cuts out the longest run the vocabulary has (31 + 1)."""
    run16 = gemma.encode(" " * 16, add_special_tokens=False)
    assert len(run16) == 1 and gemma.encode(" " * 32, add_special_tokens=False) == run16 * 2
