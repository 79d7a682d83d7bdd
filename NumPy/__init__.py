"""NumPy multi-head attention; see Multi_Head_Attention.py."""

from .Multi_Head_Attention import MultiHeadAttention, dot_product_attention

__all__ = ["MultiHeadAttention", "dot_product_attention"]
