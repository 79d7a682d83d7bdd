"""TensorFlow multi-head attention; see Multi_Head_Attention.py."""

from .Multi_Head_Attention import (
    AttentionMaskWarning,
    KVCache,
    MultiHeadAttention,
    alibi_bias,
    document_positions,
    dot_product_attention,
    segment_ids_from_cu_seqlens,
    segment_ids_from_position_ids,
)

__all__ = [
    "AttentionMaskWarning",
    "KVCache",
    "MultiHeadAttention",
    "alibi_bias",
    "document_positions",
    "dot_product_attention",
    "segment_ids_from_cu_seqlens",
    "segment_ids_from_position_ids",
]
