"""The BERT kind: BERT's `BertAttention` (RoBERTa and XLM-RoBERTa as BERT) and ModernBERT."""

from .config import _layer_type, _rope_kwargs, _rope_parameters
from .tensors import _blocks, _separate_projections, _split_fused


def _bert(config, tensors, index):
    """BERT's `BertAttention`: `self.query/key/value` and `output.dense` (its residual and LayerNorm stay out)."""
    if "output.dense.weight" not in tensors:
        raise ValueError(
            "Pass the `BertAttention` module (`encoder.layer[i].attention`), which holds the output projection "
            f"`output.dense`, not its `self`. Received: a module holding {', '.join(sorted(tensors))}"
        )
    num_heads = config["num_attention_heads"]
    head_dim = config["hidden_size"] // num_heads
    sources = ("self.query", "self.key", "self.value", "output.dense")
    weights, bias = _separate_projections(tensors, sources)
    kwargs = {"d_model": config["hidden_size"], "num_heads": num_heads, "head_dim": head_dim}
    return kwargs | {"bias": bias, "scale": float(head_dim**-0.5)}, weights


def _modernbert(config, tensors, index):
    """ModernBERT: a fused Wqkv [q | k | v], Wo, RoPE of the layer type; its local layers attend the keys within
    `local_attention // 2` of each token on both sides (|t - s| <= local_attention // 2)."""
    layer_type = _layer_type(config, index)
    width, num_heads = config["hidden_size"], config["num_attention_heads"]
    head_dim = width // num_heads
    weights, bias = _split_fused(tensors, "Wqkv", "Wo", _blocks(width, width, width))
    kwargs = {"d_model": width, "num_heads": num_heads, "bias": bias, "scale": float(head_dim**-0.5)}
    if layer_type == "sliding_attention":
        half = config["local_attention"] // 2 if "local_attention" in config else config["sliding_window"]
        kwargs["window"] = (half + 1, half + 1)  # s > t - (half + 1) and s < t + (half + 1)
    return kwargs | _rope_kwargs(_rope_parameters(config, layer_type), head_dim), weights
