"""The call arguments a case passes beside query, key and value: their names and how a case's data
gives them. A module of its own, below the case table and the runners, so that the NumPy runner
(which the case table's indexer cases run to draw their seed) imports it without a cycle.

Legend: none (names only).
"""

CALL_INPUTS = (
    "attention_mask", "key_mask", "query_mask", "attention_bias", "positions", "segment_ids", "key_segment_ids",
)  # beside the inputs  # fmt: skip


def call_inputs(data):
    """The call arguments beside query, key and value that a case passes (NumPy arrays)."""
    return {name: data[name] for name in CALL_INPUTS if data.get(name) is not None}
