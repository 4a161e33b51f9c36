"""OpenAI's response shapes as served: tool-call ids and the weights' labels."""

from __future__ import annotations

import re

from composer_lightning.serve.protocol import Choice, weights_label, with_tool_calls

CALL = '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'


def test_every_served_tool_call_has_an_id_of_its_own():
    """OpenAI's ids are unique per call (a harness keys the tool results it sends back by
    them): two calls of one reply, and the calls of two replies, never share one (every call
    was `call_0_0`)."""
    first, second = (with_tool_calls(Choice(CALL + CALL, "stop"), True) for _ in range(2))
    ids = [c["id"] for choice in (first, second) for c in choice.tool_calls]
    assert len(set(ids)) == 4 and all(re.fullmatch(r"call_[0-9a-f]{24}", i) for i in ids)


def test_weight_labels_order_as_the_weights_were_served():
    """A resumed run (launch 2, from a checkpoint at version 33) serves after the lost run's
    version 36: its labels come after, by launch then version (`weights-v36` then
    `weights-v33-l2` went backwards)."""
    served = [(1, 35), (1, 36), (2, 33), (2, 34), (3, 10)]  # (launch, version), in serving order
    labels = [weights_label(version, launch) for launch, version in served]
    parsed = [re.fullmatch(r"weights-l(\d+)-v(\d+)", label) for label in labels]
    assert all(parsed), labels
    assert [(int(m[1]), int(m[2])) for m in parsed] == served  # the label says both, in order
    assert weights_label(7) == "weights-v7"  # an app serving no launch (a bare `make_app`)
