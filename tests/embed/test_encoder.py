"""The sentence encoder against sentence-transformers: the real all-MiniLM-L6-v2 on real
sentences, and tiny random BERTs in every pooling mode brisk reads from a folder."""

from __future__ import annotations

import json
import os

import pytest
import torch

from brisk.config import ConfigError
from brisk.embed.embedder import Embedder, InputTooLong

SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "It is a truth universally acknowledged, that a single man in possession of a good fortune, must be in want "
    "of a wife.",
    "Continuous batching keeps the accelerator busy while requests come and go.",
    "Hi",
    "",
    "Paged attention stores keys and values in fixed-size blocks, so memory is never fragmented.",
    "¿Dónde está la biblioteca? 图书馆在哪里？",
    "A sentence about cooking pasta: boil the water, salt it well, and taste before draining.",
]


def _cosines(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cosine_similarity(a, b, dim=-1)


def _vectors(results) -> torch.Tensor:
    return torch.tensor([r.embedding for r in results])


@pytest.fixture(scope="module")
def st_model(real_embedder):
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(real_embedder.path, device="cpu")


def test_real_model_matches_sentence_transformers(real_embedder, st_model):
    long_text = " ".join(SENTENCES) * 12  # far past the 256 tokens the model reads: both truncate
    texts = SENTENCES + [long_text]
    expected = st_model.encode(texts, convert_to_tensor=True, batch_size=4)
    ours = real_embedder.embed(texts, batch_size=3)  # other batches: other padding, same vectors
    assert _cosines(_vectors(ours), expected).min().item() > 1 - 1e-5
    assert (_vectors(ours) - expected).abs().max().item() < 1e-4
    assert ours[-1].num_tokens == real_embedder.max_length == 256
    assert ours[0].num_tokens == len(st_model.tokenize([texts[0]])["input_ids"][0])
    assert torch.allclose(_vectors(ours).norm(dim=-1), torch.ones(len(texts)), atol=1e-5)  # Normalize module


def test_one_input_embeds_alone_as_in_any_batch(real_embedder):
    alone = [real_embedder.embed(text)[0].embedding for text in SENTENCES[:3]]
    together = [r.embedding for r in real_embedder.embed(SENTENCES[:3])]
    assert (torch.tensor(alone) - torch.tensor(together)).abs().max().item() < 1e-5


def test_token_ids_are_read_as_given(real_embedder):
    ids = real_embedder.tokenize(SENTENCES[:2])
    from_ids = real_embedder.embed(ids)
    from_text = real_embedder.embed(SENTENCES[:2])
    assert [r.embedding for r in from_ids] == [r.embedding for r in from_text]
    one = real_embedder.embed(ids[0])  # one list of ids: one input
    assert len(one) == 1 and (_vectors(one) - _vectors(from_text[:1])).abs().max().item() < 1e-6


def test_too_long_inputs_are_cut_or_refused(real_embedder):
    long_text = "word " * 400
    assert real_embedder.embed(long_text)[0].num_tokens == 256
    with pytest.raises(InputTooLong, match="input 1 has more than 256 tokens"):
        real_embedder.embed(["short", long_text], truncate=False)
    with pytest.raises(InputTooLong, match="input 0 has 300 tokens"):
        real_embedder.embed([[1000] * 300], truncate=False)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        real_embedder.embed([[5, 10**6]])


def _tiny_bert(folder: str, pooling: str, normalize: bool) -> None:
    """A random 2-layer BERT as a sentence-transformers folder with the given pooling."""
    import transformers

    words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + [f"w{i}" for i in range(59)]
    os.makedirs(folder)
    with open(os.path.join(folder, "vocab.txt"), "w") as f:
        f.write("\n".join(words) + "\n")
    transformers.BertTokenizerFast(vocab_file=os.path.join(folder, "vocab.txt")).save_pretrained(folder)
    config = transformers.BertConfig(vocab_size=len(words), hidden_size=32, num_hidden_layers=2,
                                     num_attention_heads=4, intermediate_size=64, max_position_embeddings=64)
    torch.manual_seed(0)
    transformers.BertModel(config).save_pretrained(folder, safe_serialization=True)
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    with open(os.path.join(folder, "modules.json"), "w") as f:
        json.dump(modules, f)
    with open(os.path.join(folder, "sentence_bert_config.json"), "w") as f:
        json.dump({"max_seq_length": 16, "do_lower_case": False}, f)
    os.makedirs(os.path.join(folder, "1_Pooling"))
    modes = {"mean": "pooling_mode_mean_tokens", "cls": "pooling_mode_cls_token", "max": "pooling_mode_max_tokens",
             "mean_sqrt_len": "pooling_mode_mean_sqrt_len_tokens", "lasttoken": "pooling_mode_lasttoken"}
    with open(os.path.join(folder, "1_Pooling", "config.json"), "w") as f:
        json.dump({"word_embedding_dimension": 32} | {key: key == modes[pooling] for key in modes.values()}, f)


@pytest.mark.parametrize("pooling,normalize", [("mean", True), ("cls", False), ("max", False),
                                               ("mean_sqrt_len", False), ("lasttoken", True)])
def test_every_pooling_mode_matches_sentence_transformers(tmp_path, pooling, normalize):
    from sentence_transformers import SentenceTransformer

    folder = str(tmp_path / pooling)
    _tiny_bert(folder, pooling, normalize)
    texts = ["w1 w2 w3", "w4", "w5 w6 w7 w8 w9 w10 w11", " ".join(f"w{i}" for i in range(30))]  # the last: cut to 16
    expected = SentenceTransformer(folder, device="cpu").encode(texts, convert_to_tensor=True)
    ours = Embedder(folder).embed(texts)
    assert (_vectors(ours) - expected).abs().max().item() < 1e-5
    assert ours[-1].num_tokens == 16


def test_unsupported_folders_are_refused(tmp_path):
    folder = str(tmp_path / "weighted")
    _tiny_bert(folder, "mean", False)
    with open(os.path.join(folder, "1_Pooling", "config.json")) as f:
        config = json.load(f)
    with open(os.path.join(folder, "1_Pooling", "config.json"), "w") as f:
        json.dump(config | {"pooling_mode_mean_tokens": False, "pooling_mode_weightedmean_tokens": True}, f)
    with pytest.raises(ConfigError, match="pooling 'weightedmean' is not supported"):
        Embedder(folder)
    with pytest.raises(ConfigError, match="no config.json"):
        Embedder(str(tmp_path))
