"""The generated proof of the census (docs/census.md, `python -m interop.hf.census`): every model type with a
`*ForCausalLM` class, or a text decoder of its own (a vision-language model's `*TextModel`, under a linear head),
is built as a tiny random model shrunk from its default configuration
(`shared_tests/hf_tiny.py`) and gets the verdict the census prints: `ported` keeps its logits within 1e-4 on
a left-padded batch and its greedy tokens (where the reference's top logit leads by a margin) after
`replace_attention`; `refused` raises the `ValueError` whose message the census prints; `not built` fails to
build or run, and is not counted.

`make test` runs a spread of the families (`SAMPLE`: listed porters and structurally recognised ones, gated,
sinks, NoPE layers, interleaved RoPE, refusals); `HF_FAMILIES=all` runs every family of the census, and checks
that the committed census is what `interop.hf.census` computes now (the long mode: docs/testing.md).
"""

import os
import warnings

import pytest

from interop.hf import census
from shared_tests import hf_tiny

LONG = os.environ.get("HF_FAMILIES") == "all"
SAMPLE = {  # a spread over the porters: listed families, and each kind of structural recognition
    "llama",  # the listed Llama kind
    "qwen3",  # listed, QK-norm
    "helium",  # by structure: interleaved RoPE read from its functions' text
    "exaone4",  # by structure: QK-norm, NoPE full layers (RoPE under a condition on the module's attributes)
    "flint",  # by structure: sinks
    "jamba",  # by structure: no RoPE, a hybrid with Mamba layers
    "afmoe",  # listed gated
    "diffllama",  # refused with what it adds (its lambdas and group norm)
    "laguna",  # refused: a softplus gate
    "biogpt",  # by structure: the BART kind, BART's forward
    "xglm",  # by structure: the BART kind, a forward of its own (scale folded into the queries)
    "camembert",  # by structure: the BERT kind, BERT's forwards
    "gpt_neox",  # the listed GPT kind, swapped by replace_attention
    "persimmon",  # by structure: the GPT-NeoX kind with per-head LayerNorms
    "kosmos2",  # refused: a LayerNorm inside the attention (`inner_attn_ln`)
    "rembert",  # by structure: the BERT kind, forwards of its own that compute BERT's (`_BERT_REWRITTEN`)
    "roformer",  # refused by class with what it adds (`_ADDS`): a rotary embedding inside the BERT kind
    "codegen",  # the listed GPT kind: GPT-J's attention, a fused projection of 4 shards
    "molmo2",  # a vision-language model's text decoder alone, under a linear head
    "cosmos3_edge",  # refused: a text decoder turned by a multimodal RoPE (`mrope_section`)
}
CLASSES, FAMILIES = census.read_table()
VERDICTS = {model_type: (verdict, detail) for model_type, _, verdict, detail in FAMILIES}


def _selected(verdict):
    """The model types of that verdict this run checks: every one in the long mode, the `SAMPLE` ones else."""
    return sorted(t for t, (v, _) in VERDICTS.items() if v == verdict and (LONG or t in SAMPLE))


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


@pytest.mark.parametrize("model_type", _selected("ported"))
def test_tiny_model_keeps_logits_and_tokens(model_type):
    """The replaced model's logits within 1e-4 on a left-padded batch, its greedy tokens while the reference's
    top logit leads by a margin (`hf_tiny.check_replaced`)."""
    result = hf_tiny.check_replaced(hf_tiny.tiny_model(model_type))
    assert result["replaced"]


@pytest.mark.parametrize("model_type", _selected("refused"))
def test_refused_family_raises_the_census_reason(model_type):
    model = hf_tiny.tiny_model(model_type)
    with pytest.raises(ValueError) as error:
        hf_tiny.check_replaced(model)
    assert census._reason(error.value).replace("|", "/") == VERDICTS[model_type][1]


def test_bart_kind_cross_attention_stays_and_refuses_a_cross_call():
    """`replace_attention` swaps a BART-kind decoder's self-attention and leaves its cross-attention (`encoder_attn`,
    the same class) as it is; a swapped module called with encoder states is a `ValueError`, never self-attention."""
    import torch

    from interop.hf import replace_attention

    model = hf_tiny.tiny_model("biogpt")
    replaced = replace_attention(model)
    assert replaced == [f"biogpt.layers.{i}.self_attn" for i in range(len(model.biogpt.layers))]
    decoder = hf_tiny.tiny_model("marian")
    replace_attention(decoder)
    layer = decoder.model.decoder.layers[0]
    assert type(layer.encoder_attn).__name__ == "MarianAttention"
    states = torch.zeros(1, 2, hf_tiny.HIDDEN)
    with pytest.raises(ValueError, match=r"`key_value_states` must be None: the replaced module computes self-"):
        layer.self_attn(states, key_value_states=states)


def test_bart_kind_with_prompts_is_refused():
    """MVP ports as the BART kind, but not with `use_prompt`: its decoder prepends learned keys and values."""
    from interop.hf import replace_attention

    cls = hf_tiny.causal_lm_class("mvp")
    model = cls(hf_tiny.shrink(cls.config_class(use_prompt=True, prompt_length=2, prompt_mid_dim=8)))
    with pytest.raises(ValueError, match=r"MvpAttention .* prepends learned prompt keys and values \(`use_prompt`\)"):
        replace_attention(model)


def test_every_ported_class_names_its_proof():
    """A class counts as ported only with its family's passing test named: the generated one (its model type
    ported here) or test_hf.py's for a listed family with no causal language model."""
    for model_type, name, status, detail in CLASSES:
        if status == "ported" and "test_hf_families" in detail:
            assert detail.endswith(census.TEST.format(model_type)), (model_type, name)
            assert VERDICTS[model_type][0] == "ported", (model_type, name)
        elif status == "ported":
            assert detail.endswith(census.LISTED_TEST), (model_type, name)


if LONG:  # the long mode only (HF_FAMILIES=all): the census takes minutes

    def test_census_is_current():
        """docs/census.md is what `python -m interop.hf.census --write` writes with the installed transformers."""
        rows, families = census.census()
        assert census.markdown(rows, families) == census.TABLE.read_text()


def test_ministral3_scales_its_queries_by_position_past_the_floor():
    """Ministral 3's default configuration (`llama_4_scaling_beta` 0.1) with `original_max_position_embeddings` 2,
    so the prompts pass the floor below which the scale is 1: the replaced model keeps its logits and tokens."""
    import torch

    cls = hf_tiny.causal_lm_class("ministral3")
    config = hf_tiny.shrink(cls.config_class())
    config.rope_parameters["original_max_position_embeddings"] = 2
    torch.manual_seed(hf_tiny.SEED)
    result = hf_tiny.check_replaced(cls(config).float().eval())
    assert result["replaced"] and result["tokens"] > 0


DBRX_TIGHT_CLIP = 0.05  # below the tiny model's q, k and v magnitudes: the clamp binds


def _tiny_from_config(model_type, **overrides):
    """The family's tiny model from its default configuration with `overrides`, shrunk, seeded and perturbed."""
    import torch

    cls = hf_tiny.causal_lm_class(model_type)
    config = hf_tiny.shrink(cls.config_class(**overrides))
    torch.manual_seed(hf_tiny.SEED)
    return hf_tiny.perturbed(cls(config).float().eval())


def test_dbrx_clamps_queries_keys_and_values_by_clip_qkv():
    """DBRX's fused `Wqkv` clamped to [-clip_qkv, clip_qkv] (a clip that binds: the logits move with it) ports as the
    layer's `clip_qkv`: the replaced model keeps its logits and tokens."""
    import torch

    ids, mask = hf_tiny.prompts()
    models = {clip: _tiny_from_config("dbrx", attn_config={"clip_qkv": clip}) for clip in (8.0, DBRX_TIGHT_CLIP)}
    with torch.no_grad():
        loose, tight = (models[c](input_ids=ids, attention_mask=mask).logits for c in (8.0, DBRX_TIGHT_CLIP))
    assert not torch.allclose(loose, tight, atol=hf_tiny.LOGITS_TOL)
    result = hf_tiny.check_replaced(models[DBRX_TIGHT_CLIP])
    assert result["replaced"] and result["tokens"] > 0


def test_olmo_hybrid_without_a_rope_theta_applies_no_rope():
    """OLMo-Hybrid's released configurations hold `rope_theta` None: its model builds no rotary embedding and its
    attention layers turn nothing, which the port reads from the config: the replaced model keeps its logits and
    tokens (the default configuration's theta, RoPE on its full-attention layers, is the generated test's)."""
    model = _tiny_from_config("olmo_hybrid", rope_parameters={"rope_type": "default", "rope_theta": None})
    assert model.model.rotary_emb is None
    result = hf_tiny.check_replaced(model)
    assert result["replaced"] and result["tokens"] > 0
