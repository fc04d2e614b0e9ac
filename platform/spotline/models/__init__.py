"""Models Spotline trains: a byte-level GPT expressed as a layer list."""

from spotline.models.gpt import (
    VOCAB_SIZE,
    Block,
    Embedding,
    Head,
    build_pipeline_module,
    build_sequential,
    count_params,
    decode,
    encode,
    lm_loss,
)

__all__ = [
    "VOCAB_SIZE",
    "Block",
    "Embedding",
    "Head",
    "build_pipeline_module",
    "build_sequential",
    "count_params",
    "decode",
    "encode",
    "lm_loss",
]
