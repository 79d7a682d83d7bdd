"""Train a tiny character-level decoder in PyTorch, port it to Keras, generate with the KV cache.

    python examples/generate.py [--steps 1500] [--seed 0] [--out out/generate]

The decoder (token + position embeddings, two pre-norm blocks of causal grouped-query attention
and an MLP) learns examples/data/alice.txt. Its weights move to the same decoder written in
Keras: the attention layers through `export_weights` / `import_weights` (an .npz file), the
rest by the name map below. Then both frameworks generate greedily from two prompts of
different lengths, left-padded into one batch (the cache's `keep` hides the padding):

- with the cache: one prefill of the prompts, then one token per step;
- without it: the full causal pass over everything so far, once per token.

All four give the identical strings. Then PyTorch decodes 32 tokens with the int8 KV cache
(`init_cache(..., dtype="int8")`) and with the float cache, and prints whether the greedy tokens
are the same, at how many steps the int8 cache picks the float cache's token when fed the float
run's tokens, the float run's smallest top-1 logit margin and how far the int8 cache moves any
logit: a token can part only where the float cache's top logit leads by less than that move (at
the default 1500 steps, one near tie, docs/SPEC.md "KV-cache decoding").
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np
import tensorflow as tf
import torch
from task import ROOT, Progress, load_layer, parse_args
from torch import nn

TEXT = (ROOT / "examples" / "data" / "alice.txt").read_text()
CHARS = sorted(set(TEXT))
VOCAB = len(CHARS)
D_MODEL, HEADS, KV_HEADS, BLOCKS, CONTEXT, BATCH = 64, 4, 2, 2, 96, 32
PROMPTS = ("Alice was", "The rabbit-hole went")
NEW_TOKENS = 60
INT8_TOKENS = 32  # tokens decoded with the int8 cache against the float cache
TorchAttention, KerasAttention = load_layer("PyTorch"), load_layer("TensorFlow")


def encode(text):
    return [CHARS.index(c) for c in text]


def decode(ids):
    return "".join(CHARS[i] for i in ids)


def positions(length, start, pad):
    """(B, T) position of each token: slot minus the row's left padding (padding sits at 0)."""
    slots = start + np.arange(length)[None, :]  # (1, T)
    return np.maximum(slots - pad[:, None], 0)  # (B, T)


class TorchBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(D_MODEL), nn.LayerNorm(D_MODEL)
        self.attention = TorchAttention(D_MODEL, HEADS, num_kv_heads=KV_HEADS)
        self.hidden, self.project = nn.Linear(D_MODEL, 4 * D_MODEL), nn.Linear(4 * D_MODEL, D_MODEL)

    def forward(self, x, keep, cache):
        h = self.norm1(x)
        if cache is None:
            attended = self.attention(h, attention_mask=keep, causal=True)  # (B, T, E)
        else:
            attended, cache = self.attention(h, causal=True, cache=cache)  # padding is in cache.keep
        x = x + attended
        return x + self.project(torch.relu(self.hidden(self.norm2(x)))), cache


class TorchDecoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed, self.position = nn.Embedding(VOCAB, D_MODEL), nn.Embedding(CONTEXT, D_MODEL)
        self.blocks = nn.ModuleList(TorchBlock() for _ in range(BLOCKS))
        self.norm, self.logits = nn.LayerNorm(D_MODEL), nn.Linear(D_MODEL, VOCAB)

    def forward(self, tokens, pad, caches=None, start=0):
        """(B, T) tokens at slots [start, start + T) -> (B, T, VOCAB) logits and the caches."""
        where = torch.from_numpy(positions(tokens.shape[1], start, pad))
        x = self.embed(tokens) + self.position(where)  # (B, T, E)
        keep = torch.from_numpy(np.arange(tokens.shape[1])[None, :] >= pad[:, None])[:, None, :]  # (B, 1, S)
        caches = caches or [None] * BLOCKS
        for index, block in enumerate(self.blocks):
            x, caches[index] = block(x, keep, caches[index])
        return self.logits(self.norm(x)), caches


class KerasDecoder:
    """The same decoder built from Keras layers, step for step."""

    def __init__(self):
        layers = tf.keras.layers
        self.embed, self.position = layers.Embedding(VOCAB, D_MODEL), layers.Embedding(CONTEXT, D_MODEL)
        self.blocks = [
            {
                "norm1": layers.LayerNormalization(epsilon=1e-5),
                "attention": KerasAttention(D_MODEL, HEADS, num_kv_heads=KV_HEADS),
                "norm2": layers.LayerNormalization(epsilon=1e-5),
                "hidden": layers.Dense(4 * D_MODEL, activation="relu"),
                "project": layers.Dense(D_MODEL),
            }
            for _ in range(BLOCKS)
        ]
        self.norm, self.logits = layers.LayerNormalization(epsilon=1e-5), layers.Dense(VOCAB)
        self(np.zeros((1, 1), np.int32), np.zeros(1, np.int64))  # build every layer

    def __call__(self, tokens, pad, caches=None, start=0):
        x = self.embed(tokens) + self.position(positions(tokens.shape[1], start, pad))  # (B, T, E)
        keep = (np.arange(tokens.shape[1])[None, :] >= pad[:, None])[:, None, :]  # (B, 1, S)
        caches = caches or [None] * BLOCKS
        for index, block in enumerate(self.blocks):
            h = block["norm1"](x)
            if caches[index] is None:
                attended = block["attention"](h, attention_mask=keep, causal=True)
            else:
                attended, caches[index] = block["attention"](h, causal=True, cache=caches[index])
            x = x + attended
            x = x + block["project"](block["hidden"](block["norm2"](x)))
        return self.logits(self.norm(x)), caches


def train(steps, seed):
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    data = torch.tensor(encode(TEXT))
    model = TorchDecoder()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    no_pad = np.zeros(BATCH, np.int64)
    progress = Progress(steps)
    for step in range(1, steps + 1):
        starts = rng.integers(0, len(data) - CONTEXT - 1, size=BATCH)
        window = torch.stack([data[s : s + CONTEXT + 1] for s in starts])  # (B, CONTEXT + 1)
        logits, _ = model(window[:, :-1], no_pad)
        loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), window[:, 1:].reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step % 25 == 0 or step == steps:
            progress.update(step, loss=loss.item())
    progress.close()
    return model.eval()


def port(torch_model, out):
    """A Keras decoder holding the torch decoder's weights."""
    keras_model = KerasDecoder()
    for index, block in enumerate(torch_model.blocks):
        path = out / f"attention_{index}.npz"
        np.savez(path, **block.attention.export_weights())
        with np.load(path, allow_pickle=False) as archive:
            keras_model.blocks[index]["attention"].import_weights(dict(archive))
        for name in ("norm1", "norm2", "hidden", "project"):
            _copy(getattr(block, name), keras_model.blocks[index][name])
    for name in ("embed", "position", "norm", "logits"):
        _copy(getattr(torch_model, name), getattr(keras_model, name))
    return keras_model


def _copy(module, layer):
    """nn.Embedding / nn.LayerNorm / nn.Linear -> the Keras layer (Linear stores kernel^T)."""
    weight = module.weight.detach().numpy()
    if isinstance(module, nn.Embedding):
        layer.embeddings.assign(weight)
    elif isinstance(module, nn.LayerNorm):
        layer.gamma.assign(weight)
        layer.beta.assign(module.bias.detach().numpy())
    else:
        layer.kernel.assign(weight.T)
        layer.bias.assign(module.bias.detach().numpy())


def left_padded(prompts):
    """(B, P) token ids with every prompt right-aligned, and (B,) its left padding."""
    ids = [encode(p) for p in prompts]
    width = max(map(len, ids))
    pad = np.array([width - len(i) for i in ids])
    return np.array([[0] * p + i for p, i in zip(pad, ids, strict=True)]), pad


def generate(step, init_caches, prompts, new_tokens, cached):
    """Greedy decoding. `step(tokens, pad, caches, start) -> (logits, caches)` with NumPy
    logits; `init_caches(batch, length, keep)` makes one cache per block. Returns the strings
    and the smallest gap between the best and the second-best logit (how close a tie came)."""
    tokens, pad = left_padded(prompts)
    keep = np.arange(tokens.shape[1] + new_tokens)[None, :] >= pad[:, None]  # (B, L)
    caches = init_caches(len(prompts), keep.shape[1], keep) if cached else None
    feed, start, margin = tokens, 0, np.inf
    for _ in range(new_tokens):
        logits, caches = step(feed, pad, caches, start)
        last = np.sort(logits[:, -1], axis=-1)  # (B, VOCAB)
        margin = min(margin, float((last[:, -1] - last[:, -2]).min()))
        chosen = logits[:, -1].argmax(-1)[:, None]  # (B, 1)
        tokens = np.concatenate([tokens, chosen], axis=1)
        feed, start = (chosen, tokens.shape[1] - 1) if cached else (tokens, 0)
    return [decode(row[p:]) for row, p in zip(tokens, pad, strict=True)], margin


def int8_agreement(torch_model):
    """Greedy decoding of INT8_TOKENS tokens with the float cache, then with the int8 cache twice:
    on its own, and fed the float run's tokens (each step's logits compared on the same prefix).
    Returns whether the strings are the same, the steps (of B * INT8_TOKENS) whose top-1 token is
    the same on the same prefix, the largest top-1 margin of the float run where it is not (0 where
    none), the float run's smallest top-1 margin and the largest logit difference on the same prefix."""
    logits = {"float": [], "int8": [], "fed": []}

    def run(dtype, name):
        def step(tokens, pad, caches, start):
            with torch.no_grad():
                out, caches = torch_model(torch.from_numpy(tokens), pad, caches, start)
            logits[name].append(out[:, -1].numpy())  # (B, VOCAB)
            fed = name == "fed"  # the float run's logits choose the next token
            return (logits["float"][len(logits[name]) - 1][:, None] if fed else out.numpy()), caches

        def init(batch, length, keep):
            keep = torch.from_numpy(keep)
            return [b.attention.init_cache(batch, length, keep=keep, dtype=dtype) for b in torch_model.blocks]

        return generate(step, init, PROMPTS, INT8_TOKENS, cached=True)

    (floats, margin), (int8s, _), _ = run(None, "float"), run("int8", "int8"), run("int8", "fed")
    float_logits, fed = np.stack(logits["float"]), np.stack(logits["fed"])  # (INT8_TOKENS, B, VOCAB)
    same = float_logits.argmax(-1) == fed.argmax(-1)  # (INT8_TOKENS, B)
    top = np.sort(float_logits, axis=-1)
    gaps = top[..., -1] - top[..., -2]  # (INT8_TOKENS, B), the float run's top-1 margins
    worst = float(gaps[~same].max()) if not same.all() else 0.0
    moved = float(np.abs(float_logits - fed).max())
    return floats == int8s, int(same.sum()), same.size, worst, margin, moved


def main(argv=None):
    args = parse_args(__doc__, "out/generate", argv)
    torch_model = train(args.steps, args.seed)
    keras_model = port(torch_model, args.out)

    def torch_step(tokens, pad, caches, start):
        with torch.no_grad():
            logits, caches = torch_model(torch.from_numpy(tokens), pad, caches, start)
        return logits.numpy(), caches

    def keras_step(tokens, pad, caches, start):
        logits, caches = keras_model(tokens.astype(np.int32), pad, caches, start)
        return logits.numpy(), caches

    def torch_caches(batch, length, keep):
        return [b.attention.init_cache(batch, length, keep=torch.from_numpy(keep)) for b in torch_model.blocks]

    def keras_caches(batch, length, keep):
        return [b["attention"].init_cache(batch, length, keep=keep) for b in keras_model.blocks]

    runs = {
        "PyTorch, KV cache": (torch_step, torch_caches, True),
        "PyTorch, full pass per token": (torch_step, torch_caches, False),
        "Keras, KV cache": (keras_step, keras_caches, True),
        "Keras, full pass per token": (keras_step, keras_caches, False),
    }
    results = {name: generate(step, init, PROMPTS, NEW_TOKENS, cached) for name, (step, init, cached) in runs.items()}
    for name, (texts, margin) in results.items():
        print(f"{name} (smallest top-1 logit margin {margin:.1e}):")
        for text in texts:
            print(f"    {text!r}")
    identical = len({tuple(texts) for texts, _ in results.values()}) == 1
    print(f"identical strings in all four: {identical}")
    same, agree, steps, worst, margin, moved = int8_agreement(torch_model)
    print(
        f"int8 KV cache, {INT8_TOKENS} tokens: the float cache's greedy tokens: {same}; on the float cache's "
        f"tokens the same top-1 token at {agree} of {steps} steps (where not, the top-1 logit margin is at most "
        f"{worst:.1e}); smallest top-1 logit margin {margin:.1e}, logits moved by at most {moved:.1e}"
    )
    return 0 if identical else 1


if __name__ == "__main__":
    raise SystemExit(main())
