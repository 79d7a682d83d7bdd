"""What decoding a case chunk by chunk reads beside the layers: each chunk's positions and mask rows,
the slots each query attends, and the mask of the one full pass equal to the decoding. Below the
decode table and the runners (the NumPy runner imports it, and the decode table's seed search runs
the NumPy runner).

Legend: B batch, T chunk length, P positions decoded, L cache slots, N heads, S keys.
"""

import numpy as np


def chunk_positions(data, start, stop):
    """{"positions": the chunk's (B, T) or (k, B, T) positions} or {} when the case passes none."""
    return {} if data["positions"] is None else {"positions": data["positions"][..., start:stop]}


def chunk_mask(mask, start, stop):
    """The rows [start, stop) of a (P, L), (B, P, L) or (B, N, P, L) mask."""
    return None if mask is None else mask[..., start:stop, :]


def query_ends(case):
    """(P,): the end of each query's chunk; without `causal` a query attends every slot before it."""
    return np.concatenate([np.full(stop - start, stop) for start, stop in case.spans()])


def slot_positions(case):
    """(P, L): the position each slot holds when each query attends (position p in slot p mod L,
    written up to the end of the query's chunk); negative where nothing is written yet."""
    slots = np.arange(case.length)[None, :]  # (1, L)
    last = query_ends(case)[:, None] - 1  # (P, 1)
    return slots + case.length * ((last - slots) // case.length)  # (P, L)


def position_keep(case, data):
    """(B, P): the cache's keep read by position: the left padding of the first lap; a position
    past L is a new token in a rolling cache (window), kept."""
    rolled = np.ones((case.b, max(0, case.p - case.length)), dtype=bool)
    return np.concatenate([data["keep"][:, : case.p], rolled], axis=1)  # (B, P)


def by_slot(case, full_weights):
    """(B, N, P, P) weights of the full pass -> (B, N, P, L): where each query's slots held them."""
    held = slot_positions(case)  # (P, L)
    gathered = np.take_along_axis(full_weights, np.maximum(held, 0)[None, None], axis=-1)  # (B, N, P, L)
    return np.where(held >= 0, gathered, 0.0)


def full_pass_mask(case, data):
    """The mask of one full pass (causal if the case is) over the P tokens equivalent to
    decoding: the cache's keep, the attention_mask and, without `causal`, the end of each
    query's chunk, cut to (B, P, P) or (B, N, P, P)."""
    p, keep = case.p, position_keep(case, data)[:, None, :]  # (B, 1, P)
    if not case.causal:
        keep = keep & (np.arange(p)[None, :] < query_ends(case)[:, None])  # (B, P, P)
    mask = data["attention_mask"]
    if mask is None:
        return keep
    mask = mask[..., :p]
    if mask.dtype == np.bool_:
        return mask & (keep if mask.ndim == 3 else keep[:, None])  # (B, P, P) or (B, N, P, P)
    return np.where(keep, mask, -np.inf).astype(np.float32)  # (B, P, P)
