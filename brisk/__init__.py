"""brisk: an efficient LLM inference engine and server."""

from brisk.kernels import isa

isa.configure_torch()  # BRISK_ISA caps torch's kernels too, before its first operation (kernels/isa.py)

from brisk.config import EngineConfig
from brisk.embed.embedder import Embedder, Embedding
from brisk.engine.adapters import LoRARequest
from brisk.engine.output import CompletionOutput, RequestOutput
from brisk.llm import LLM
from brisk.sample.grammar import StructuredOutputs
from brisk.sample.params import SamplingParams

__all__ = ["LLM", "SamplingParams", "StructuredOutputs", "EngineConfig", "RequestOutput", "CompletionOutput", "Embedder",
           "Embedding", "LoRARequest"]
