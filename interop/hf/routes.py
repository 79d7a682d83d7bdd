"""The two routes to `(layer_kwargs, weights)`: `port_attention` from a loaded module (its porter found by its
class) and `port_checkpoint` from a config and a checkpoint's tensors (its porter found by the config's model
type), with the refusals of what no porter computes."""

from .config import _load_config
from .gated import _GATED_REFUSED, _refuse_layer_type
from .kinds import _kind_porter
from .llama import _REFUSED_CLASSES
from .registry import _builtin, _path, _porter, _registered, supported_modules
from .sparse import _LEARNED_FREQUENCIES, _SPARSE_REFUSED, _refuse_learned_frequencies
from .structure import _structural_porter
from .tensors import _Prefixed, load_tensors


def _transformers_model_type(cls):
    """The model type of a `transformers.models.<type>.modeling_<type>` class, else None."""
    parts = cls.__module__.split(".")
    return parts[2] if len(parts) > 3 and parts[:2] == ["transformers", "models"] else None


def _module_porter(module):
    """The porter of a module: registered for a class along its hierarchy, else of its transformers model type,
    refusing a subclass that overrides `forward` and projections that are not torch or transformers modules."""
    for cls in type(module).__mro__:
        if _registered(cls.__name__) is not None:
            return _registered(cls.__name__)
        model_type = _transformers_model_type(cls)
        if model_type is not None:
            break
        if cls.__module__.split(".")[0] in ("torch", "builtins"):
            _refuse_unknown(module)
        if "forward" in vars(cls):
            raise ValueError(
                f"`module` must compute what its transformers class computes: {cls.__name__} overrides `forward`. "
                "Register a porter for it with `register_porter`. Received: " + type(module).__name__
            )
    else:
        _refuse_unknown(module)
    _check_submodules(module)
    porter = _porter(model_type)
    if porter is None:
        _refuse_variant(model_type, "module")
        porter = _structural_porter(module, model_type) or _kind_porter(module, model_type)
    if porter is None:
        _refuse_unknown(module, f" of model type {model_type!r}")
    return porter


def _refuse_variant(model_type, argument):
    """Refuses a model type whose attention holds more than the layer computes, naming what it holds."""
    if model_type in _SPARSE_REFUSED:
        reason = f"{_SPARSE_REFUSED[model_type]}, which the layer cannot"
    elif model_type in _GATED_REFUSED:
        reason = _GATED_REFUSED[model_type]
    else:
        return
    raise ValueError(
        f"`{argument}` must hold an attention the layer computes: {reason}. Received: model_type={model_type!r}"
    )


def _refuse_class(module, porter):
    """Refuses an attention class of a ported model type that its family's porter does not read (Llama 4's vision
    encoder), naming what it is, unless a porter is registered for it or its model type."""
    for cls in type(module).__mro__:
        if cls.__name__ in _REFUSED_CLASSES and porter is _builtin(_transformers_model_type(cls)):
            raise ValueError(
                f"`module` must hold an attention the layer computes: {cls.__name__} is "
                f"{_REFUSED_CLASSES[cls.__name__]}. Received: {type(module).__name__}"
            )


def _refuse_unknown(module, detail=""):
    raise ValueError(
        "`module` must be a transformers attention module of one of the model types "
        f"{', '.join(supported_modules())}, or of a class given to `register_porter`. "
        f"Received: {type(module).__name__}{detail}"
    )


def _check_submodules(module):
    """Refuses an instance whose `forward` was replaced, or a projection whose `forward` comes from a class
    outside torch and transformers (a subclass that overrides nothing computes what its base class does;
    the module's own class is checked along its hierarchy by `_module_porter`)."""
    for name, submodule in module.named_modules():
        if "forward" in vars(submodule):
            raise ValueError(f"`module` must use its class's forward: `{name or 'module'}.forward` was replaced.")
        owner = next(cls for cls in type(submodule).__mro__ if "forward" in vars(cls))
        if name and owner.__module__.split(".")[0] not in ("torch", "transformers"):
            raise ValueError(
                f"`module`'s projections must be torch or transformers modules (LoRA, quantized or custom layers "
                f"compute otherwise): register a porter with `register_porter`. Received: `{name}` is "
                f"{type(submodule).__name__} from {type(submodule).__module__}, with the forward of "
                f"{owner.__name__} from {owner.__module__}"
            )


def _layer_index(module):
    """The layer index a module (or its first submodule that knows it) was built with, else None."""
    for submodule in module.modules():
        for attribute in ("layer_idx", "layer_id"):
            if isinstance(getattr(submodule, attribute, None), int):
                return getattr(submodule, attribute)
    return None


def port_attention(module, config):
    """Reads a `transformers` attention module into this project's layer.

    Args:
        module: the attention module of one layer (`model.model.layers[i].self_attn`, BERT's
            `encoder.layer[i].attention`, T5's `block[i].layer[0].SelfAttention`, ...) of a model
            type in `supported_modules()`, or of a class registered with `register_porter`.
        config: the model's config (`model.config`; of a multimodal model, its text config is read),
            or a dict of it.

    Returns:
        `(layer_kwargs, weights)`: `MultiHeadAttention(**layer_kwargs)` followed by
        `import_weights(weights)` computes what the module computes, given the call arguments in
        the `interop.hf` docstring. `weights` holds float32 NumPy arrays in the portable layout.

    Raises:
        ValueError: for a module this converter does not know, a subclass that overrides `forward`
            or its projections, or a variant the layer cannot hold (RoPE scaling other than
            linear, llama3, yarn and proportional, GPT-2 cross-attention).
    """
    porter = _module_porter(module)
    _refuse_class(module, porter)
    tensors = {name: tensor.detach().cpu().float().numpy() for name, tensor in module.state_dict().items()}
    return porter(_load_config(config), tensors, _layer_index(module))


def port_checkpoint(config, tensors, layer_index, *, prefix=None):
    """Reads one layer's attention from a checkpoint, with NumPy only (no torch, no transformers).

    Args:
        config: the model's `config.json` (a path, its directory, or the dict it holds).
        tensors: the model's weights: a `.safetensors` file (or its directory), a sharded
            checkpoint's `model.safetensors.index.json`, or a dict of names to arrays.
        layer_index: the layer (0-based).
        prefix: the attention module's path in `tensors` (e.g. "decoder.block.0.layer.0.SelfAttention"
            for T5's decoder); by default the family's path for `layer_index` (`layers.{i}.self_attn`,
            `encoder.layer.{i}.attention`, ...) under whatever the checkpoint puts before it.

    Returns:
        `(layer_kwargs, weights)`, as `port_attention` returns them for that layer's module.

    Raises:
        ValueError: for a model type this converter does not know, a layer not in `tensors`, or what
            `port_attention` refuses.
    """
    config = _load_config(config)
    model_type = config.get("model_type")
    porter = _porter(model_type)
    if porter is None:
        _refuse_variant(model_type, "config")
        raise ValueError(
            f"`config` must be of one of the model types {', '.join(supported_modules())}. "
            f"Received: model_type={model_type!r}"
        )
    _refuse_layer_type(config, layer_index)  # before looking for an attention module it does not have
    tensors = load_tensors(tensors)
    _refuse_learned_frequencies("tensors", ((n, tensors[n]) for n in tensors if n.endswith(_LEARNED_FREQUENCIES)))
    if prefix is None:
        prefix = _find_prefix(tensors, _path(model_type, layer_index))
    return porter(config, _Prefixed(tensors, prefix.rstrip(".") + "."), layer_index)


def _find_prefix(tensors, path):
    """The one prefix in `tensors` that ends with `path` ("model.layers.3.self_attn" for "layers.3.self_attn")."""
    marker, found = "." + path + ".", set()
    for name in tensors:
        dotted = "." + name
        if marker in dotted:
            found.add(dotted[1 : dotted.index(marker) + len(marker) - 1])
    if len(found) != 1:
        raise ValueError(
            f"`tensors` must hold one attention module at `{path}` (pass `prefix=` to choose). "
            f"Received: {len(found)} ({', '.join(sorted(found)) or 'none'})"
        )
    return found.pop()
