"""Where ranks run: one GPU a rank (NCCL), ranks sharing GPUs (gloo, correctness only), CPU ranks."""

import os

import pytest

from layer_boundary import RankPlacement, place_ranks
from layer_boundary.launch import ProcessWorld
from layer_boundary.placement import PLACEMENT_ENV, current_placement


@pytest.mark.parametrize("ranks,gpus,backend,devices,shared", [
    (2, 2, "nccl", [0, 1], False),
    (4, 8, "nccl", [0, 1, 2, 3], False),
    (2, 1, "gloo", [0, 0], True),
    (4, 2, "gloo", [0, 1, 0, 1], True),
    (3, 0, "gloo", [None] * 3, False),
])
def test_ranks_are_placed_round_robin(ranks, gpus, backend, devices, shared):
    placement = RankPlacement(ranks, gpus)
    assert placement.backend == backend and placement.shared is shared
    assert [placement.device_of(r) for r in range(ranks)] == devices
    assert RankPlacement.decode(placement.encode()) == placement


def test_a_shared_world_says_its_timings_mean_nothing():
    assert RankPlacement(2, 1).note == "2 ranks on 1 GPU: correctness only; timings are not representative"
    assert RankPlacement(4, 2).note == "4 ranks on 2 GPUs: correctness only; timings are not representative"
    assert RankPlacement(8, 2).describe() == RankPlacement(8, 2).note
    assert RankPlacement(2, 2).note is None and RankPlacement(2, 4).describe() == "2 rank(s), one GPU each (nccl)"
    assert RankPlacement(2, 0).note is None


def test_place_ranks_counts_the_visible_gpus_or_takes_a_count():
    assert place_ranks(4, "cpu") == RankPlacement(4, 0)
    assert place_ranks(4, "cuda", gpus=1) == RankPlacement(4, 1)
    with pytest.raises(ValueError, match="device must be"):
        place_ranks(2, "tpu")
    with pytest.raises(RuntimeError, match="no CUDA device is visible"):
        place_ranks(2, "cuda", gpus=0)


def test_a_rank_reads_its_placement_from_the_launcher_or_torchrun(monkeypatch):
    monkeypatch.delenv(PLACEMENT_ENV, raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert current_placement() is None
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert current_placement("cpu") == RankPlacement(4, 0)
    monkeypatch.setenv(PLACEMENT_ENV, "2x1")
    assert current_placement() == RankPlacement(2, 1)


def test_the_launcher_refuses_nccl_where_ranks_share_a_gpu():
    with pytest.raises(ValueError, match="NCCL needs one GPU a rank, and 2 ranks share 1 GPU"):
        ProcessWorld(2, backend="nccl", device="cuda", gpus=1)
    world = ProcessWorld(2, device="cuda", gpus=1)  # not started: placement only
    assert world.backend == "gloo" and world.note.startswith("2 ranks on 1 GPU")
    assert ProcessWorld(2).backend == "gloo" and ProcessWorld(2).note is None


def _rank_facts(rank):
    import os

    return os.environ.get(PLACEMENT_ENV)


@pytest.mark.gloo
def test_cpu_ranks_get_their_placement():
    with ProcessWorld(2, timeout=60) as world:
        assert world.run(_rank_facts, None) == ["2x0", "2x0"]


def test_a_shared_setting_is_applied_by_the_first_rank_in_and_restored_by_the_last_out(monkeypatch):
    import threading

    from layer_boundary.testing import shared_env

    monkeypatch.delenv("LB_SHARED_TEST", raising=False)
    changes = []
    setting = shared_env("LB_SHARED_TEST", "on", after=lambda: changes.append(os.environ.get("LB_SHARED_TEST")))
    inside, leave = threading.Barrier(3), threading.Event()
    seen = []

    def rank():
        with setting:
            inside.wait()
            leave.wait()
            seen.append(os.environ.get("LB_SHARED_TEST"))

    threads = [threading.Thread(target=rank) for _ in range(2)]
    for t in threads:
        t.start()
    inside.wait()
    assert os.environ["LB_SHARED_TEST"] == "on"
    leave.set()
    for t in threads:
        t.join()
    assert seen == ["on", "on"] and "LB_SHARED_TEST" not in os.environ and changes == ["on", None]
