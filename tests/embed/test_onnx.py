"""The encoder exported to ONNX Runtime: the float export computes the torch encoder's vectors on
batches of any shape, int8 stays close, `brisk quantize-embedder` writes a folder that serves
as it is, and a folder without ONNX files gets them made once, in the cache."""

from __future__ import annotations

import copy
import os

import pytest
import torch

from brisk.embed import onnx_backend
from brisk.embed.embedder import Embedder
from tests.embed.test_encoder import SENTENCES, _tiny_bert

TEXTS = SENTENCES + ["word " * 400]  # the last is cut to the model's limit: the longest batch row


def _vectors(embedder, texts) -> torch.Tensor:
    return torch.tensor([r.embedding for r in embedder.embed(texts, batch_size=3)])


def _running(embedder: Embedder, path: str) -> Embedder:
    variant = copy.copy(embedder)
    variant.model = onnx_backend.OnnxEncoder(path)
    return variant


@pytest.fixture(scope="module")
def real_export(real_embedder, tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp("onnx")
    float_path, int8_path = str(folder / onnx_backend.FLOAT_FILE), str(folder / onnx_backend.INT8_FILE)
    onnx_backend.export(real_embedder.model, float_path)
    onnx_backend.quantize_int8(float_path, int8_path)
    return str(folder)


def test_the_float_export_computes_the_torch_vectors(real_embedder, real_export):
    expected = _vectors(real_embedder, TEXTS)
    got = _vectors(_running(real_embedder, os.path.join(real_export, onnx_backend.FLOAT_FILE)), TEXTS)
    assert (got - expected).abs().max().item() < 1e-5


def test_int8_weights_stay_close(real_embedder, real_export):
    expected = _vectors(real_embedder, TEXTS)
    got = _vectors(_running(real_embedder, os.path.join(real_export, onnx_backend.INT8_FILE)), TEXTS)
    cosines = torch.nn.functional.cosine_similarity(got, expected, dim=-1)
    assert cosines.mean().item() > 0.98 and cosines.min().item() > 0.95
    assert (got - expected).abs().max().item() > 1e-4  # it is really another model, not the float one
    assert os.path.getsize(os.path.join(real_export, onnx_backend.INT8_FILE)) < 0.3 * os.path.getsize(
        os.path.join(real_export, onnx_backend.FLOAT_FILE))


@pytest.mark.parametrize("pooling", ["mean", "max", "cls", "lasttoken"])
def test_quantize_embedder_writes_a_folder_that_serves(tmp_path, pooling, capsys):
    from brisk.cli import main

    source, out = str(tmp_path / "bert"), str(tmp_path / "out")
    _tiny_bert(source, pooling, normalize=pooling == "mean")
    text = tmp_path / "text.txt"
    text.write_text(" ".join(f"w{i % 50}" for i in range(5000)))
    assert main(["quantize-embedder", source, "--format", "onnx", "--int8", "static", "--fp16", "--out", out,
                 "--text", str(text), "--calibration-sentences", "32", "--agreement-sentences", "32"]) == 0
    printed = capsys.readouterr().out
    assert "onnx/brisk_encoder.onnx (float32)" in printed and "cosine mean 1.000000" in printed
    assert "onnx/brisk_encoder_int8.onnx (int8 (static))" in printed and "onnx/brisk_encoder_fp16.onnx (float16)" in printed
    texts = ["w1 w2 w3", "w4", " ".join(f"w{i}" for i in range(30))]
    expected = _vectors(Embedder(source), texts)
    for backend in ("onnx", "onnx-int8"):
        served = Embedder(out, backend=backend)
        assert served.model.path == os.path.join(out, "onnx", onnx_backend.BACKEND_FILES[backend])  # its own file
        got = _vectors(served, texts)
        if backend == "onnx":
            assert (got - expected).abs().max().item() < 1e-5
        else:
            assert torch.nn.functional.cosine_similarity(got, expected, dim=-1).min().item() > 0.99


def test_a_folder_without_onnx_files_gets_them_once_in_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    source = str(tmp_path / "bert")
    _tiny_bert(source, "mean", normalize=True)
    first = Embedder(source, backend="onnx-int8")
    made = first.model.path
    assert made.startswith(str(tmp_path / "cache" / "brisk" / "onnx")) and os.path.isfile(made)
    stamp = os.stat(made).st_mtime_ns
    assert Embedder(source, backend="onnx-int8").model.path == made and os.stat(made).st_mtime_ns == stamp  # reused
    assert not [name for name in os.listdir(os.path.dirname(made)) if name.endswith(".tmp")]


def test_an_onnx_file_of_another_shape_is_refused(tmp_path):
    """optimum's onnx/model.onnx (token states out, no pooling) is not a brisk encoder export."""
    import onnx
    from onnx import TensorProto, helper

    graph = helper.make_graph([helper.make_node("Identity", ["input_ids"], ["last_hidden_state"])], "optimum",
                              [helper.make_tensor_value_info("input_ids", TensorProto.INT64, [None, None])],
                              [helper.make_tensor_value_info("last_hidden_state", TensorProto.INT64, [None, None])])
    path = str(tmp_path / "model.onnx")
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9), path)
    from brisk.config import ConfigError

    with pytest.raises(ConfigError, match="not a brisk encoder export"):
        onnx_backend.OnnxEncoder(path)
