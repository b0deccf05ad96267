"""The sentence encoder under ONNX Runtime: export, int8 and fp16 conversion, and inference.

The export is of brisk's own SentenceEncoder, pooling and normalization included, so the ONNX
graph maps (input_ids, attention_mask) to finished sentence vectors, with batch and sequence
length dynamic. It goes through torch.export (`dynamo=True`): the TorchScript exporter traces
the packing of real tokens (`nonzero`) with the example's shapes baked in and gives wrong
vectors for other batches.

Variants, each a file in the model folder's `onnx/` (sentence-transformers' place for ONNX
files; brisk's are named apart, since a folder from the Hub may already hold optimum's
`model.onnx`, which returns token states, not sentence vectors):
- `brisk_encoder.onnx`: float32, what the torch encoder computes.
- `brisk_encoder_int8.onnx`: int8 weights. Dynamic (the default): activations are quantized per batch
  at run time, so nothing but the weights is needed. Static: activation ranges are calibrated
  once on sample sentences, which saves the run-time range pass but fixes ranges that real
  inputs may exceed.
- `brisk_encoder_fp16.onnx`: float16 weights and activations (half the bytes; on CPUs without native
  fp16 arithmetic, ONNX Runtime converts on the fly and it is slower, so it is for size only).

A folder without them (the default model's, inside its package) gets them made once, at first
use, in brisk's cache folder.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import logging
import os
import shutil
import sys
import warnings
from pathlib import Path

import numpy as np
import torch

from brisk.embed.encoder import SentenceEncoder

logger = logging.getLogger("brisk.embed")

ONNX_DIR = "onnx"
FLOAT_FILE, INT8_FILE, FP16_FILE = "brisk_encoder.onnx", "brisk_encoder_int8.onnx", "brisk_encoder_fp16.onnx"
_INPUTS, _OUTPUTS = ["input_ids", "attention_mask"], ["embeddings"]
BACKEND_FILES = {"onnx": FLOAT_FILE, "onnx-int8": INT8_FILE}  # --embedding-backend -> the file it runs


def export(encoder: SentenceEncoder, path: str) -> None:
    """The encoder (float32) as one self-contained ONNX file (weights inside)."""
    batch, length = torch.export.Dim("batch"), torch.export.Dim("sequence")
    input_ids = torch.tensor([[1, 2, 3, 4, 5, 6], [1, 2, 3, 0, 0, 0]])  # an example: any small ids do
    mask = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0]])
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):  # the exporter's progress lines
        warnings.simplefilter("ignore")
        program = torch.onnx.export(encoder, (input_ids, mask), input_names=_INPUTS,
                                    output_names=_OUTPUTS, dynamo=True, verbose=False,
                                    dynamic_shapes=({0: batch, 1: length}, {0: batch, 1: length}))
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    program.save(path, external_data=False)


def quantize_int8(source: str, target: str, calibration: list[tuple[np.ndarray, np.ndarray]] | None = None) -> None:
    """int8 weights per output channel; activations quantized at run time (dynamic), or with
    ranges calibrated on `calibration` batches of (input_ids, attention_mask) (static)."""
    import onnx
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_dynamic, \
        quantize_static
    from onnxruntime.quantization.shape_inference import quant_pre_process

    class Batches(CalibrationDataReader):
        def __init__(self):
            self.batches = iter(calibration or [])

        def get_next(self):
            batch = next(self.batches, None)
            return None if batch is None else {"input_ids": batch[0], "attention_mask": batch[1]}

    # The exporter's recorded intermediate shapes trip ONNX's shape inference on the fused qkv
    # bias ((384) vs (1152)); dropped, they are inferred again from the graph.
    model = onnx.load(source)
    del model.graph.value_info[:]
    prepared = target + ".prepared"
    onnx.save(model, prepared)
    try:
        with contextlib.redirect_stdout(io.StringIO()):  # onnxruntime prints the graph's shapes
            quant_pre_process(prepared, prepared, skip_symbolic_shape=True)
            if calibration is None:
                quantize_dynamic(prepared, target, weight_type=QuantType.QInt8, per_channel=True)
            else:
                quantize_static(prepared, target, Batches(), quant_format=QuantFormat.QDQ, per_channel=True,
                                activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8,
                                op_types_to_quantize=["MatMul", "Gemm"])
    finally:
        os.remove(prepared)


def convert_fp16(source: str, target: str) -> None:
    import onnx
    from onnxruntime.transformers.float16 import convert_float_to_float16

    onnx.save(convert_float_to_float16(onnx.load(source), keep_io_types=True), target)


class OnnxEncoder:
    """An exported encoder in an ONNX Runtime session, called as SentenceEncoder is."""

    def __init__(self, path: str):
        import onnxruntime

        from brisk.config import ConfigError

        options = onnxruntime.SessionOptions()
        options.intra_op_num_threads = torch.get_num_threads()
        options.inter_op_num_threads = 1
        # ONNX Runtime's threads spin between ops (its default): with spinning off, batched
        # throughput fell 12% (int8: 1.34x torch instead of 1.58x, `brisk bench embed`). Whether
        # the spinning costs `brisk serve`'s engine and event loop more than that is not measured.
        self.path = path
        self.session = onnxruntime.InferenceSession(path, options, providers=["CPUExecutionProvider"])
        inputs, outputs = [i.name for i in self.session.get_inputs()], [o.name for o in self.session.get_outputs()]
        if inputs != _INPUTS or outputs != _OUTPUTS:
            raise ConfigError(f"{path} is not a brisk encoder export (inputs {inputs}, outputs {outputs}): make one "
                              f"with `brisk quantize-embedder`")

    def __call__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        (vectors,) = self.session.run(_OUTPUTS, {"input_ids": input_ids.numpy(),
                                                 "attention_mask": attention_mask.numpy()})
        return torch.from_numpy(vectors)


def onnx_file(folder: str, backend: str, encoder: SentenceEncoder) -> str:
    """The ONNX file `backend` runs for the model in `folder`: its own `onnx/` file if it has
    one, else one made now (export, and int8 quantization) in the cache."""
    name = BACKEND_FILES[backend]
    own = os.path.join(folder, ONNX_DIR, name)
    if os.path.isfile(own):
        return own
    cache = _cache_folder(folder, encoder)
    path = os.path.join(cache, name)
    if not os.path.isfile(path):
        float_path = os.path.join(cache, FLOAT_FILE)
        if not os.path.isfile(float_path):
            logger.info("exporting %s to ONNX (once) in %s", folder, cache)
            _atomically(float_path, lambda tmp: export(encoder, tmp))
        if name == INT8_FILE:
            logger.info("quantizing the ONNX encoder to int8 (once) in %s", cache)
            _atomically(path, lambda tmp: quantize_int8(float_path, tmp))
    return path


def _cache_folder(folder: str, encoder: SentenceEncoder) -> str:
    """brisk's cache for this model's ONNX files. The key covers what the export depends on: the
    weights file (path, size, modification time), the encoder's spec (pooling and
    normalization are in the graph) and this module and the encoder's code."""
    weights = os.path.join(folder, "model.safetensors")
    stat = os.stat(weights)
    code = b"".join(Path(module).read_bytes() for module in (__file__, sys.modules[SentenceEncoder.__module__].__file__))
    key = hashlib.sha256(f"{os.path.realpath(weights)}:{stat.st_size}:{stat.st_mtime_ns}:{encoder.hparams}".encode()
                         + code).hexdigest()[:16]
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(Path.home(), ".cache")
    return os.path.join(root, "brisk", "onnx", f"{os.path.basename(os.path.normpath(folder))}-{key}")


def _atomically(path: str, write) -> None:
    """Writes `path` through a temporary name, so a killed run leaves no half-written file."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def copy_model_folder(source: str, target: str) -> None:
    """The sentence-transformers folder's files (config, tokenizer, weights, pooling), without
    any ONNX files it has, into a new folder."""
    shutil.copytree(source, target, ignore=shutil.ignore_patterns(ONNX_DIR, "*.onnx", "__pycache__"))
