"""Ray nodes as a person reads them: "host (address)", not a 56-character id.

Ray names a node by a random id of 56 hex digits; an operator knows it by its host name and
address. The controller learns the names of the nodes it places on, once per placement
(controller/placement.py reads them from Ray with the nodes it chooses), and every line a person
reads names nodes so: the console, the reasons and events of the job record (`longrun status`),
the journal (`longrun report`), TensorBoard, the `node` label of the metrics. Machine-readable
fields keep the id (an event's `node`, the eviction list, the label `node_id` beside `node`), so
whatever matches on ids is unchanged.

    names = NodeNames({"05b9...b7": "gpu-07 (10.0.3.7)"})
    names.in_text("rank 1 on node 05b9...b7 died")  # "rank 1 on node gpu-07 (10.0.3.7) died"

Pure: no Ray here (`longrun status` and `report` use it on a machine without a cluster).
"""

from __future__ import annotations

import re
from collections.abc import Mapping

# A Ray node id (28 bytes, hex), whole: not a piece of a longer hex string (a digest).
NODE_ID = re.compile(r"(?<![0-9a-fA-F])[0-9a-f]{56}(?![0-9a-fA-F])")


def node_name(host: str, address: str) -> str:
    """"host (address)"; just the address when the host has no name of its own."""
    if host and host != address:
        return f"{host} ({address})" if address else host
    return address or host


class NodeNames:
    """Node id -> the name a person reads. Grows with every placement: a node evicted or lost
    keeps its name for the lines that report it later."""

    def __init__(self, names: Mapping[str, str] | None = None):
        self.table: dict[str, str] = dict(names or {})

    def learn(self, names: Mapping[str, str]) -> None:
        self.table.update(names)

    def name(self, node_id: str) -> str:
        """`node_id`'s name; the id itself when it was never learnt."""
        return self.table.get(node_id, node_id)

    def in_text(self, text: str) -> str:
        """`text` with every node id it holds replaced by the node's name (unknown ids stay)."""
        if not self.table or not text:
            return text
        return NODE_ID.sub(lambda m: self.table.get(m.group(0), m.group(0)), text)
