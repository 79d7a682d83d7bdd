"""Per-head attention heatmaps of the trained lookup model, PyTorch beside TensorFlow.

    python examples/visualize_attention.py [--steps 1500] [--seed 0] [--out out/plots]

Trains the PyTorch model, ports it to Keras (port_weights.py), and draws, for one input, a grid
with one row per head and the two frameworks side by side, tokens on the axes; then the same
layer again with causal=True. Writes attention_heads.png and attention_heads_causal.png.
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
import torch
from keras_model import attention_weights
from port_weights import port
from task import describe, make_batch, parse_args
from torch_model import train


def draw(torch_weights, keras_weights, labels, title, path):
    """torch_weights, keras_weights: (N, T, S) for one sequence."""
    heads = torch_weights.shape[0]
    fig, axes = plt.subplots(heads, 2, figsize=(10, 4.2 * heads), squeeze=False, layout="constrained")
    for head in range(heads):
        for col, (name, weights) in enumerate((("PyTorch", torch_weights), ("TensorFlow", keras_weights))):
            ax = axes[head, col]
            ax.imshow(weights[head], cmap="magma", vmin=0, vmax=1)
            ax.set_title(f"{name}, head {head}", fontsize=10)
            ax.set_xticks(range(len(labels)), labels, rotation=90, fontsize=7)
            ax.set_yticks(range(len(labels)), labels, fontsize=7)
            ax.set_xlabel("key")
            ax.set_ylabel("query")
    fig.suptitle(title)  # constrained layout keeps it, and every panel's title, clear of the panels
    fig.savefig(path, dpi=90)
    plt.close(fig)


def main(argv=None):
    args = parse_args(__doc__, "out/plots", argv)
    torch_model = train(args.steps, args.seed).eval()
    keras_model = port(torch_model, args.out / "attention.npz")
    tokens, _ = make_batch(np.random.default_rng(args.seed + 4000), 1)
    tokens = tokens[:, : np.count_nonzero(tokens)]  # the real tokens only: padding rows are masked differently
    labels = describe(tokens[0])
    for causal, suffix in ((False, ""), (True, "_causal")):
        with torch.no_grad():
            torch_weights = torch_model.attention_weights(torch.from_numpy(tokens), causal=causal)[0].numpy()
        keras_weights = attention_weights(keras_model, tokens, causal=causal)[0].numpy()
        kind = "causal" if causal else "bidirectional"
        difference = np.abs(torch_weights - keras_weights).max()
        path = args.out / f"attention_heads{suffix}.png"
        draw(
            torch_weights, keras_weights, labels, f"lookup model, {kind} (largest |difference| {difference:.1e})", path
        )
        print(f"{path}: largest weight difference between frameworks {difference:.1e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
