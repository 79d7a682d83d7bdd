"""The census: every attention class of the installed `transformers`, with one status each.

    .venv/bin/python -m interop.hf.census            # prints the table (minutes: it builds every family)
    .venv/bin/python -m interop.hf.census --write    # and writes it to docs/census.md
    .venv/bin/python -m interop.hf.census --write llama4 mistral4   # replaces those model types' rows only

An attention class is a `torch.nn.Module` defined in a `transformers.models.<type>.modeling_*` module whose name
ends in `Attention` or `MLA`. Each gets one status:

- `ported`: `port_attention` reads it (the porter's module is named) and its model type passed the generated
  test of `shared_tests/test_hf_families.py` (a tiny random model of the family, `replace_attention`, the same
  logits and greedy tokens), whose id is printed; the model types without a `*ForCausalLM` class that
  `interop.hf` lists (BERT, T5, ...) are checked by `shared_tests/test_hf.py`, named likewise;
  a model type without a `*ForCausalLM` class that defines a text decoder of its own (the `*TextModel` of a
  vision-language model, `hf_tiny.text_decoder_families()`) is in scope through it: its tiny model is that text
  decoder alone under a linear head, given the same generated test; its classes outside the text decoder
  (vision, audio, projectors) are out of scope;
- `refused`: `port_attention` or `replace_attention` raises a `ValueError`; its message is the reason;
- `out of scope`: not a decoder's self-attention, with its kind: vision, audio, cross-attention, or a model
  type with no causal language model that `interop.hf` does not list;
- `not built`: the family's model could not be built (its default configuration on the meta device, or its
  tiny model), or the class is not in the model its default configuration builds; with why.

How: each family's default configuration builds its `*ForCausalLM` (else its base model) on the meta device
(`torch.device("meta")`, no memory for the weights; fewer layers and experts, each kind of layer
kept: the attention's sizes are the default's); the first instance of each attention class is given to
the porter `port_attention` would use, with zero-strided arrays of its tensors' shapes for tensors (the
porters read shapes and names; no number is computed). Then the generated test's check runs on the family's
tiny model (`shared_tests.hf_tiny`), which decides `ported`. torch and transformers are needed.
"""

import argparse
import contextlib
import importlib
import inspect
import io
import pkgutil
import re
import sys
import warnings
from pathlib import Path

import numpy as np

from .config import _load_config
from .registry import _BUILTIN
from .routes import _layer_index, _module_porter, _refuse_class

ROOT = Path(__file__).resolve().parents[2]
TABLE = ROOT / "docs" / "census.md"
TEST = "shared_tests/test_hf_families.py::test_tiny_model_keeps_logits_and_tokens[{}]"
LISTED_TEST = "shared_tests/test_hf.py::test_full_pass_with_padding_matches_transformers"
_KINDS = (  # a class name's words: its kind, where it is not a decoder's self-attention
    (r"Cross", "cross-attention"),
    (r"Vision|Visual|Image|Patch|Pixel|Vit|ViT|Video|Window|Swin|Mask|Deformable|Detr|Conv", "vision"),
    (r"Audio|Speech|Conformer|Wav|Mel|Codec|Acoustic", "audio"),
)
_NOT_SWAPPED = "`model` must hold attention modules of the Llama kind"  # replace_attention's refusal
_STATUSES = ("ported", "refused", "out of scope", "not built")


def attention_classes():
    """[(model type, class name, class)] of every attention class, in package and definition order."""
    import torch
    import transformers.models

    found = []
    for package in pkgutil.iter_modules(transformers.models.__path__):
        for module in _modeling_modules(package.name):
            for name, value in vars(module).items():
                if (
                    inspect.isclass(value)
                    and value.__module__ == module.__name__
                    and issubclass(value, torch.nn.Module)
                    and name.endswith(("Attention", "MLA"))
                ):
                    found.append((package.name, name, value))
    return found


def _modeling_modules(package):
    import transformers.models

    path = [f"{transformers.models.__path__[0]}/{package}"]
    modules = []
    for info in pkgutil.iter_modules(path):
        if info.name.startswith("modeling_") and not info.name.startswith(("modeling_tf_", "modeling_flax_")):
            with contextlib.suppress(Exception):  # a modeling module that needs a package not installed
                modules.append(importlib.import_module(f"transformers.models.{package}.{info.name}"))
    return modules


def _kind(class_name):
    for pattern, kind in _KINDS:
        if re.search(pattern, class_name):
            return kind
    return None


def _model_class(model_type):
    """The family's `*ForCausalLM` class, else its base model class (for a listed model type), else None."""
    from shared_tests import hf_tiny

    if _in_scope(model_type):
        return hf_tiny.model_class(model_type)
    if model_type not in _BUILTIN:
        return None
    for module in _modeling_modules(model_type):
        for name, value in vars(module).items():
            if (
                inspect.isclass(value)
                and name.endswith("Model")
                and not name.endswith("PreTrainedModel")
                and getattr(value, "config_class", None) is not None
                and value.__module__ == module.__name__
            ):
                return value
    return None


def _in_scope(model_type):
    """Whether the model type has a `*ForCausalLM` class or a text decoder of its own: the generated test's."""
    from shared_tests import hf_tiny

    return model_type in hf_tiny.causal_lm_families() or model_type in hf_tiny.text_decoder_families()


def _meta_ports(cls):
    """{attention class name: ("ported", porter module) or ("refused", reason)} of the first instance of each
    attention class in the model `cls` builds from its default configuration on the meta device."""
    import torch

    config = cls.config_class()
    _fewer_layers(config)
    with torch.device("meta"):
        model = cls(config)
    return _ports_of(model)


def _ports_of(model):
    """{attention class name: ("ported", porter module), ("refused", reason), ...} of the first instance of
    each attention class in `model` (on the meta device, or a tiny model's)."""
    results, ported = {}, {}
    for path, module in model.named_modules():
        name = type(module).__name__
        if name in results or not name.endswith(("Attention", "MLA")):
            continue
        whole = next((c for p, c in ported.items() if path.startswith(p + ".")), None)
        if whole is not None:
            results[name] = ("out of scope", f"a part of {whole}, which ports whole")
            continue
        config = getattr(module, "config", None) or model.config
        try:
            porter = _module_porter(module)
            _refuse_class(module, porter)
            tensors = {n: np.broadcast_to(np.float32(0), tuple(t.shape)) for n, t in module.state_dict().items()}
            porter(_load_config(config), tensors, _layer_index(module))
        except ValueError as error:
            results[name] = ("refused", _reason(error))
        except Exception as error:
            results[name] = ("not built", f"the porter raised {type(error).__name__}: {_reason(error)}")
        else:
            family = getattr(porter, "family", porter)
            results[name] = ("ported", family.__module__.rsplit(".", 1)[-1])
            ported[path] = name
    return results


def _fewer_layers(config):
    """The default configuration with fewer layers and experts (each kind of layer kept, per-layer lists cut),
    its attention's sizes as they are: the meta model builds in a moment."""
    from shared_tests import hf_tiny

    for sub in [config, *(v for v in vars(config).values() if hasattr(v, "to_dict") and hasattr(v, "model_type"))]:
        layers = next((getattr(sub, n) for n in hf_tiny.LAYER_COUNTS if isinstance(getattr(sub, n, None), int)), 0)
        kept = hf_tiny.layers_kept(sub, layers)
        for name in hf_tiny.LAYER_COUNTS:
            if isinstance(getattr(sub, name, None), int):
                hf_tiny.set_field(sub, name, kept)
        for name, value in list(vars(sub).items()):
            if layers and isinstance(value, list | tuple) and len(value) == layers and kept < layers:
                hf_tiny.set_field(sub, name, type(value)(value[:kept]))
        for name in ("num_experts", "n_routed_experts", "num_local_experts"):
            if isinstance(getattr(sub, name, None), int) and getattr(sub, name) > 4:
                hf_tiny.set_field(sub, name, 4)


def _reason(error):
    return " ".join(str(error).split())[:400]


_TINY_PORTS = {}  # {model type: _ports_of(its tiny model)}, where its default configuration does not build
_SWAPPED = {}  # {model type: the attention classes `replace_attention` swapped in its tiny model}, where it passed


def _proof(model_type):
    """The generated test's verdict on the family's tiny model: ("ported", None), ("refused", reason),
    ("not built", why) or ("computes otherwise", what)."""
    from shared_tests import hf_tiny

    try:
        model = hf_tiny.tiny_model(model_type)
    except hf_tiny.NotBuiltError as error:
        return "not built", f"its tiny model: {error}"
    _TINY_PORTS[model_type] = _ports_of(model)
    try:
        replaced = hf_tiny.check_replaced(model)["replaced"]
    except ValueError as error:
        return "refused", _reason(error)
    except AssertionError as error:
        return "computes otherwise", _reason(error)
    except Exception as error:
        return "not built", f"its tiny model's forward or generate raised {type(error).__name__}: {_reason(error)}"
    _SWAPPED[model_type] = {type(model.get_submodule(name)).__name__ for name in replaced}
    return "ported", None


def census(model_types=None):
    """([(model type, class name, status, detail)] for every attention class, [(model type, its *ForCausalLM
    class, the generated test's verdict, detail)] for every family with one), of `model_types` if given."""
    from shared_tests import hf_tiny

    rows, families, classes = [], [], attention_classes()
    by_type = {}
    for model_type, name, _ in classes:
        if model_type_wanted(model_type, model_types):
            by_type.setdefault(model_type, []).append(name)
    for model_type in hf_tiny.causal_lm_families():  # a causal family with no attention class (Mamba): its verdict
        if model_type_wanted(model_type, model_types):
            by_type.setdefault(model_type, [])
    for model_type, names in sorted(by_type.items()):
        cls = _model_class(model_type)
        if cls is None:
            for name in names:
                kind = _kind(name) or "a model type with no causal language model, not listed by interop.hf"
                rows.append((model_type, name, "out of scope", kind))
            continue
        try:
            ports = _meta_ports(cls)
        except Exception as error:
            ports, failed = {}, f"{cls.__name__} on the meta device: {type(error).__name__}: {_reason(error)}"
        else:
            failed = None
        causal = _in_scope(model_type)
        proof = _proof(model_type) if causal else None
        if model_type in _TINY_PORTS:  # the tiny model built: its classes where the meta model has none (a
            ports, failed = {**_TINY_PORTS[model_type], **ports}, None  # hybrid's attention, which `hf_tiny`
            # adds where the default configuration has Mamba layers only) or failed to build
        if causal:
            families.append((model_type, cls.__name__, *proof))
        for name in names:
            rows.append((model_type, name, *_status(model_type, name, ports, failed, proof, causal, cls)))
    return rows, families


def model_type_wanted(model_type, model_types):
    return model_types is None or model_type in model_types


def _status(model_type, name, ports, failed, proof, causal, cls):
    kind = _kind(name)
    if name not in ports:
        if kind is not None:
            return "out of scope", kind
        if failed is not None:
            return "not built", failed
        if not cls.__name__.endswith("ForCausalLM") and causal:  # a text decoder's model type: not in it
            return "out of scope", f"not in its text decoder {cls.__name__}, the model tested"
        return "not built", f"not in the model {cls.__name__} builds from its default configuration"
    status, detail = ports[name]
    if kind is not None and status == "refused":
        return "out of scope", kind
    if status != "ported":
        return status, detail
    if not causal or (model_type in _BUILTIN and proof[1] and proof[1].startswith(_NOT_SWAPPED)):
        return "ported", f"{detail}; {LISTED_TEST}"  # a listed family `replace_attention` does not swap
    if proof[0] == "ported" and kind is not None and name not in _SWAPPED[model_type]:
        return "out of scope", kind  # a multimodal model's encoder the generated test leaves as it is
    if proof[0] == "ported":
        return "ported", f"{detail}; {TEST.format(model_type)}"
    if proof[0] == "computes otherwise":
        return "refused", f"computes otherwise ({proof[1]}): not counted"
    return proof


def counts(rows):
    """{status: number of classes}."""
    return {status: sum(row[2] == status for row in rows) for status in _STATUSES}


def markdown(rows, families):
    """The census as a Markdown page: the counts, one row per class, then one row per `*ForCausalLM` family."""
    total = counts(rows)
    lines = [
        "# Census of the attention classes of `transformers`",
        "",
        "Written by `.venv/bin/python -m interop.hf.census --write` (see `interop/hf/census.py` for what each "
        "status means); `shared_tests/test_hf_families.py` checks that it is current in the long mode.",
        "",
        "| status | classes |",
        "|---|---|",
        *(f"| {status} | {total[status]} |" for status in _STATUSES),
        f"| all | {len(rows)} |",
        "",
        "| model type | class | status | porter and test, reason, kind or why |",
        "|---|---|---|---|",
    ]
    lines += [f"| `{t}` | `{c}` | {s} | {d.replace('|', '/')} |" for t, c, s, d in rows]
    lines += [
        "",
        "## The families with a `*ForCausalLM` class: the generated test's verdict",
        "",
        "| model type | causal LM | verdict | reason or why |",
        "|---|---|---|---|",
    ]
    lines += [f"| `{t}` | `{c}` | {v} | {(d or '').replace('|', '/')} |" for t, c, v, d in families]
    return "\n".join(lines) + "\n"


def read_table(path=TABLE):
    """The committed census, read back from its Markdown: (its class rows, its family rows)."""
    tables, current = ([], []), 0
    for line in Path(path).read_text().splitlines():
        if line.startswith("## The families"):
            current = 1
        match = re.fullmatch(r"\| `([^`]+)` \| `([^`]+)` \| ([a-z ]+) \| (.*) \|", line)
        if match:
            tables[current].append(tuple(match.groups()))
    return tables


def _spliced(old, new, model_types):
    """The committed rows `old` with those of `model_types` replaced by `new`, by model type."""
    kept = [row for row in old if row[0] not in model_types]
    return sorted(kept + list(new), key=lambda row: row[0])  # stable: a model type's rows keep their order


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m interop.hf.census", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--write",
        action="store_true",
        help=f"write the table to {TABLE.relative_to(ROOT)} (with model types: only their rows replaced)",
    )
    parser.add_argument("model_types", nargs="*", help="only these model types (default: all)")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    with contextlib.redirect_stderr(io.StringIO()):
        import transformers

        transformers.logging.set_verbosity_error()
        rows, families = census(args.model_types or None)
    if args.write and args.model_types:  # the committed table's other model types kept
        rows, families = (
            _spliced(old, new, args.model_types) for old, new in zip(read_table(), (rows, families), strict=True)
        )
    text = markdown(rows, families)
    if args.write:
        TABLE.write_text(text)
    sys.stdout.write(text)


if __name__ == "__main__":
    main()
