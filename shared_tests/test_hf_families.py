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

import copy
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
    "laguna",  # by structure: a softplus gate, one per head
    "mimo_v2_flash",  # by structure: value heads narrower than the key heads (widened with zeros), values scaled
    "biogpt",  # by structure: the BART kind, BART's forward
    "xglm",  # by structure: the BART kind, a forward of its own (scale folded into the queries)
    "camembert",  # by structure: the BERT kind, BERT's forwards
    "gpt_neox",  # the listed GPT kind, swapped by replace_attention
    "persimmon",  # by structure: the GPT-NeoX kind with per-head LayerNorms
    "kosmos2",  # by structure: the BART kind with a LayerNorm of the merged heads (`inner_attn_ln`: `output_norm`)
    "bitnet",  # by structure: the Llama kind with an RMSNorm of the merged heads (`attn_sub_norm`: `output_norm`)
    "xlm_roberta_xl",  # by structure: a pre-LN copy of BERT's attention (its LayerNorm of the input stays out)
    "megatron_bert",  # by structure: a pre-LN copy with forwards of its own text (Megatron-BERT's)
    "hunyuan_v1_dense",  # by structure: QK-norms named `query_layernorm`, applied after RoPE (`qk_norm_after_rope`)
    "rembert",  # by structure: the BERT kind, forwards of its own that compute BERT's (`_BERT_REWRITTEN`)
    "roformer",  # refused by class with what it adds (`_ADDS`): a rotary embedding inside the BERT kind
    "codegen",  # the listed GPT kind: GPT-J's attention, a fused projection of 4 shards
    "molmo2",  # a vision-language model's text decoder alone, under a linear head
    "cosmos3_edge",  # by structure: a text decoder turned by Qwen3-VL's multimodal RoPE (the pairs dealt in turn)
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


MROPE_FAMILIES = (  # one family per kind of multimodal RoPE that `replace_attention` ports
    "qwen2_vl",  # Qwen2-VL's contiguous sections over the whole head, listed
    "glm4v_moe",  # the same sections over a partial head (half the features turn), by structure
    "glm4v",  # the same sections, the features paired interleaved (cos and sin repeated pairwise), by structure
    "qwen3_vl",  # Qwen3-VL's: the pairs dealt to the rows in turn (`rope_sections_interleaved`), by structure
)


def _distinct_rows(mask):
    """(3, B, T) positions whose rows differ, as an image's tokens get: the text positions of the left-padded rows
    (`cumsum(mask) - 1`), then their height and width rows offset from them."""
    import torch

    text = (mask.cumsum(-1) - 1).clamp(min=0)  # (B, T)
    return torch.stack([text, text + 37 * (text % 3), 2 * text + 500 * (text % 2)])  # (B, T) -> (3, B, T)


@pytest.mark.parametrize("model_type", MROPE_FAMILIES)
def test_multimodal_rope_rows_reach_the_replaced_layers(model_type):
    """The text decoder called with (3, B, T) positions whose rows differ (which a text-only test cannot tell
    from one row): after `replace_attention` its logits on a left-padded batch, then those of one decoding step
    with the model's cache, are transformers' within `hf_tiny.LOGITS_TOL`."""
    from interop.hf import replace_attention

    model = hf_tiny.tiny_model(model_type)
    ours = copy.deepcopy(model)
    replace_attention(ours)
    ids, mask = hf_tiny.prompts()
    theirs, mine = (_prefill_step_full(run, ids, mask, _distinct_rows(mask)) for run in (model, ours))
    for reference, replaced in zip(theirs, mine, strict=True):
        difference = float((replaced - reference).abs().max())
        assert difference <= hf_tiny.LOGITS_TOL * max(1.0, float(reference.std())), difference


def _prefill_step_full(model, ids, mask, positions):
    """The logits of the real tokens of a full pass, and of the last token decoded after a prefill of the others
    with the model's cache, each called with its (3, B, T) `positions`."""
    import torch

    with torch.no_grad():
        prefill = model(input_ids=ids[:, :-1], attention_mask=mask[:, :-1], position_ids=positions[..., :-1])
        step = model(
            input_ids=ids[:, -1:],
            attention_mask=mask,
            position_ids=positions[..., -1:],
            past_key_values=prefill.past_key_values,
            use_cache=True,
        )
        full = model(input_ids=ids, attention_mask=mask, position_ids=positions)
    return full.logits[mask.bool()], step.logits[:, -1]  # (real tokens, vocabulary), (B, vocabulary)


def test_a_gate_of_another_function_than_sigmoid_or_softplus_is_refused():
    """The structural port reads the gate's function from the forward's source: Laguna's softplus is the layer's
    `gate_activation="softplus"`, a sigmoid the default, anything else a `ValueError` naming it."""
    import torch

    from interop.hf import structure

    class TanhGated(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.g_proj = torch.nn.Linear(4, 4)

        def forward(self, hidden_states):
            return torch.tanh(self.g_proj(hidden_states))

    laguna = hf_tiny.tiny_model("laguna").model.layers[0].self_attn
    assert structure._check_gate(laguna, "laguna", "g_proj") == "softplus"
    with pytest.raises(ValueError, match=r"gates its heads with torch\.tanh of `g_proj`, where the layer's gate is a"):
        structure._check_gate(TanhGated(), "tanh_gated", "g_proj")


def test_value_heads_wider_than_the_key_heads_are_refused():
    """Narrower value heads port widened with zeros (MiMo-V2-Flash, in `SAMPLE`); wider ones would need the keys
    widened, which changes their QK-norm and RoPE, and are refused with the widths."""
    import torch

    from interop.hf import structure

    class WideValues(torch.nn.Module):
        head_dim = 4

        def __init__(self):
            super().__init__()
            self.q_proj, self.k_proj = torch.nn.Linear(8, 8), torch.nn.Linear(8, 4)
            self.v_proj, self.o_proj = torch.nn.Linear(8, 6), torch.nn.Linear(12, 8)

    module = WideValues()
    with pytest.raises(
        ValueError, match=r"has value heads wider than its key heads.*`v_proj` 6, `k_proj` 4, `o_proj` 12"
    ):
        structure._value_head_dim(module, "wide_values", dict(module.named_children()))


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


PORTER_MODULE_LINES_MAX = 500  # the longest a module of the `interop.hf` package may be


def test_no_porter_module_is_longer_than_500_lines():
    """Each module of `interop/hf` (the porters, the census, `replace_attention`) reads in one sitting."""
    from pathlib import Path

    package = Path(census.__file__).parent
    lengths = {path.name: len(path.read_text().splitlines()) for path in package.glob("*.py")}
    assert max(lengths.values()) <= PORTER_MODULE_LINES_MAX, lengths
