"""Train a small PyTorch model that needs attention, save it, reload it, compare predictions.

    python examples/torch_model.py [--steps 1500] [--seed 0] [--out out/torch]

The model: token embedding -> MultiHeadAttention (self-attention, key padding mask) ->
residual -> MLP -> logits over the values. The layer comes from PyTorch/Multi_Head_Attention.py,
imported as the copied file it is meant to be.
"""

import numpy as np
import torch
from task import IGNORE, VALUES, VOCAB, Progress, load_layer, make_batch, parse_args
from torch import nn

MultiHeadAttention = load_layer("PyTorch")
D_MODEL, HEADS, BATCH = 64, 4, 64


class LookupModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D_MODEL, padding_idx=0)
        self.attention = MultiHeadAttention(D_MODEL, HEADS)
        self.hidden = nn.Linear(D_MODEL, D_MODEL)
        self.logits = nn.Linear(D_MODEL, VALUES)

    def forward(self, tokens):
        x = self.embed(tokens)  # (B, T) -> (B, T, E)
        x = x + self.attention(x, attention_mask=padding_keep(tokens))  # (B, T, E)
        return self.logits(torch.relu(self.hidden(x)))  # (B, T, E) -> (B, T, VALUES)

    def attention_weights(self, tokens, causal=False):
        """(B, N, T, S) per-head weights of the attention layer on these tokens."""
        x = self.embed(tokens)
        return self.attention(x, attention_mask=padding_keep(tokens), causal=causal, return_attention=True)[1]


def padding_keep(tokens):
    return (tokens != 0)[:, None, :]  # key padding: (B, T) -> (B, 1, S), True = attend


def accuracy(logits, labels):
    asked = labels != IGNORE
    return (logits.argmax(-1)[asked] == labels[asked]).float().mean().item()


def train(steps, seed):
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    model = LookupModel()
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    progress = Progress(steps)
    for step in range(1, steps + 1):
        tokens, labels = (torch.from_numpy(a) for a in make_batch(rng, BATCH))
        logits = model(tokens)
        loss = nn.functional.cross_entropy(logits.reshape(-1, VALUES), labels.reshape(-1), ignore_index=IGNORE)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step % 25 == 0 or step == steps:
            progress.update(step, loss=loss.item(), acc=accuracy(logits, labels))
    progress.close()
    return model


def evaluate(model, seed, batches=20):
    rng = np.random.default_rng(seed + 1000)
    model.eval()
    with torch.no_grad():
        scores = [
            accuracy(model(torch.from_numpy(t)), torch.from_numpy(y))
            for t, y in (make_batch(rng, 256) for _ in range(batches))
        ]
    return float(np.mean(scores))


def main(argv=None):
    args = parse_args(__doc__, "out/torch", argv)
    model = train(args.steps, args.seed)
    print(f"held-out token accuracy: {evaluate(model, args.seed):.1%}")

    path = args.out / "lookup_model.pt"
    torch.save(model.state_dict(), path)
    reloaded = LookupModel()
    reloaded.load_state_dict(torch.load(path, weights_only=True))
    reloaded.eval()
    tokens, _ = make_batch(np.random.default_rng(args.seed + 2000), 256)
    with torch.no_grad():
        same = torch.equal(model(torch.from_numpy(tokens)), reloaded(torch.from_numpy(tokens)))
    print(f"saved to {path}; reloaded model gives identical logits: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
