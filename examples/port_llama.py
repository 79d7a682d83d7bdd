"""Port a Llama-architecture model from `transformers` to this layer, in PyTorch and in Keras.

    python examples/port_llama.py [--steps 300] [--seed 0] [--out out/port_llama] [--frameworks NumPy PyTorch Keras]

A small character-level Llama (`LlamaForCausalLM`: grouped-query attention, RoPE, RMSNorm,
SiLU-gated MLP; built from a config, no download) learns examples/data/alice.txt for a few
hundred steps. Then it is rebuilt around `MultiHeadAttention`: each attention module through
`interop.hf.port_attention` (constructor arguments to `--out` as JSON, portable weights as .npz;
nothing computed outside the layer), the embeddings, norms and MLPs by copying their weights.
Greedy generation from two prompts of different lengths, left-padded into one batch, runs in
`transformers` (`generate`) and in each rebuilt model with the layer's KV cache (one prefill, then one token
per step, `positions` as `generate` computes them: cumsum(mask) - 1). All give the same tokens.
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch
from task import ROOT, Progress

sys.path.insert(0, str(ROOT))  # for `interop`, next to the layer folders

from interop.hf import port_attention

TEXT = (ROOT / "examples" / "data" / "alice.txt").read_text()
CHARS = sorted(set(TEXT))
VOCAB = len(CHARS) + 1  # id 0 is padding
HIDDEN, HEADS, KV_HEADS, LAYERS, MLP, CONTEXT, BATCH = 64, 4, 2, 2, 128, 64, 32
PROMPTS = ("Alice was", "The rabbit-hole went")
NEW_TOKENS = 40


def encode(text):
    return [CHARS.index(c) + 1 for c in text]


def decode(ids):
    return "".join(CHARS[i - 1] for i in ids)


def train(steps, seed):
    import transformers

    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        num_hidden_layers=LAYERS,
        intermediate_size=MLP,
        max_position_embeddings=256,
        pad_token_id=0,
        bos_token_id=None,
        eos_token_id=None,
    )
    model = transformers.LlamaForCausalLM(config)
    data = torch.tensor(encode(TEXT))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    progress = Progress(steps)
    for step in range(1, steps + 1):
        starts = rng.integers(0, len(data) - CONTEXT - 1, size=BATCH)
        window = torch.stack([data[s : s + CONTEXT + 1] for s in starts])  # (B, CONTEXT + 1)
        loss = model(input_ids=window[:, :-1], labels=window[:, :-1].clone()).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step % 25 == 0 or step == steps:
            progress.update(step, loss=loss.item())
    progress.close()
    return model.eval()


def _numpy(parameter):
    return parameter.detach().numpy().copy()


def llama_weights(model):
    """Every non-attention weight of the Llama as NumPy arrays, kernels as (in, out)."""
    layers = []
    for layer in model.model.layers:
        mlp = layer.mlp
        layers.append(
            {
                "input_norm": _numpy(layer.input_layernorm.weight),
                "post_norm": _numpy(layer.post_attention_layernorm.weight),
                "gate": _numpy(mlp.gate_proj.weight).T,
                "up": _numpy(mlp.up_proj.weight).T,
                "down": _numpy(mlp.down_proj.weight).T,
            }
        )
    return {
        "embed": _numpy(model.model.embed_tokens.weight),
        "layers": layers,
        "norm": _numpy(model.model.norm.weight),
        "head": _numpy(model.lm_head.weight).T,
        "eps": model.config.rms_norm_eps,
    }


def save_ports(model, out):
    """Ports every attention module once, to files any framework reads: constructor arguments as
    JSON, weights as .npz (the portable layout)."""
    for index, layer in enumerate(model.model.layers):
        kwargs, weights = port_attention(layer.self_attn, model.config)
        (out / f"attention_{index}.json").write_text(json.dumps(kwargs, indent=1))
        np.savez(out / f"attention_{index}.npz", **weights)


def ported_attention(out, layer_class):
    """One `MultiHeadAttention` per Llama layer, from the files of `save_ports`."""
    layers = []
    for index in range(LAYERS):
        attention = layer_class(**json.loads((out / f"attention_{index}.json").read_text()))
        with np.load(out / f"attention_{index}.npz", allow_pickle=False) as archive:
            attention.import_weights(dict(archive))
        layers.append(attention)
    return layers


class NumPyLlama:
    """The Llama around the NumPy reference layer (float64)."""

    def __init__(self, model, out):
        from NumPy import MultiHeadAttention

        self.w, self.attention = llama_weights(model), ported_attention(out, MultiHeadAttention)

    def rms_norm(self, x, scale):
        return x / np.sqrt(np.mean(x**2, axis=-1, keepdims=True) + self.w["eps"]) * scale

    def init_caches(self, batch, length):
        return [attention.init_cache(batch, length) for attention in self.attention]

    def __call__(self, tokens, positions, key_mask, caches):
        x = self.w["embed"][tokens].astype(np.float64)  # (B, T, E)
        for index, (layer, attention) in enumerate(zip(self.w["layers"], self.attention, strict=True)):
            h = self.rms_norm(x, layer["input_norm"])
            attended, caches[index] = attention(
                h, causal=True, key_mask=key_mask, positions=positions, cache=caches[index]
            )
            x = x + attended
            h = self.rms_norm(x, layer["post_norm"])
            gate = h @ layer["gate"]
            x = x + (gate / (1 + np.exp(-gate)) * (h @ layer["up"])) @ layer["down"]
        return self.rms_norm(x, self.w["norm"]) @ self.w["head"], caches  # (B, T, VOCAB)


class TorchLlama(torch.nn.Module):
    """The Llama around the PyTorch layer."""

    def __init__(self, model, out):
        super().__init__()
        from PyTorch import MultiHeadAttention

        self.w = llama_weights(model)
        self.attention = torch.nn.ModuleList(ported_attention(out, MultiHeadAttention))
        self.tensors = {
            name: torch.from_numpy(value) for name, value in self.w.items() if isinstance(value, np.ndarray)
        }
        self.layers = [{name: torch.from_numpy(value) for name, value in layer.items()} for layer in self.w["layers"]]

    def rms_norm(self, x, scale):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.w["eps"]) * scale

    def init_caches(self, batch, length):
        return [attention.init_cache(batch, length) for attention in self.attention]

    def forward(self, tokens, positions, key_mask, caches):
        x = self.tensors["embed"][torch.from_numpy(tokens)]  # (B, T, E)
        positions, key_mask = torch.from_numpy(positions), torch.from_numpy(key_mask)
        for index, (layer, attention) in enumerate(zip(self.layers, self.attention, strict=True)):
            h = self.rms_norm(x, layer["input_norm"])
            attended, caches[index] = attention(
                h, causal=True, key_mask=key_mask, positions=positions, cache=caches[index]
            )
            x = x + attended
            h = self.rms_norm(x, layer["post_norm"])
            x = x + (torch.nn.functional.silu(h @ layer["gate"]) * (h @ layer["up"])) @ layer["down"]
        return (self.rms_norm(x, self.tensors["norm"]) @ self.tensors["head"]).numpy(), caches


class KerasLlama:
    """The Llama built from Keras layers around the TensorFlow layer."""

    def __init__(self, model, out):
        import tensorflow as tf

        from TensorFlow import MultiHeadAttention

        self.w, self.ops = llama_weights(model), tf.keras.ops
        self.attention = ported_attention(out, MultiHeadAttention)
        self.embed = tf.keras.layers.Embedding(VOCAB, HIDDEN)
        self.embed.build((None, None))
        self.embed.embeddings.assign(self.w["embed"])
        self.dense = []
        for layer in self.w["layers"]:
            self.dense.append({name: self._dense(layer[name]) for name in ("gate", "up", "down")})
        self.head = self._dense(self.w["head"])

    @staticmethod
    def _dense(kernel):
        import tensorflow as tf

        dense = tf.keras.layers.Dense(kernel.shape[1], use_bias=False)
        dense.build((None, kernel.shape[0]))
        dense.kernel.assign(kernel)
        return dense

    def rms_norm(self, x, scale):
        ops = self.ops
        return x * ops.rsqrt(ops.mean(ops.square(x), axis=-1, keepdims=True) + self.w["eps"]) * scale

    def init_caches(self, batch, length):
        return [attention.init_cache(batch, length) for attention in self.attention]

    def __call__(self, tokens, positions, key_mask, caches):
        x = self.embed(tokens.astype(np.int32))  # (B, T, E)
        for index, (layer, dense, attention) in enumerate(
            zip(self.w["layers"], self.dense, self.attention, strict=True)
        ):
            h = self.rms_norm(x, layer["input_norm"])
            attended, caches[index] = attention(
                h, causal=True, key_mask=key_mask, positions=positions, cache=caches[index]
            )
            x = x + attended
            h = self.rms_norm(x, layer["post_norm"])
            x = x + dense["down"](self.ops.silu(dense["gate"](h)) * dense["up"](h))
        return np.asarray(self.head(self.rms_norm(x, self.w["norm"]))), caches


REBUILDS = {"NumPy": NumPyLlama, "PyTorch": TorchLlama, "Keras": KerasLlama}


def left_padded(prompts):
    """(B, P) token ids with every prompt right-aligned (id 0 before it) and the (B, P) 0/1 mask."""
    ids = [encode(prompt) for prompt in prompts]
    width = max(map(len, ids))
    tokens = np.array([[0] * (width - len(row)) + row for row in ids])
    return tokens, (tokens != 0).astype(np.int64)


def generate_with_transformers(model, tokens, mask):
    with torch.no_grad():
        out = model.generate(
            input_ids=torch.from_numpy(tokens),
            attention_mask=torch.from_numpy(mask),
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
        )
    return out[:, tokens.shape[1] :].numpy()


def generate_with_layer(rebuilt, tokens, mask):
    """Greedy decoding with the layer's KV cache; returns the new tokens and the smallest top-1 logit margin."""
    caches = rebuilt.init_caches(tokens.shape[0], tokens.shape[1] + NEW_TOKENS)
    positions = np.maximum(np.cumsum(mask, axis=-1) - 1, 0)  # (B, P), as `generate` computes them
    feed, key_mask, chosen, margin = tokens, mask.astype(bool), [], np.inf
    with torch.no_grad():
        for _ in range(NEW_TOKENS):
            logits, caches = rebuilt(feed, positions, key_mask, caches)
            last = np.sort(logits[:, -1], axis=-1)  # (B, VOCAB)
            margin = min(margin, float((last[:, -1] - last[:, -2]).min()))
            feed = logits[:, -1].argmax(-1)[:, None]  # (B, 1)
            chosen.append(feed[:, 0])
            positions, key_mask = positions[:, -1:] + 1, np.ones_like(feed, dtype=bool)
    return np.stack(chosen, axis=1), margin


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300, help="training steps (default 300)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the data and of the initialisation")
    parser.add_argument("--out", type=Path, default=Path("out/port_llama"), help="where the ported layers are written")
    parser.add_argument("--frameworks", nargs="+", choices=list(REBUILDS), default=list(REBUILDS))
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    return args


def main(argv=None):
    args = parse_args(argv)
    model = train(args.steps, args.seed)
    save_ports(model, args.out)
    tokens, mask = left_padded(PROMPTS)
    results = {"transformers generate": (generate_with_transformers(model, tokens, mask), None)}
    for name in args.frameworks:
        rebuilt = REBUILDS[name](model, args.out)
        results[f"{name} MultiHeadAttention, KV cache"] = generate_with_layer(rebuilt, tokens, mask)
    for name, (new_tokens, margin) in results.items():
        print(name + ("" if margin is None else f" (smallest top-1 logit margin {margin:.1e})") + ":")
        for prompt, row in zip(PROMPTS, new_tokens, strict=True):
            print(f"    {prompt + decode(row)!r}")
    identical = len({new_tokens.tobytes() for new_tokens, _ in results.values()}) == 1
    print(f"identical tokens in all {len(results)}: {identical}")
    return 0 if identical else 1


if __name__ == "__main__":
    raise SystemExit(main())
