"""POST /v1/embeddings in OpenAI's shape, answered by the embedding model (brisk/embed/).

Every input of a request is its own item in the DynamicBatcher, so the inputs of many
concurrent requests share batches, and a request of many inputs is spread over batches of
similar lengths. Texts are tokenized on a worker thread; token-id inputs are read as they are.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import uuid
from typing import Callable

import torch
from fastapi import APIRouter

from brisk.config import EmbeddingConfig
from brisk.embed.batcher import BatchRecord, QueueFull
from brisk.embed.embedder import Embedder, InputTooLong
from brisk.server.errors import APIError
from brisk.server.protocol import EmbeddingRequest

logger = logging.getLogger("brisk.server")


class EmbeddingServing:
    """The embedding model behind /v1/embeddings: validation, the batcher, the response shape."""

    def __init__(self, embedder: Embedder, config: EmbeddingConfig,
                 on_batch: Callable[[BatchRecord], None] = lambda _: None,
                 generating: Callable[[], bool] | None = None):
        """generating: whether generation requests are in flight (the batcher then shares the cores)."""
        self.embedder = embedder
        self.batcher = embedder.batcher(config, on_batch, generating)

    @property
    def model_name(self) -> str:
        return self.embedder.name

    def model_card(self, created: int) -> dict:
        return {"id": self.model_name, "object": "model", "created": created, "owned_by": "brisk",
                "root": self.embedder.path, "max_model_len": self.embedder.max_length}

    async def embeddings(self, body: EmbeddingRequest) -> dict:
        embedder = self.embedder
        if body.model is not None and body.model != self.model_name:
            raise APIError(404, f"The model `{body.model}` does not exist (embeddings are served by "
                                f"`{self.model_name}`).", type="not_found_error", param="model", code="model_not_found")
        if body.dimensions is not None and body.dimensions != embedder.dimensions:
            raise APIError(400, f"{self.model_name} makes {embedder.dimensions}-dimensional embeddings and cannot "
                                f"shorten them: omit dimensions, or pass {embedder.dimensions}.", param="dimensions")
        inputs = body.inputs()
        try:
            if isinstance(inputs[0], str):
                batch = await asyncio.to_thread(embedder.tokenize, inputs, body.truncate)
            else:
                batch = embedder.check_ids(inputs, body.truncate)
        except InputTooLong as e:
            raise APIError(400, str(e), param="input", code="context_length_exceeded") from None
        except ValueError as e:
            raise APIError(400, str(e), param="input") from None
        batcher = self.batcher
        if len(batch) > batcher.max_queue_size:
            raise APIError(400, f"{len(batch)} inputs are more than this server queues at once "
                                f"({batcher.max_queue_size}): split the request.", param="input")
        try:
            vectors = await batcher.submit_many(batch)
        except QueueFull as e:
            raise APIError(429, f"The server is busy: {e}. Retry shortly.", type="rate_limit_error",
                           headers={"Retry-After": "1"}) from None
        except Exception as e:  # the model failed on an input that passed validation
            logger.exception("the embedding model failed")
            raise APIError(500, f"The embedding model failed: {type(e).__name__}.", type="server_error") from None
        tokens = sum(len(ids) for ids in batch)
        return {"id": f"embd-{uuid.uuid4().hex}", "object": "list", "model": self.model_name,
                "data": [{"object": "embedding", "index": i, "embedding": _encode(v, body.encoding_format)}
                         for i, v in enumerate(vectors)],
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


def _encode(vector: torch.Tensor, encoding_format: str) -> list[float] | str:
    """float: a JSON list; base64: the little-endian float32 bytes, as OpenAI sends them."""
    if encoding_format == "float":
        return vector.tolist()
    return base64.b64encode(vector.to(torch.float32).numpy().astype("<f4").tobytes()).decode("ascii")


def embedding_router(serving: EmbeddingServing) -> APIRouter:
    router = APIRouter()
    router.add_api_route("/v1/embeddings", serving.embeddings, methods=["POST"])
    return router
