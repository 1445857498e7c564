"""The workspace life cycle per reduction group: created once, reused while large enough,
rebuilt when not (unbinding what was bound to the old one), a memory preflight, released in
lock-step, and one availability answer for the whole group: any rank failing turns it off on
all ranks, before any rank enters the rendezvous where it can."""

import threading

import pytest
import torch

from flashinfer_fakes import ReferenceBackend, on_off_run
from layer_boundary import Topology
from layer_boundary.testing.threaded import run_threaded
from layer_boundary_flashinfer import workspace as workspace_module
from layer_boundary_flashinfer.backend import workspace_bytes
from layer_boundary_flashinfer.workspace import PREFLIGHT_HEADROOM_BYTES, WorkspaceManager, WorkspaceSpec

SPEC = WorkspaceSpec(64, 32, torch.float32)


class Bound:
    """Stands in for a candidate bound to a workspace."""

    def __init__(self):
        self.bound = True

    def unbind(self):
        self.bound = False


def _ensure_all(backend, specs, local_reason=None):
    """Every rank: one manager slot over tp, `ensure` each spec in turn, binding a marker after each."""

    def fn(parallel):
        manager = WorkspaceManager(backend)
        slot = manager.slot(parallel.groups["tp"], torch.float32, "cpu")
        out, markers = [], []
        for spec in specs:
            out.append(slot.ensure(spec, local_reason(parallel.rank) if local_reason else None))
            markers.append(Bound())
            if slot.available:
                slot.bind(markers[-1])
        bound_now = [m.bound and slot.available for m in markers]
        manager.shutdown()
        return out, bound_now

    return run_threaded(fn, Topology(tp=2), timeout=30)


def _events(backend, kind):
    return [e for e in backend.events if e[0] == kind]


def test_created_once_reused_while_sufficient_rebuilt_when_not():
    backend = ReferenceBackend()
    bigger = WorkspaceSpec(128, 32, torch.float32)
    smaller = WorkspaceSpec(16, 64, torch.float32)  # fewer tokens of a wider row: the same bytes fit
    results = _ensure_all(backend, [SPEC, SPEC, smaller, bigger])
    for rank, (out, bound_now) in enumerate(results):
        assert [r.action for r in out] == ["created", "reused", "reused", "rebuilt"]
        assert all(r.available for r in out) and out[0].workspace_bytes == workspace_bytes(SPEC, 2)
        assert bound_now == [False, False, False, True]  # the rebuild unbound everything bound before
    creates = _events(backend, "create")
    assert sorted(e[1] for e in creates) == [0, 0, 1, 1] and {e[2] for e in creates} == {SPEC, bigger}
    destroys = _events(backend, "destroy")  # the rebuild, then the shutdown
    assert sorted((e[1], e[2].max_tokens) for e in destroys) == [(0, 64), (0, 128), (1, 64), (1, 128)]


@pytest.mark.parametrize("where", ["probe", "preflight", "local", "create", "node"])
def test_one_rank_failing_turns_the_workspace_off_on_every_rank(where, monkeypatch):
    options = {
        "probe": dict(fail_probe={1}),
        "preflight": dict(free={1: workspace_bytes(SPEC, 2) + PREFLIGHT_HEADROOM_BYTES - 1}),
        "create": dict(fail_create={1}),
    }.get(where, {})
    backend = ReferenceBackend(**options)
    local = (lambda rank: "no provider here" if rank == 1 else None) if where == "local" else None
    if where == "node":  # rank 1 reports another host
        monkeypatch.setattr(workspace_module, "_host_id", lambda: 7 if threading.current_thread().name.endswith("1") else 3)
    results = _ensure_all(backend, [SPEC], local)
    reasons = []
    for out, bound_now in results:
        (result,) = out
        assert not result.available and result.action == "unavailable" and bound_now == [False]
        reasons.append(result.reason)
    expected = {
        "probe": "injected probe failure on rank 1",
        "preflight": "memory preflight",
        "local": "no provider here",
        "create": "injected creation failure on rank 1",
        "node": "more than one node",
    }[where]
    assert expected in reasons[1]
    if where in ("node",):
        assert expected in reasons[0]
    else:
        assert "another rank" in reasons[0]
    creates = _events(backend, "create")
    if where == "create":  # both entered the rendezvous; rank 0's part was released again
        assert sorted(e[1] for e in creates) == [0, 1]
        assert [e[1] for e in _events(backend, "destroy")] == [0]
    else:  # nobody entered the rendezvous
        assert creates == []


def test_the_one_node_rule_reads_the_cores_node_identity(monkeypatch):
    """Ranks that share a hostname but run under two torchrun agents (two nodes, or two network
    namespaces of one machine) are two nodes to the workspace."""
    from layer_boundary.nodes import node_hash

    assert workspace_module._host_id() == node_hash()
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")
    monkeypatch.setenv("GROUP_RANK", "0")
    first = workspace_module._host_id()
    monkeypatch.setenv("GROUP_RANK", "1")
    assert workspace_module._host_id() != first


def test_a_failed_rebuild_leaves_no_workspace_and_nothing_bound():
    backend = ReferenceBackend()
    calls = {"n": 0}
    real_create = backend.create

    def create(spec, group, device):
        calls["n"] += 1
        if spec.max_tokens > 64 and group.rank == 0:
            raise MemoryError("out of memory on rank 0")
        return real_create(spec, group, device)

    backend.create = create
    results = _ensure_all(backend, [SPEC, WorkspaceSpec(256, 32, torch.float32)])
    for out, bound_now in results:
        assert [r.action for r in out] == ["created", "unavailable"]
        assert "out of memory" in out[1].reason or "another rank" in out[1].reason
        assert bound_now == [False, False]
    # the old workspace was released before the rebuild on both ranks, rank 1's new part after it
    assert sorted((e[1], e[2].max_tokens) for e in _events(backend, "destroy")) == [(0, 64), (1, 64), (1, 256)]


class _RecordingGroup:
    """A one-rank view that records barriers (a release at exit must not wait for peers)."""

    name, ranks, size, rank, device = "tp", (0, 1), 2, 0, "cpu"

    def __init__(self):
        self.agreements = 0

    def agree(self, ok):
        self.agreements += 1
        return ok


def test_the_exit_hook_releases_without_waiting_for_peers():
    backend = ReferenceBackend()
    manager = WorkspaceManager(backend)
    group = _RecordingGroup()
    slot = manager.slot(group, torch.float32, "cpu")
    slot.workspace, slot.spec = backend.create(SPEC, group, "cpu"), SPEC
    marker = Bound()
    slot.bind(marker)
    manager._at_exit()
    assert group.agreements == 0 and not slot.available and not marker.bound
    assert [e[0] for e in backend.events] == ["create", "destroy"]
    manager.shutdown()  # idempotent
    assert [e[0] for e in backend.events] == ["create", "destroy"]


def test_slots_are_per_group_dtype_and_rank():
    manager = WorkspaceManager(ReferenceBackend())
    group = _RecordingGroup()
    a = manager.slot(group, torch.bfloat16, "cpu")
    assert manager.slot(group, torch.bfloat16, "cpu") is a
    assert manager.slot(group, torch.float16, "cpu") is not a


@pytest.mark.gloo
def test_gloo_a_creation_failure_on_one_rank_falls_back_on_all_ranks(gloo_world):
    results = gloo_world(2).run(on_off_run, Topology(tp=2), "qwen3", {"fail_create": {1}}, timeout=120)
    for rank, res in enumerate(results):
        report = res["report"]
        assert not report.available and not report.bound
        assert ("injected creation failure" if rank == 1 else "another rank") in report.groups[0].reason
        assert res["launches"] == {"all_reduce": 0, "finalize": 0}
        assert all(torch.equal(a, b) for a, b in zip(res["unfused"], res["fused"]))
    assert [e[0] for e in results[0]["events"]] == ["create", "destroy"]  # rank 0 released its part
    assert [e[0] for e in results[1]["events"]] == ["create"]


@pytest.mark.gloo
def test_gloo_the_agreed_fusion_runs_on_every_rank_and_changes_no_logit(gloo_world):
    results = gloo_world(2).run(on_off_run, Topology(tp=2), "qwen3_moe", {}, timeout=120)
    for res in results:
        assert res["report"].available and len(res["report"].bound) == 5 and len(res["report"].finalize) == 2
        assert res["launches"]["all_reduce"] > 0 and res["launches"]["finalize"] > 0
        assert all(torch.equal(a, b) for a, b in zip(res["unfused"], res["fused"]))
    assert results[0]["launches"] == results[1]["launches"]
    assert all(torch.equal(a, b) for a, b in zip(results[0]["fused"], results[1]["fused"]))
