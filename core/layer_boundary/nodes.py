"""Which node each rank runs on, decided identically on every rank of a group.

A node here is what can share memory with peers: the unit the FlashInfer workspace (peer memory
over NVLink/PCIe) and any node-local group need. A rank's node key is, in order:

1. `LAYER_BOUNDARY_NODE_ID` when set: a launcher or engine that knows better says so (set it
   per node, the same on every rank of a node);
2. otherwise the hostname and the kernel's boot id (NCCL's host hash is built the same way:
   two containers of one machine share a boot id, two machines never do), joined under
   torchrun with the launching agent's node rank (`GROUP_RANK`, one agent per node, within
   one `TORCHELASTIC_RUN_ID`).

Hostnames alone are not enough: containers and network namespaces often keep one hostname on
different "nodes", and clusters reuse short hostnames. The agent's node rank separates ranks
that torchrun itself placed on different nodes, even where hostnames agree (two network
namespaces of one machine, as `scripts/two_nodes.sh` runs them). Two keys can only err on the
safe side: ranks with different keys are treated as different nodes, so a peer-memory path is
turned off, never turned on where it cannot work.

Every decision is made from one all_gather of the keys' hashes (`node_layout`), so all ranks
of the group see the same table and reach the same answer; no rank decides from its own key.
"""

from __future__ import annotations

import hashlib
import os
import socket
from typing import Optional

import attrs
import torch

__all__ = ["NODE_ENV", "NodeLayout", "node_key", "node_hash", "node_layout"]

#: an explicit node identity (any string), the same on every rank of one node
NODE_ENV = "LAYER_BOUNDARY_NODE_ID"
_BOOT_ID = "/proc/sys/kernel/random/boot_id"


def _boot_id() -> str:
    try:
        with open(_BOOT_ID) as f:
            return f.read().strip()
    except OSError:
        return ""


def node_key(env: Optional[dict] = None) -> str:
    """This process's node identity (see the module notes); `env` defaults to os.environ."""
    env = os.environ if env is None else env
    explicit = (env.get(NODE_ENV) or "").strip()
    if explicit:
        return f"explicit:{explicit}"
    key = f"host:{socket.gethostname()}|boot:{_boot_id()}"
    if env.get("GROUP_RANK") is not None and env.get("TORCHELASTIC_RUN_ID") is not None:
        key += f"|torchrun:{env['TORCHELASTIC_RUN_ID']}:{env['GROUP_RANK']}"
    return key


def node_hash(env: Optional[dict] = None) -> int:
    """The node key as a non-negative int64 (what the ranks exchange)."""
    digest = hashlib.blake2b(node_key(env).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & 0x7FFF_FFFF_FFFF_FFFF


@attrs.frozen
class NodeLayout:
    """The node of every member of a group (nodes numbered by their first member), the same
    object on every rank."""

    nodes: tuple[int, ...]

    @property
    def count(self) -> int:
        return len(set(self.nodes))

    @property
    def single_node(self) -> bool:
        return self.count == 1

    def local_members(self, member: int) -> tuple[int, ...]:
        """The group members (group ranks) on the same node as `member`: its node-local group."""
        return tuple(i for i, n in enumerate(self.nodes) if n == self.nodes[member])

    def groups(self) -> tuple[tuple[int, ...], ...]:
        """Every node-local group, in node order."""
        return tuple(tuple(i for i, n in enumerate(self.nodes) if n == node) for node in range(self.count))

    @classmethod
    def from_hashes(cls, hashes) -> "NodeLayout":
        index: dict[int, int] = {}
        return cls(tuple(index.setdefault(int(h), len(index)) for h in hashes))


def node_layout(group, key: Optional[int] = None) -> NodeLayout:
    """The node layout of `group` (a `Collectives`), from one all_gather of every member's
    `node_hash()` (or `key`): collective, call on every rank of the group."""
    mine = torch.tensor([[node_hash() if key is None else key]], dtype=torch.int64, device=getattr(group, "device", "cpu"))
    return NodeLayout.from_hashes(group.all_gather(mine).reshape(-1).tolist())
