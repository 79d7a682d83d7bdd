"""Gemma 3n and Gemma 4 (`interop/hf/shared.py`): tiny random models whose last layers share the keys and
values of earlier ones. Each attention module ported equals transformers' (NumPy, PyTorch, TensorFlow) in a
padded full pass, the shared layers given the keys and values their store layer returned, and decoding
left-padded prompts, the shared layers given their store layer's cache; `replace_attention` keeps the logits of
a left-padded batch and greedy `generate`'s tokens.

Legend: B batch, T tokens, E hidden size.
"""

import functools
import importlib

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from interop.hf import port_attention, port_checkpoint  # noqa: E402
from interop.hf.shared import shared_source, sharing_mode  # noqa: E402
from shared_tests import hf_tiny  # noqa: E402

MODULE_TOL = 1e-5  # float32 module outputs against transformers'
MIN_TOKENS = 3  # greedy steps compared before the reference's first near tie (gemma3n: 3, the Gemma 4 pair: 6)
LAYER_TYPES = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]
COMMON = dict(
    vocab_size=128, vocab_size_per_layer_input=128, hidden_size=64, hidden_size_per_layer_input=8,
    intermediate_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    layer_types=LAYER_TYPES, sliding_window=3, num_kv_shared_layers=2,
)  # fmt: skip
ROPE = {  # Gemma 4's own RoPE ("proportional" on the full layers), at a base of 100 there so its unturned pairs count
    "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
    "full_attention": {"rope_type": "proportional", "rope_theta": 100.0, "partial_rotary_factor": 0.25},
}
FAMILIES = {
    "gemma3n": ("Gemma3nTextConfig", "Gemma3nForCausalLM", dict(laurel_rank=4, activation_sparsity_pattern=[0.0] * 4)),
    "gemma4": (  # full layers: keys as values, their own head size and one key/value head
        "Gemma4TextConfig",
        "Gemma4ForCausalLM",
        dict(global_head_dim=32, num_global_key_value_heads=1, attention_k_eq_v=True, rope_parameters=ROPE),
    ),
    "gemma4_unified": (  # the same attention as Gemma 4's
        "Gemma4UnifiedTextConfig",
        "Gemma4UnifiedForCausalLM",
        dict(global_head_dim=32, num_global_key_value_heads=1, attention_k_eq_v=True, rope_parameters=ROPE),
    ),
}
MODEL_TYPES = {name for family in FAMILIES for name in (family, f"{family}_text")}  # the ports tested here
FRAMEWORKS = ("NumPy", "PyTorch", "TensorFlow")


@functools.cache
def _model(family):
    """The family's tiny model, built once (Gemma 3n's takes seconds); `check_replaced` swaps a copy."""
    config_name, model_name, options = FAMILIES[family]
    config = getattr(transformers, config_name)(**COMMON, **options)
    torch.manual_seed(hf_tiny.SEED)
    return hf_tiny.perturbed(getattr(transformers, model_name)(config).float().eval())


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_replaced_model_keeps_logits_and_greedy_tokens(family):
    compared = hf_tiny.check_replaced(_model(family))
    assert compared["tokens"] >= MIN_TOKENS and len(compared["replaced"]) == len(LAYER_TYPES)


def _captured_full_pass(model):
    """{layer index: (hidden_states (B, T, E), position_ids (B, T), output (B, T, E))} of a padded full pass."""
    captured, handles = {}, []
    for index, layer in enumerate(model.model.layers):

        def hook(module, args, kwargs, output, index=index):
            hidden = kwargs["hidden_states"]
            captured[index] = (
                hidden,
                kwargs["position_ids"].expand(hidden.shape[0], -1),
                output[0],
            )  # (1, T) -> (B, T)

        handles.append(layer.self_attn.register_forward_hook(hook, with_kwargs=True))
    ids, mask = hf_tiny.prompts()
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask, use_cache=False)
    for handle in handles:
        handle.remove()
    return captured, mask


class _Framework:
    def __init__(self, name):
        self.name, self.module = name, importlib.import_module(f"{name}.Multi_Head_Attention")

    def layer(self, kwargs, weights):
        layer = self.module.MultiHeadAttention(**kwargs)
        layer.import_weights(weights)
        return layer

    def tensor(self, a):
        if self.name == "PyTorch":
            return torch.as_tensor(a)
        return importlib.import_module("tensorflow").constant(a) if self.name == "TensorFlow" else a

    def numpy(self, a):
        return a.detach().numpy() if self.name == "PyTorch" else np.asarray(a)


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def full_pass(request):
    """(family, model, its padded full pass' captures and mask, its decoding's captures and masks)."""
    model = _model(request.param)
    captured, mask = _captured_full_pass(model)
    return request.param, model, captured, mask, _captured_decoding(model)


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_each_module_matches_transformers_in_a_padded_full_pass(framework, full_pass):
    family, model, captured, mask, _ = full_pass
    config, runner, shared = model.config.to_dict(), _Framework(framework), {}
    rows = mask.bool().numpy()
    for index, module in enumerate(model.model.layers):
        hidden, positions = (runner.tensor(t.numpy()) for t in captured[index][:2])
        expected = captured[index][2]
        layer = runner.layer(*port_attention(module.self_attn, model.config))
        call = {"causal": True, "key_mask": runner.tensor(mask.bool().numpy()), "positions": positions}
        if sharing_mode(config, index) == "reuse":
            output = layer(hidden, **call, shared_kv=shared[shared_source(config, index)])
        else:
            output, shared[index] = layer(hidden, **call, return_kv=True)
        difference = np.abs(runner.numpy(output)[rows] - expected.numpy()[rows]).max()
        assert difference <= MODULE_TOL, f"{family} layer {index}: {difference:.3g}"


STEPS = 2  # decoding: the prompt, then this many tokens one at a time


def _captured_decoding(model):
    """Per layer, [(hidden_states, position_ids, output)] of each call: the left-padded prompts, then `STEPS`
    greedy tokens one at a time, with transformers' cache; and the (B, T) masks of each call's tokens."""
    captured, handles = {i: [] for i in range(len(model.model.layers))}, []
    for index, layer in enumerate(model.model.layers):

        def hook(module, args, kwargs, output, index=index):
            captured[index].append((kwargs["hidden_states"], kwargs["position_ids"], output[0]))

        handles.append(layer.self_attn.register_forward_hook(hook, with_kwargs=True))
    ids, mask = hf_tiny.prompts()
    cache, masks, total = transformers.DynamicCache(config=model.config), [mask], mask
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=cache).logits
        for _ in range(STEPS):
            positions, total = positions[:, -1:] + 1, torch.cat([total, torch.ones_like(mask[:, :1])], 1)
            step = logits[:, -1:].argmax(-1)
            logits = model(input_ids=step, attention_mask=total, position_ids=positions, past_key_values=cache).logits
            masks.append(torch.ones_like(step))
    for handle in handles:
        handle.remove()
    return captured, masks


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_each_module_matches_transformers_decoding_left_padded_prompts(framework, full_pass):
    """The store layers decode with their cache, the shared layers read it (`shared_kv=cache`)."""
    family, model, _, _, (captured, masks) = full_pass
    config, runner = model.config.to_dict(), _Framework(framework)
    layers = [runner.layer(*port_attention(layer.self_attn, model.config)) for layer in model.model.layers]
    caches = {i: layer.init_cache(masks[0].shape[0], 16) for i, layer in enumerate(layers) if not layer.kv_shared}
    for call, mask in enumerate(masks):
        rows = mask.bool().numpy()
        for index, layer in enumerate(layers):
            hidden, positions, expected = captured[index][call]
            arguments = {"causal": True, "positions": runner.tensor(positions.expand(hidden.shape[0], -1).numpy())}
            if layer.kv_shared:
                output = layer(
                    runner.tensor(hidden.numpy()), **arguments, shared_kv=caches[shared_source(config, index)]
                )
            else:
                step_mask = runner.tensor(rows)
                output, caches[index] = layer(
                    runner.tensor(hidden.numpy()), **arguments, key_mask=step_mask, cache=caches[index]
                )
            difference = np.abs(runner.numpy(output)[rows] - expected.numpy()[rows]).max()
            assert difference <= MODULE_TOL, f"{family} layer {index}, call {call}: {difference:.3g}"


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_ports_say_which_layers_share(family):
    model = _model(family)
    config = model.config.to_dict()
    kwargs = [port_attention(layer.self_attn, model.config)[0] for layer in model.model.layers]
    assert [k.get("kv_shared", False) for k in kwargs] == [False, False, True, True]
    gemma4 = family.startswith("gemma4")
    assert [k.get("keys_as_values", False) for k in kwargs] == [False, gemma4, False, False]
    assert [k.get("value_norm", False) for k in kwargs] == [True, True, False, False]
    assert [shared_source(config, i) for i in (2, 3)] == [0, 1]
    assert kwargs[1]["head_dim"] == (32 if gemma4 else 16)
    tensors = {name: t.numpy() for name, t in model.state_dict().items()}
    for index, layer in enumerate(model.model.layers):
        layer_kwargs, weights = port_attention(layer.self_attn, model.config)
        checkpoint_kwargs, checkpoint_weights = port_checkpoint(config, tensors, index)
        assert checkpoint_kwargs == layer_kwargs and sorted(checkpoint_weights) == sorted(weights)


def test_gemma4_full_layers_port_their_proportional_rope():
    """Gemma 4's default configuration: its full layers' RoPE ports as the layer's "proportional" scaling (no
    `rope_fraction`: the pairs stay (i, i + H/2) over the whole head)."""
    config_name, model_name, options = FAMILIES["gemma4"]
    options = {name: value for name, value in options.items() if name != "rope_parameters"}  # Gemma 4's default
    model = getattr(transformers, model_name)(getattr(transformers, config_name)(**COMMON, **options))
    kwargs = [port_attention(model.model.layers[i].self_attn, model.config)[0] for i in (0, 1)]
    assert "rope_scaling" not in kwargs[0] and kwargs[0]["rope_theta"] == 10000.0
    assert kwargs[1]["rope_scaling"] == {"rope_type": "proportional", "partial_rotary_factor": 0.25}
    assert kwargs[1]["rope_theta"] == 1000000.0 and "rope_fraction" not in kwargs[1]
