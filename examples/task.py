"""The synthetic task shared by the examples, and how a user loads a copied layer file.

Key-value lookup: a sequence holds 3 to 8 (key, value) pairs, one token each, then 1 to 4
queries "?key". At each query the model must output the value paired with that key somewhere
in the sequence. No per-position network can do it: the answer lives at another position, so
the model has to attend. Sequences are padded with token 0 to a fixed length.

Token ids: 0 padding; 1 + key * VALUES + value for a pair; PAIR_END + key for a query.
"""

import argparse
import importlib.util
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
KEYS, VALUES = 16, 16
PAIR_END = 1 + KEYS * VALUES
VOCAB = PAIR_END + KEYS
MAX_PAIRS, MAX_QUERIES = 8, 4
LENGTH = MAX_PAIRS + MAX_QUERIES
IGNORE = -1  # label of positions that are not queries


def make_batch(rng, batch_size):
    """(tokens, labels), both (B, LENGTH) int64; labels are IGNORE except at queries."""
    tokens = np.zeros((batch_size, LENGTH), dtype=np.int64)
    labels = np.full((batch_size, LENGTH), IGNORE, dtype=np.int64)
    for row in range(batch_size):
        pairs, queries = rng.integers(3, MAX_PAIRS + 1), rng.integers(1, MAX_QUERIES + 1)
        keys = rng.choice(KEYS, size=pairs, replace=False)
        values = rng.integers(0, VALUES, size=pairs)
        asked = rng.integers(0, pairs, size=queries)
        tokens[row, :pairs] = 1 + keys * VALUES + values
        tokens[row, pairs : pairs + queries] = PAIR_END + keys[asked]
        labels[row, pairs : pairs + queries] = values[asked]
    return tokens, labels


def describe(tokens):
    """Readable labels for the tokens of one sequence: 'k3=v7', '?k3' or '_'."""
    names = []
    for token in tokens:
        if token == 0:
            names.append("_")
        elif token < PAIR_END:
            names.append(f"k{(token - 1) // VALUES}=v{(token - 1) % VALUES}")
        else:
            names.append(f"?k{token - PAIR_END}")
    return names


def load_layer(framework):
    """Imports `<framework>/Multi_Head_Attention.py` as a copied file, under its own name, so
    the PyTorch and the TensorFlow file can live in one process."""
    path = ROOT / framework / "Multi_Head_Attention.py"
    name = f"{framework.lower()}_multi_head_attention"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module.MultiHeadAttention


def parse_args(doc, default_out, argv=None):
    """The flags every example takes; creates the output directory."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1500, help="training steps (default 1500)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the data and of the initialisation")
    parser.add_argument("--out", type=Path, default=Path(default_out), help=f"output directory (default {default_out})")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    return args


class Progress:
    """A one-line progress bar on stderr."""

    def __init__(self, total, width=30):
        self.total, self.width, self.start = total, width, time.perf_counter()

    def update(self, step, **values):
        done = int(self.width * step / self.total)
        extra = " ".join(f"{k} {v:.3f}" for k, v in values.items())
        elapsed = time.perf_counter() - self.start
        bar = "#" * done + "." * (self.width - done)
        print(f"\r[{bar}] {step}/{self.total} {elapsed:5.1f}s {extra}", end="", file=sys.stderr, flush=True)

    def close(self):
        print(file=sys.stderr)
