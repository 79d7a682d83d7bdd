"""Keras 3 multi-head attention on any backend; see Multi_Head_Attention.py."""

from .Multi_Head_Attention import AttentionMaskWarning, KVCache, MultiHeadAttention, alibi_bias, dot_product_attention

__all__ = ["AttentionMaskWarning", "KVCache", "MultiHeadAttention", "alibi_bias", "dot_product_attention"]
