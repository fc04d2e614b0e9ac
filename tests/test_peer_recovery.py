"""Peer-memory recovery on the controller's side, without Ray: k follows what the
copies cost the job's pace, a keeper's refusal is said once with its node and budget,
a later loss says why no newer copy was kept, and the step offered is pinned."""

from __future__ import annotations

import pytest

from spotline import constants
from spotline.config import load_spec
from spotline.controller.recovery import MEASURE, PeerBook, PeerRecovery, peer_interval

pytestmark = pytest.mark.unit


def _spec(**recovery):
    return load_spec({"name": "peer", "recovery": recovery})


def test_k_is_the_smallest_interval_within_the_cost_budget():
    assert peer_interval(0.02, 1.0, 0.02) == 1
    assert peer_interval(0.021, 1.0, 0.02) == 2
    assert peer_interval(0.5, 0.1, 0.02) == 250
    assert peer_interval(0.5, 0.0, 0.02) == 1


def _pace(first: int, last: int, t0: float, step_s: float = 0.5, slow: dict | None = None):
    """(step, loss, seconds, wall end) of steps first..last, each `step_s` of wall time
    unless `slow` gives it more."""
    out, t = [], t0
    for step in range(first, last + 1):
        t += (slow or {}).get(step, step_s)
        out.append((step, 2.0, step_s, t))
    return out


def _copy(step: int, started: float, ended: float, world: int = 2, **extra) -> list[dict]:
    taken = [{"step": step, "rank": r, "blocked_s": 0.01, "taken": True, "started": started}
             for r in range(world)]  # fmt: skip
    sent = [{"step": step, "rank": r, "nbytes": 100 + r, "total_s": ended - started,
             "ended": ended, "kept_by": 2, "keepers": 2, "with_save": False} | extra
            for r in range(world)]  # fmt: skip
    return taken + sent


def test_the_book_prices_a_copy_by_what_it_slowed_the_jobs_steps(monkeypatch):
    monkeypatch.setattr(constants, "SPOTLINE_PEER_WARM_STEPS", 10)
    book = PeerBook(_spec())
    assert book.run_every() == MEASURE
    # The group's ten warm-up steps take 2 s each and are nobody's pace. Then steps of
    # 0.5 s; the measuring copy begins after step 11 (wall 20.5) and ends at 21.2: step
    # 12 took 0.9 s instead of 0.5, so the job lost 0.4 s to it.
    warm = _pace(1, 10, 0.0, step_s=2.0)
    pace = _pace(11, 15, warm[-1][3], slow={12: 0.9})
    # Three steady steps untouched by the copy are no pace yet: not priced.
    assert book.take(_copy(11, 20.5, 21.2), 2, warm + pace) is None
    assert book.costs == [] and book.k is None
    later = _pace(16, 30, pace[-1][3])
    # k: 0.4 s of a 0.5 s step at a 1% budget: every 80 steps.
    assert book.take([], 2, later) == 80
    assert book.costs == [pytest.approx(0.4)] and book.base_step_s == pytest.approx(0.5)
    assert book.settled == 11 and book.rank_bytes == {0: 100, 1: 101}
    # A copy that costs a little more moves k by less than a quarter: nothing to ask.
    t = later[-1][3]
    assert book.take(_copy(31, t, t + 0.1), 2, _pace(31, 40, t, slow={31: 0.95})) is None
    assert book.k == 80
    summary = book.summary()
    assert summary["every_steps"] == 80 and summary["copies"] == 2
    # A copy a rank skipped (its upload thread still busy with a save) is not a copy.
    skipped = [{"step": 46, "rank": r, "taken": False} for r in (0, 1)]
    assert book.take(skipped, 2, []) is None and book.skipped == 2


def test_a_checkpoints_own_files_count_as_copies_but_never_price_k():
    book = PeerBook(_spec())
    pace = _pace(1, 20, 0.0, slow={11: 9.0})
    assert book.take(_copy(10, 5.0, 14.0, with_save=True), 2, pace) is None
    assert book.copies == 1 and book.costs == [] and book.k is None
    # Not kept by every keeper: the step is a copy, but nothing older may be dropped.
    book.take(
        _copy(20, 100.0, 100.1)[:2] + [dict(r, kept_by=1) for r in _copy(20, 0, 0)[2:]], 2, []
    )
    assert book.copies == 2 and book.settled == 10


def test_fixed_and_disabled_intervals():
    fixed = PeerBook(_spec(peer_interval_steps=3))
    assert fixed.run_every() == 3
    assert fixed.take(_copy(3, 1.0, 5.0, world=1), 1, _pace(1, 20, 0.0)) is None
    assert fixed.run_every() == 3
    off = PeerBook(_spec(peer_snapshots=False))
    assert off.run_every() == 0 and off.summary() is None
    with pytest.raises(Exception, match="peer_interval_steps is 0"):
        _spec(peer_interval_steps=0)


class _Peers:
    """The surface of `spotline.runtime.peers.PeerMemory` the controller's side uses,
    with what a loss would find in the keepers set by the test."""

    def __init__(self):
        from spotline.planning.peer_memory import LEVELS

        self.level = LEVELS[0]
        self.found: dict = {}  # attempt -> PeerOffer
        self.pinned: list[tuple[str, int]] = []

    def take_changes(self):
        return []

    def offer(self, attempt, world, partition, at=None, leaving=frozenset()):
        return self.found.get(attempt)

    def hold(self, attempt, step):
        self.pinned.append((attempt, step))

    def settle(self, attempt, step):
        pass

    def refit(self, nodes, sizes):
        pass


class _Group:
    attempt, world_size = "g1", 2

    def worker_info(self):
        return [{"node_id": "n0"}, {"node_id": "n1"}]

    def request(self, **_):
        pass


def _refused(step: int, node: str = "n1") -> list[dict]:
    why = (f"node {node}'s state keeper cannot take rank 1's copy of step {step} (1.0 MB, "
           "and as much again in Ray's object store while it arrives): it holds 2.0 MB and "
           "its budget is 3.0 MB (recovery.peer_memory)")  # fmt: skip
    return [
        {"step": step, "rank": 0, "nbytes": 10, "ended": 1.0, "kept_by": 2, "keepers": 2},
        {"step": step, "rank": 1, "nbytes": 10, "ended": 1.0, "kept_by": 1, "keepers": 2,
         "not_kept": [f"{node}: KeeperFull"], "refused": {"node": node, "why": why}},
    ]  # fmt: skip


def test_a_refusal_is_said_once_and_a_later_loss_says_no_copy_was_kept():
    from spotline.checkpoint.peer import PeerOffer
    from spotline.controller.snapshot import Attempt

    said: list[str] = []
    peers = _Peers()
    rec = PeerRecovery(_spec(peer_interval_steps=4), peers, lambda text, *a, **k: said.append(text))
    ok = [dict(r, kept_by=2, not_kept=None, refused=None) for r in _refused(4)]
    rec.take(ok, _Group(), [])
    for step in (8, 12):
        rec.take(_refused(step), _Group(), [])
    refusals = [s for s in said if "cannot take" in s]
    assert len(refusals) == 1, said  # once, with the node, the budget, and the fix
    assert refusals[0].startswith("peer memory: node n1's state keeper cannot take rank 1's")
    assert "budget is 3.0 MB (recovery.peer_memory)" in refusals[0]
    assert "raise recovery.peer_memory" in refusals[0]
    # The group is lost: its step 4 is still complete, 8 and 12 were never kept.
    peers.found["g1"] = PeerOffer(4, "g1", manifest=None)
    offer = rec.offer([Attempt(replicas=2, attempt="g1", device="cpu")], {}, 0)
    assert offer.step == 4 and peers.pinned == [("g1", 4)]  # pinned before any placement
    (why,) = [s for s in said if "restoring" in s]
    assert "the keepers did not take step 12" in why and "KeeperFull" in why
    assert "lost together" not in why and why.endswith("if a keeper refused it")


def test_a_kept_step_gone_from_live_memory_is_a_rank_and_its_buddy_lost_together():
    from spotline.controller.snapshot import Attempt

    said: list[str] = []
    peers = _Peers()
    rec = PeerRecovery(_spec(peer_interval_steps=4), peers, lambda text, *a, **k: said.append(text))
    rec.take([dict(r, kept_by=2, not_kept=None, refused=None) for r in _refused(8)], _Group(), [])
    # Nothing complete in live memory; a group lost while starting is passed over.
    attempts = [Attempt(replicas=2, attempt="g1", device="cpu"), Attempt(replicas=1, attempt="g2")]
    assert rec.offer(attempts, {}, 0) is None and peers.pinned == []
    assert any("peer copy of step 8" in s and "lost together" in s for s in said), said


def test_a_keepers_reservation_follows_the_groups_share():
    from spotline.runtime.peers import _reserves

    assert _reserves(100 << 20, 100 << 20) and _reserves(150 << 20, 100 << 20)
    assert not _reserves(100 << 20, 101 << 20)  # the group's share outgrew it
    assert not _reserves(300 << 20, 100 << 20)  # it shrank to a third: reserve less
    assert _reserves(3 << 19, 600_000)  # within a MiB: not worth a new keeper
