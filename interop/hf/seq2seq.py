"""T5 and the BART kind (BART, Whisper, OPT): their porters, and T5's relative position bias as a call
argument."""

from .tensors import _separate_projections


def _bart(config, tensors, index):
    """BART, Whisper, OPT (and the other BART-style models): q/k/v_proj and out_proj, scale 1 / sqrt(H)."""
    width = config.get("d_model") or config["hidden_size"]
    num_heads = _bart_heads(config)
    weights, bias = _separate_projections(tensors, ("q_proj", "k_proj", "v_proj", "out_proj"))
    return {
        "d_model": width,
        "num_heads": num_heads,
        "bias": bias,
        "scale": float((width // num_heads) ** -0.5),
    }, weights


def _bart_heads(config):
    """BART-style configs give encoder and decoder heads apart: they must agree for one porter to read either."""
    heads = {config.get(key) for key in ("encoder_attention_heads", "decoder_attention_heads")} - {None}
    if len(heads) > 1:
        raise ValueError(
            "`config` must have one number of heads for the encoder and the decoder (this porter cannot tell them "
            f"apart). Received: encoder_attention_heads and decoder_attention_heads {sorted(heads)}"
        )
    return heads.pop() if heads else config["num_attention_heads"]


def _t5(config, tensors, index):
    """T5: no biases, scale 1.0; the relative position bias is a call argument (`t5_position_bias`)."""
    weights, bias = _separate_projections(tensors, ("q", "k", "v", "o"))
    kwargs = {"d_model": config["d_model"], "num_heads": config["num_heads"], "head_dim": config["d_kv"]}
    return kwargs | {"bias": bias, "scale": 1.0}, weights


def t5_position_bias(module, query_length, key_length, past_length=0):
    """T5's relative position bias, (1, N, T, S) float32, to pass as `attention_bias`.

    Args:
        module: the `T5Attention` that holds `relative_attention_bias`: the first layer's of the
            encoder or decoder stack (the other layers reuse it).
        query_length: T.
        key_length: S (the L cache slots when decoding).
        past_length: the position of the first query (the cache's index when decoding).
    """
    if not module.has_relative_attention_bias:
        raise ValueError(
            "`module` must hold T5's `relative_attention_bias` (the first layer of its stack holds it, the others "
            "reuse it). Received: a T5Attention with has_relative_attention_bias=False"
        )
    bias = module.compute_bias(query_length, key_length, past_seen_tokens=past_length)
    return bias.detach().cpu().float().numpy().copy()
