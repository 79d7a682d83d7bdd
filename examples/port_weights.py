"""Train in PyTorch, move the whole model to Keras, and show the same predictions and logits.

    python examples/port_weights.py [--steps 1500] [--seed 0] [--out out/port]

The attention layer moves with `export_weights` / `import_weights` (through an .npz file, as a
user would ship it); the other layers move by an explicit name map below (torch's Linear stores
weight = kernel^T). The Keras model reads padding from Embedding(mask_zero=True) while the
torch model passes a key padding mask: the same masking, spelled the way each framework spells it.
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np
import torch
from keras_model import build_model
from task import make_batch, parse_args
from torch_model import train

LOGITS_TOL = 1e-4  # float32 logits after four layers (the SPEC's 1e-5 covers the attention layer alone)

# Keras layer -> (torch module, {keras weight: (torch parameter, transpose?)})
NAME_MAP = {
    "embed": ("embed", {"embeddings": ("weight", False)}),
    "hidden": ("hidden", {"kernel": ("weight", True), "bias": ("bias", False)}),
    "logits": ("logits", {"kernel": ("weight", True), "bias": ("bias", False)}),
}


def port(torch_model, npz_path):
    """A Keras model holding the torch model's weights."""
    np.savez(npz_path, **torch_model.attention.export_weights())
    keras_model = build_model()
    with np.load(npz_path, allow_pickle=False) as archive:
        keras_model.get_layer("attention").import_weights({name: archive[name] for name in archive.files})
    for keras_name, (torch_name, weights) in NAME_MAP.items():
        layer, module = keras_model.get_layer(keras_name), getattr(torch_model, torch_name)
        for variable in layer.weights:
            short = variable.path.rsplit("/", 1)[-1]
            parameter, transpose = weights[short]
            value = getattr(module, parameter).detach().numpy()
            variable.assign(value.T if transpose else value)
    return keras_model


def main(argv=None):
    args = parse_args(__doc__, "out/port", argv)
    torch_model = train(args.steps, args.seed).eval()
    keras_model = port(torch_model, args.out / "attention.npz")

    tokens, _ = make_batch(np.random.default_rng(args.seed + 3000), 256)
    with torch.no_grad():
        torch_logits = torch_model(torch.from_numpy(tokens)).numpy()
    keras_logits = keras_model(tokens).numpy()
    asked = tokens != 0
    worst = np.abs(torch_logits - keras_logits)[asked].max()
    agree = np.mean(torch_logits.argmax(-1)[asked] == keras_logits.argmax(-1)[asked])
    print(f"largest logit difference on real tokens: {worst:.2e} (tolerance {LOGITS_TOL:.0e})")
    print(f"predictions that agree: {agree:.1%}")
    return 0 if worst <= LOGITS_TOL and agree == 1.0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
