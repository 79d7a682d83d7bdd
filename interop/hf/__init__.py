"""Port the attention of Hugging Face `transformers` models to `MultiHeadAttention`.

One converter for the three layers, two routes to the same `(layer_kwargs, weights)`: the
constructor arguments and the portable weights (docs/SPEC.md, "Weights").

From a loaded PyTorch model (needs torch and transformers):

    layer_kwargs, weights = port_attention(model.model.layers[0].self_attn, model.config)

From a checkpoint, with neither torch nor transformers installed (a Keras or NumPy user):

    layer_kwargs, weights = port_checkpoint("model/config.json", "model/model.safetensors", 0)

and in both cases:

    layer = MultiHeadAttention(**layer_kwargs)  # NumPy, PyTorch or TensorFlow: the same arguments
    layer.import_weights(weights)

Both routes run one porter per family: `porter(config, tensors, layer_index)` reads the config as
a dict and the attention module's own tensors by their names in its `state_dict` (`q_proj.weight`,
...). A family is found by its `transformers` model type (the config's `model_type`; for a module,
the `transformers.models.<type>` package its class comes from), so exact clones port like their
original (RoBERTa as BERT, Qwen3-MoE as Qwen3). A subclass that overrides `forward`, or a module
whose projections are not `torch` or `transformers` modules (LoRA, quantized, user classes), is
refused unless a porter is registered for its class name with `register_porter`.

Only what is attention is ported: the q/k/v projections (their biases where the module has
them), QK-norm, RoPE, the softmax scale, soft-capping, the sliding window, chunked attention,
sinks, the output gate, a norm of the merged heads (BitNet's, Kosmos-2's) and the output projection. Residual
connections, dropout and the layer norms around the attention stay in the model (BERT's module adds the residual and
a LayerNorm after `output.dense`; its pre-LN copies, RoBERTa-PreLayerNorm, XLM-RoBERTa-XL and Megatron-BERT,
normalize their input first: the layer's input is the normalized states, and `replace_attention` applies that
LayerNorm before it; Bloom's adds the residual after `dense`: the layer's output is the output of that dense
projection).

Legend: B batch size, T query length, S key length, E hidden size, N query heads,
K key/value heads, H head dimension.

The module does not hold its masks: `transformers` builds them in the model and passes them in.
These call arguments reproduce them (`attention_mask` is the model's (B, S) 0/1 padding mask,
`position_ids` the (B, T) positions the model was called with):

- Llama, Mistral, Mixtral, Qwen2 (and MoE), Qwen3 (and MoE), Gemma, Gemma 2, Gemma 3, OLMo, OLMo2,
  gpt-oss, Phi, Phi3, GPT-NeoX, GPT-J, Starcoder2, Granite, Cohere, Cohere2, StableLM, SmolLM3,
  GLM4, Falcon, Llama 4, Qwen2-VL, Qwen2.5-VL, the gated Qwen3-Next, Qwen3.5 (and MoE), AFMoE and
  LFM3, and the MLA families (DeepSeek-V2, DeepSeek-V3, GLM-4-MoE-Lite, Youtu, AXK1, Mistral 4,
  MiniCPM3, Kimi Linear, Ling's bailing_hybrid, LongCat-Flash): `causal=True,
  key_mask=attention_mask.bool(), positions=position_ids`; a NoPE layer (no `rope_theta` in its
  kwargs: SmolLM3's `no_rope_layers`, Cohere2's full layers, Llama 4's NoPE layers, AFMoE's full
  layers, Kimi Linear's MLA layers) takes no `positions`.
  Qwen2-VL's and Qwen2.5-VL's multimodal RoPE (`rope_sections`) takes the (3, B, T) positions its
  rotary embedding reads, one row per section (`generate` passes (4, B, T): the text positions,
  then these three; for text alone the three rows are the text positions); `replace_attention` hands
  them to the swapped layers from a forward pre-hook on the model's `rotary_emb`. The same kind
  recognised by structure ports likewise (Qwen2.5-Omni's thinker, GLM-4V-MoE, GLM-Image, PaddleOCR-VL; GLM-4V
  and GLM-OCR with `rope_interleaved`), and so does Qwen3-VL's, its pairs dealt to the rows in turn
  (`rope_sections_interleaved`: Qwen3-VL and its MoE, Qwen3-Omni's thinker, Cosmos 3 Edge).
- Gemma 3n and Gemma 4 (`interop.hf.shared`): as Llama, and a shared layer (`kv_shared`) also
  `shared_kv=` its store layer's `(k, v)` (that layer's call with `return_kv=True`) or, decoding, its cache.
- GPT-2, GPT-Neo, GPTBigCode, OPT, the BART and Whisper decoders' self-attention (and the BART kind's):
  `causal=True, key_mask=attention_mask.bool()`.
- BERT, RoBERTa, XLM-RoBERTa, the BART encoder: `key_mask=attention_mask.bool()`; ModernBERT
  adds `positions=position_ids`; the Whisper encoder attends every frame (no mask).
- T5 self-attention: `key_mask=attention_mask.bool(), attention_bias=t5_position_bias(module0, T, S)`
  (`module0`: the first layer's T5Attention of that stack); the decoder adds `causal=True`.
- Bloom and MPT: `causal=True, key_mask=attention_mask.bool(),
  attention_bias=alibi_bias(N, alibi_positions(attention_mask))` (`alibi_bias` from the layer's
  file; MPT's slopes are the same for its default `alibi_bias_max=8`, and its key positions differ
  from these by a constant per query, which the softmax does not see).
- Falcon's ALiBi models (`alibi=True`): the same, with the bias times the layer's `scale`
  (Falcon scales its bias with the scores): `attention_bias=alibi_bias(N,
  alibi_positions(attention_mask)) * kwargs["scale"]`.

The sliding window (Mistral, Mixtral, Starcoder2, Qwen2, Gemma 2 and 3, gpt-oss, Phi3, Cohere2,
GPT-Neo's local layers; ModernBERT's local layers, two-sided: |t - s| <= h = local_attention // 2
is `window=(h + 1, h + 1)`) is part of the layer (`window`), so no band mask is needed. With left
padding, `transformers` leaves the padded query rows attending nothing useful; this layer gives
them `output_bias` (no key left): compare real tokens only (and for ModernBERT's local layers, whose
padded queries far from the real tokens have no key either).

Llama 4's chunked layers port as `attention_chunk_size=C`: chunks of C slots counted from the
first slot. `transformers` counts a left-padded row's chunks from its first real token: the same
chunks where every row's left padding is a multiple of C (no padding, right padding, one prompt).
For other left-padded batches, build the layer without `attention_chunk_size` and pass
`attention_mask=(key_positions[:, None, :] // C) == (position_ids[:, :, None] // C)` (B, T, S),
`key_positions` the (B, S) positions of the keys (cumsum(attention_mask) - 1).

Gated attention (`gate=True`): Qwen3-Next's and Qwen3.5's `q_proj` yields, head by head, the query and
the gate, split into `query_kernel` and `gate_kernel`; AFMoE's `gate_proj` is `gate_kernel`; LFM3's
`g_proj`, one gate per head, is repeated over the head's H features. Their hybrid models' other
layers (Qwen3-Next's and Qwen3.5's linear attention, LFM3's convolutions) are refused by their
`layer_types` entry; LFM3's full-attention layers port with their proportional RoPE (pairs
(i, i + H/2), the last ones not turning: `rope_scaling={"rope_type": "proportional", ...}`).
Qwen3.5's interleaved multimodal RoPE is plain RoPE for text (its three rows of positions alike):
the port takes the (B, T) text positions. Refused with the reason: Step-3.7 (its per-layer config).

Decoding: `cache = layer.init_cache(B, L)`, then `layer(x, cache=cache, causal=True,
key_mask=<the new tokens' mask>, positions=<their position_ids>)`, one prefill and then one
token at a time, as `transformers` does with its `DynamicCache`; T5, Bloom, MPT and Falcon's ALiBi
models pass their bias
over the L cache slots (`t5_position_bias(module, T, L, past_length=index)`, ALiBi over the
positions of all L slots).

RoPE scaling: `default`, `linear`, `llama3`, `yarn` (gpt-oss' default) and `proportional` (Gemma 4's
and LFM3's full-attention layers) port with their parameters; other types (dynamic, LongRoPE) are a
`ValueError` for now. OLMo's, MPT's and DBRX's `clip_qkv` port as the layer's `clip_qkv`.
QK-norms: RMSNorms (Qwen3, Gemma 3, OLMo2, Llama 4) and
LayerNorms (`qk_norm_type="layer"`: Phi's one LayerNorm with a bias, StableLM's and Cohere's scale
per head) port as the layer's. Multi-head latent attention ports as the layer's MLA
(`kv_lora_rank`, ...; YaRN's `mscale_all_dim` correction in `scale`): DeepSeek-V2, V3 and the
families built on their attention (GLM-4-MoE-Lite, Youtu, AXK1, Mistral 4, MiniCPM3, Kimi Linear's
NoPE MLA layers, Ling's MLA layers with their per-head output gate as `gate`, LongCat-Flash's two
sublayers per decoder layer with their LoRA scales folded into the weights). The sparse indexer
(DSA) ports as MLA with `index_topk` (`sparse`): DeepSeek-V3.2, GLM-MoE-DSA and Mistral Large 4
(its learned query scaling and indexer query norm; its NoPE layers with a zero rotary part of two
features; its KV sharing refused), whose
"shared" layers take the previous full layer's selection as `topk_indices` (`layer(...,
return_topk=True)` gives it). Refused with the reason: Llama 4's NoPE layers' temperature tuning (and Mistral 4's
`llama_4_scaling_beta`), Llama 4's vision encoder attention (its 2-D RoPE over the image patches),
GPT-2 and GPTBigCode cross-attention, the linear-attention layers of Kimi Linear and Ling, and the
families built on the sparse indexer that add more (GLM-5-Next, HY-V4, AXK2, dots3, Qwen4-Exp,
DeepSeek-V4, MiniMax-M3: each with what it adds).

The package: one module per family of porters, each with its refusals (`llama`: the Llama kind and Llama 4's
text attention, its vision encoder refused; `gated`: the gated families; `latent`: multi-head latent
attention; `sparse`: the sparse indexer's families and refusals; `shared`: Gemma 3n and Gemma 4, whose last
layers share the keys and values of earlier ones (`kv_shared`: a shared layer's call takes them as
`shared_kv`, the store layer's `return_kv` pair or its cache when decoding; `replace_attention` passes them);
`gpt`: GPT-2, GPTBigCode, GPT-Neo, GPT-J and GPT-NeoX; `alibi`: Bloom, Falcon and MPT, and `alibi_positions`;
`bert`: BERT and ModernBERT; `seq2seq`: T5, BART, Whisper and OPT, and `t5_position_bias`), and the shared
pieces: `tensors` (reading tensors, `load_tensors`), `config` (what a config says), `registry` (the porters by
model type, `register_porter`, `supported_modules`), `routes` (`port_attention`, `port_checkpoint`), `replace`
(`replace_attention`), `structure` (the Llama-kind and gated modules of model types not listed, recognised by
their projections, norms and RoPE functions, and those refused by name), `kinds` (the BART, GPT-NeoX and BERT
kinds and LFM2's renamed Llama kind of model types not listed, recognised by their structure) and `census`
(`python -m interop.hf.census`: every attention class of the installed transformers with its status,
docs/census.md). It imports no framework at module level: `port_attention` reads a module's tensors through
its own `state_dict`, `port_checkpoint` and `load_tensors` read safetensors files with NumPy, and
`replace_attention` imports torch and the PyTorch layer when called.
"""

from .alibi import alibi_positions

# the registry's two tables, the same dicts (shared_tests/docs_facts.py and docs/modern.md read them here)
from .registry import _BUILTIN as _BUILTIN
from .registry import _REGISTERED as _REGISTERED
from .registry import register_porter, supported_modules
from .replace import replace_attention
from .routes import port_attention, port_checkpoint
from .seq2seq import t5_position_bias
from .tensors import load_tensors

__all__ = [
    "alibi_positions",
    "load_tensors",
    "port_attention",
    "port_checkpoint",
    "register_porter",
    "replace_attention",
    "supported_modules",
    "t5_position_bias",
]
