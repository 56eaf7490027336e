"""Request models of the pooling routes (a `--runner pooling` deployment), vLLM's fields:
/v1/embeddings (OpenAI's), /pooling, /score and /rerank (vLLM's, Jina's and Cohere's)."""

from __future__ import annotations

from typing import Literal

from pydantic import model_validator

from pdserve.services.gateway.protocol import OpenAIBaseModel

PoolingInput = str | list[str] | list[int] | list[list[int]]
"""One text, texts, one prompt's token ids, or several prompts' token ids (OpenAI's)."""
ScoreInput = str | list[str]


class _PoolingBase(OpenAIBaseModel):
    model: str | None = None
    user: str | None = None
    """OpenAI's end-user id: accepted, no effect."""
    truncate_prompt_tokens: int | None = None
    """vLLM's: keep the last N tokens of each input (-1: max_model_len) before the length
    check."""
    add_special_tokens: bool = True
    cache_salt: str | None = None
    request_id: str | None = None
    priority: int = 0
    """vLLM's: accepted; pooling requests are scheduled as prompts (shortest first)."""


class EmbeddingRequest(_PoolingBase):
    """POST /v1/embeddings (OpenAI's request plus vLLM's extensions)."""

    input: PoolingInput
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    """Matryoshka dimensions: refused (no pdserve model supports them)."""
    normalize: bool | None = None
    """vLLM's older name of use_activation."""
    use_activation: bool | None = None
    """vLLM's: L2-normalise the embedding (default: the model's pooler config)."""

    @property
    def normalize_flag(self) -> bool | None:
        return self.use_activation if self.use_activation is not None else self.normalize


class PoolingRequest(EmbeddingRequest):
    """POST /pooling (vLLM's): the pooled hidden state of each input, as `data`."""

    task: str | None = None
    """vLLM's: "embed" (or unset) only: pdserve pools for embeddings."""


class ScoreRequest(_PoolingBase):
    """POST /score (vLLM's): each pair's cosine similarity of their embeddings. The pairs
    are text_1 x text_2 (also spelled queries / documents, queries / items, data_1 /
    data_2): 1:1, 1:N or N:N."""

    text_1: ScoreInput | None = None
    text_2: ScoreInput | None = None
    queries: ScoreInput | None = None
    documents: ScoreInput | None = None
    items: ScoreInput | None = None
    data_1: ScoreInput | None = None
    data_2: ScoreInput | None = None

    @model_validator(mode="after")
    def _resolve(self) -> ScoreRequest:
        first = next((v for v in (self.text_1, self.queries, self.data_1) if v is not None),
                     None)
        second = next((v for v in (self.text_2, self.documents, self.items, self.data_2)
                       if v is not None), None)
        if first is None or second is None:
            raise ValueError("text_1 and text_2 (or queries and documents) are required")
        self.text_1, self.text_2 = first, second
        return self

    @property
    def pairs(self) -> tuple[list[str], list[str]]:
        def as_list(v: ScoreInput | None) -> list[str]:
            return [v] if isinstance(v, str) else list(v or [])
        return as_list(self.text_1), as_list(self.text_2)


class RerankRequest(_PoolingBase):
    """POST /rerank (vLLM's, Jina's and Cohere's): the documents by cosine similarity of
    their embedding to the query's, most relevant first."""

    query: str
    documents: list[str]
    top_n: int = 0
    """How many results (0: all)."""
    return_documents: bool = True
    """Cohere's: False leaves out each result's `document`."""
