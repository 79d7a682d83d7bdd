"""What the families that `structure` recognises, but refuses, add to the attention the layer computes, in
their refusals' own words: by model type (`_REFUSED`: the Llama kind's structure, computing something else) and
by attention class (`_ADDS`: not softmax attention over projected queries, keys and values).
`shared_tests/test_hf_families.py` is the proof of each.
"""

_REFUSED = {  # the Llama kind by structure, computing something else: what it adds
    "beam": "Beam's full-attention layers are NoPE and multiply their queries by "
    "(1 + (position_ids + 1) / 2048) ** 0.1 (`attention_scaling`, by each row's `position_ids`), a factor no "
    "`query_scaling` type computes, and a layer without RoPE takes no `positions` (its gate, a sigmoid with a "
    "per-head `gate_bias`, would port: the bias repeated over each head's features)",
    "zamba2": "Zamba2's shared attention reads the hidden states concatenated with the embeddings "
    "(`attention_hidden_size`, twice the hidden size) and writes the hidden size, where the layer's query input is "
    "as wide as its output (`d_model`), and one module serves every hybrid layer (its forward takes `layer_idx`: "
    "one cache slot per depth, and per-depth LoRA adapters with `use_shared_attention_adapter`)",
    "unlimited_ocr": "UnlimitedOCR's text layers are reference sliding attention (`reference_sliding_attention`: each "
    "token sees the last `sliding_window` tokens and every prompt token)",
}


_ADDS = {  # attention classes that compute something other than softmax attention over projected q, k, v: what
    "BigBirdBlockSparseAttention": "BigBird's block-sparse attention (`attention_type` 'block_sparse'): each block of "
    "queries sees a window of key blocks, the global blocks and `num_random_blocks` random blocks",
    "CpmAntAttention": "CPM-Ant's attention adds to its scores a learned relative position bias by segment and "
    "distance bucket (`CpmAntSegmentPositionEmbedding`) that its model computes",
    "HrmTextAttention": "HRM-Text calls each attention module again and again in one step (its H and L stacks recur "
    "`H_cycles` x (`L_cycles` + 1) times, each call with a cache slot of its own, `cycle_offset`), and its prompt "
    "tokens attend both ways (`prefix_lm`)",
    "JetMoeAttention": "JetMoE's attention is a mixture of attention experts: each token's queries and outputs come "
    "from its top `num_experts_per_tok` experts (`experts`, routed), its keys and values from a shared `kv_proj`",
    "MiniMaxLightningAttention": "MiniMax's lightning attention is a linear attention with a per-head exponential "
    "decay (a recurrent state), not softmax attention",
    "ProphetNetNgramSelfAttention": "ProphetNet's n-gram self-attention runs `ngram` predicting streams beside the "
    "main stream, with learned relative position buckets (`num_buckets`)",
    "ProphetNetAttention": "ProphetNetAttention is ProphetNet's encoder attention and its decoder's cross-attention "
    "(keys and values from the encoder); its causal decoder's self-attention is the n-gram one",
    "RoFormerAttention": "RoFormer's BERT-kind attention turns its queries and keys (its values too with "
    "`rotary_value`) by a rotary embedding its model computes from sinusoids (`sinusoidal_pos`), which the BERT kind's "
    "port does not read",
    "RwkvSelfAttention": "RWKV's time mixing is a linear recurrence (WKV) with a learned time decay and time-first "
    "bonus, not softmax attention",
    "ZayaAttention": "ZAYA's compressed convolutional attention mixes its queries and keys by causal 1D "
    "convolutions with residual projections, and takes half its values from a delayed recurrent state "
    "(`ZayaCCAProjection`)",
}
