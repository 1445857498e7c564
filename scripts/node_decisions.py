#!/usr/bin/env python3
"""The node-aware decisions of every rank, run under torchrun (by `scripts/two_nodes.py`, or by
hand on real nodes): `torchrun --nnodes N ... scripts/node_decisions.py`.

Each rank builds two layouts of the world: TP inside a node with one pipeline stage per node
(tp = world / 2, pp = 2), and one TP group over the whole world (tp = world). For every group it
records the node layout (`layer_boundary.nodes.node_layout`) and, when the flashinfer plugin is
installed, what its workspace manager decides for the group (`GroupWorkspace.ensure`, with a
host-memory stand-in for the device library, so the one-node rule itself decides). Rank 0
gathers every rank's view and prints them as one JSON list; the caller checks that the members
of each group agree and that the answers match the placement.
"""

from __future__ import annotations

import json

import torch
import torch.distributed as dist

from layer_boundary import Parallel, Topology
from layer_boundary.nodes import node_key, node_layout


class HostBackend:
    """The flashinfer workspace protocol over nothing: probing, sizing and creating always
    succeed, so only the group-level rules (one node, same settings) can refuse."""

    name = "host"
    device_type = "cpu"

    def placement_reason(self, tensor):
        return None

    def probe(self, device, group):
        return None

    def required_bytes(self, spec, world):
        return 1 << 10

    def free_bytes(self, device):
        return 1 << 40

    def create(self, spec, group, device):
        return object()

    def sufficient(self, workspace, spec, world):
        return False

    def quiesce(self, device):
        pass

    def destroy(self, workspace):
        pass


def flashinfer_decision(group):
    try:
        from layer_boundary_flashinfer.workspace import WorkspaceManager, WorkspaceSpec
    except ImportError:
        return None
    manager = WorkspaceManager(HostBackend())
    result = manager.slot(group, torch.float32, "cpu").ensure(WorkspaceSpec(16, 64, torch.float32), None)
    manager.shutdown()
    return {"available": result.available, "action": result.action, "reason": result.reason}


def views(parallel) -> dict:
    out = {}
    for name in ("tp", "pp"):
        group = parallel.groups[name]
        layout = node_layout(group)
        out[name] = {
            "ranks": list(group.ranks),
            "nodes": list(layout.nodes),
            "node_local": list(layout.local_members(group.rank)),
            "flashinfer": flashinfer_decision(group) if group.size > 1 else None,
        }
    return out


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mine = {"rank": rank, "node_key": node_key(), "layouts": {}}
    for tp in (world // 2, world):
        topology = Topology(tp=tp, pp=world // tp)
        mine["layouts"][f"tp{tp}xpp{world // tp}"] = views(Parallel.from_torch(topology))
    gathered = [None] * world if rank == 0 else None
    dist.gather_object(mine, gathered, dst=0)
    if rank == 0:
        print(json.dumps(gathered))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
