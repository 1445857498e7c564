"""Node identity and node layouts: the key's precedence and a layout every rank agrees on."""

from layer_boundary import Parallel, Topology
from layer_boundary.nodes import NODE_ENV, NodeLayout, node_hash, node_key, node_layout
from layer_boundary.testing.threaded import run_threaded


def test_the_key_prefers_an_explicit_id_then_adds_torchruns_node_rank():
    assert node_key({NODE_ENV: "rack3-node7", "GROUP_RANK": "1", "TORCHELASTIC_RUN_ID": "x"}) == "explicit:rack3-node7"
    plain = node_key({})
    assert plain.startswith("host:") and "|boot:" in plain
    # two torchrun agents on machines (or namespaces) with the same hostname and boot id
    first = node_key({"GROUP_RANK": "0", "TORCHELASTIC_RUN_ID": "job"})
    second = node_key({"GROUP_RANK": "1", "TORCHELASTIC_RUN_ID": "job"})
    assert first.startswith(plain) and first != second
    assert node_hash({"GROUP_RANK": "0", "TORCHELASTIC_RUN_ID": "job"}) != node_hash({"GROUP_RANK": "1", "TORCHELASTIC_RUN_ID": "job"})
    assert 0 <= node_hash({}) < 2**63


def test_a_layout_numbers_nodes_by_first_member_and_gives_node_local_groups():
    layout = NodeLayout.from_hashes([55, 55, 9, 9, 55])
    assert layout.nodes == (0, 0, 1, 1, 0) and layout.count == 2 and not layout.single_node
    assert layout.local_members(3) == (2, 3) and layout.local_members(4) == (0, 1, 4)
    assert layout.groups() == ((0, 1, 4), (2, 3))
    assert NodeLayout.from_hashes([3]).single_node


def test_every_rank_sees_the_same_layout():
    # rank r claims node r // 2: ranks 0-1 and 2-3 share a node; TP groups inside, PP across
    def rank(parallel):
        key = 1000 + parallel.rank // 2
        return {name: node_layout(parallel.groups[name], key=key) for name in ("tp", "pp")}

    results = run_threaded(rank, Topology(tp=2, pp=2))
    assert all(r["tp"].single_node for r in results)
    assert all(r["pp"].nodes == (0, 1) for r in results)
    assert node_layout(Parallel.single().groups["tp"]).nodes == (0,)
