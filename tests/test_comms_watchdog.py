"""In-place recovery on NCCL, as far as it can be checked without a GPU: how long a
restart waits for survivors follows the backend; a rank whose abort or whose process
group's destroy hangs reports it (its process is never kept) instead of holding the
thread that asked; torch's NCCL error handling is left to the rank's own abort; and the
controller cordons the node of a rank whose abort hung, whichever way the news came.

NCCL does not run here: aborts and destroys are injected functions that block, and the
controller runs against the fakes of `controller_fakes`.
"""

from __future__ import annotations

import logging
import runpy
import threading

import pytest

from controller_fakes import FakeGroup, make
from spotline import constants
from spotline.config import load_spec
from spotline.train import process
from spotline.train.comms import (
    NCCL_ERROR_HANDLING,
    Cut,
    NcclAbort,
    reform_grace_s,
    settle_nccl_error_handling,
)
from spotline.train.watch import CommsHung

pytestmark = pytest.mark.unit

_ABORT = "aborting its NCCL communicators"


@pytest.fixture
def blocked():
    """An event that blocking fakes wait on; set at the end, so their threads finish."""
    release = threading.Event()
    yield release
    release.set()


# --- how long a restart waits, by backend ---------------------------------------------


def test_the_grace_follows_the_backend_unless_the_spec_sets_one():
    assert load_spec(None, {}).recovery.reform_grace_s is None  # by backend
    gloo, nccl = reform_grace_s("gloo"), reform_grace_s("nccl")
    assert gloo == constants.SPOTLINE_REFORM_GRACE_GLOO_S == 2.0
    assert nccl == constants.SPOTLINE_REFORM_GRACE_NCCL_S
    # A hung NCCL abort is reported before the restart stops waiting for it.
    assert nccl > constants.SPOTLINE_COMM_ABORT_TIMEOUT_S
    assert reform_grace_s("nccl", 5.0) == reform_grace_s("gloo", 5.0) == 5.0
    spec = load_spec(None, {"recovery": {"reform_grace_s": 7}})
    assert reform_grace_s("nccl", spec.recovery.reform_grace_s) == 7.0


def test_each_grace_and_watchdog_is_overridden_by_its_environment_variable(monkeypatch):
    names = (
        "SPOTLINE_REFORM_GRACE_GLOO_S",
        "SPOTLINE_REFORM_GRACE_NCCL_S",
        "SPOTLINE_COMM_ABORT_TIMEOUT_S",
        "SPOTLINE_COMM_DESTROY_TIMEOUT_S",
    )
    for i, name in enumerate(names):
        monkeypatch.setenv(name, str(100 + i))
    fresh = runpy.run_path(constants.__file__)  # the module as a process would load it
    assert [fresh[name] for name in names] == [100.0, 101.0, 102.0, 103.0]
    for name in names:  # and what the code reads at the moment it asks
        monkeypatch.setattr(constants, name, fresh[name])
    assert (reform_grace_s("gloo"), reform_grace_s("nccl")) == (100.0, 101.0)


# --- the abort reports a hang; the rank is never kept ----------------------------------


def _worker(comms):
    """A rank's actor as its failure paths see it, without Ray."""
    from spotline.runtime.actor import TrainWorker
    from spotline.train.process import Topology

    w = TrainWorker.__new__(TrainWorker)
    w.topo = Topology(1, 4, 3)
    w.attempt = "att1"
    w._node_id = "node-7"
    w._comms = comms
    w._sticky = None
    w._hung = None
    w.trainer = None
    w.channel = None
    w.uploader = type("Uploads", (), {"close": lambda self: None})()
    return w


def test_a_rank_whose_abort_hangs_reports_it_and_never_re_forms(blocked):
    comms = NcclAbort(3, "node-7", abort_groups=blocked.wait, timeout_s=0.05)
    w = _worker(comms)
    cut = w.abort_comms("att1")  # what the restart asks every rank it may keep
    assert cut.n == 0 and isinstance(cut.hung, CommsHung) and w._hung is cut.hung
    assert cut.hung.rank == 3 and cut.hung.node == "node-7" and _ABORT in str(cut.hung)
    assert w.abort_comms("att0") == Cut()  # a group it already left: nothing to cut
    with pytest.raises(CommsHung) as raised:
        w.reform(w.topo, "att2")
    assert raised.value is cut.hung


def test_a_step_that_fails_and_whose_abort_hangs_raises_the_hang_naming_the_step(blocked):
    from spotline.config.schema import JobSpec
    from spotline.runtime.actor import _Requests

    w = _worker(NcclAbort(3, "node-7", abort_groups=blocked.wait, timeout_s=0.05))
    w.spec, w._lock, w._req = JobSpec(), threading.Lock(), _Requests()
    w.trainer = type("Tr", (), {"step": 40})()
    w._export_devices = lambda: None
    step_error = RuntimeError("NCCL error: remote process exited or there was a network error")

    def train(*_):
        raise step_error

    w._train = train
    with pytest.raises(CommsHung) as raised:
        w.run(100)
    hung = raised.value
    assert hung.__cause__ is step_error and "remote process exited" in str(hung)
    assert (hung.rank, hung.node) == (3, "node-7") and w._hung is not None


def test_a_step_that_fails_with_an_abort_that_returns_keeps_its_own_error():
    w = _worker(NcclAbort(3, "node-7", abort_groups=lambda: True, timeout_s=5.0))
    from spotline.config.schema import JobSpec
    from spotline.runtime.actor import _Requests

    w.spec, w._lock, w._req = JobSpec(), threading.Lock(), _Requests()
    w.trainer = type("Tr", (), {"step": 40})()
    w._export_devices = lambda: None
    step_error = RuntimeError("NCCL communicator was aborted on rank 3.")

    def train(*_):
        raise step_error

    w._train = train
    with pytest.raises(RuntimeError) as raised:
        w.run(100)
    assert raised.value is step_error and w._hung is None


# --- the destroy of the old process group, at a re-form ---------------------------------


def test_a_destroy_that_hangs_fails_the_re_form_and_the_rank_is_never_used_again(
    monkeypatch, blocked
):
    destroys = []

    def destroy():
        destroys.append(threading.current_thread().name)
        blocked.wait()

    monkeypatch.setattr(process.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(process.dist, "destroy_process_group", destroy)
    monkeypatch.setattr(constants, "SPOTLINE_COMM_DESTROY_TIMEOUT_S", 0.05)
    w = _worker(None)
    with pytest.raises(CommsHung) as raised:
        w.reform(w.topo, "att2")
    hung = raised.value
    assert (hung.rank, hung.node) == (3, "node-7")
    assert "destroying its old process group" in str(hung)
    assert "SPOTLINE_COMM_DESTROY_TIMEOUT_S" in str(hung)
    assert destroys == ["spotline-destroy-3"]  # on a thread of its own
    with pytest.raises(CommsHung):  # asked again: refused at once, nothing destroyed
        w.reform(w.topo, "att3")
    assert len(destroys) == 1


def test_a_destroy_that_returns_leaves_the_group_as_before():
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    process.leave_distributed(0, "node-7", timeout_s=60.0)
    assert not dist.is_initialized()
    process.leave_distributed(0, "node-7")  # nothing left to destroy: fine


def test_an_error_of_the_destroy_itself_is_raised_as_it_was(monkeypatch):
    def destroy():
        raise ValueError("Invalid process group specified")

    monkeypatch.setattr(process.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(process.dist, "destroy_process_group", destroy)
    with pytest.raises(ValueError, match="Invalid process group"):
        process.leave_distributed(0, "node-7", timeout_s=60.0)


# --- torch's NCCL error handling ------------------------------------------------------


def test_torch_leaves_the_abort_to_the_rank_unless_the_user_chose():
    env: dict[str, str] = {}
    assert settle_nccl_error_handling(env) is None
    assert env == {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "0"}
    env = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "0"}
    assert settle_nccl_error_handling(env) is None and env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "0"


@pytest.mark.parametrize(
    "name, mode, says",
    [
        ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2", "at the same moment"),
        ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1", "keeps no NCCL rank"),
        ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3", "keeps no NCCL rank"),
        ("NCCL_ASYNC_ERROR_HANDLING", "2", "at the same moment"),  # torch's older name
        ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "yes", "not one of torch's modes"),
    ],
)
def test_a_mode_the_user_set_is_kept_and_one_against_in_place_is_said(name, mode, says):
    env = {name: mode}
    said = settle_nccl_error_handling(env)
    assert env == {name: mode}  # never overridden, the older name included
    assert said is not None and says in said and f"{name}=" in said
    assert "unset it" in said


def test_the_first_name_torch_reads_wins():
    env = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "0", "NCCL_ASYNC_ERROR_HANDLING": "1"}
    assert settle_nccl_error_handling(env) is None
    assert NCCL_ERROR_HANDLING[0] == "TORCH_NCCL_ASYNC_ERROR_HANDLING"


# --- the controller cordons the node ----------------------------------------------------


def _events(ctl):
    return ctl.door.status()["events"]


def _said(ctl, *words):
    return [e for e in _events(ctl) if all(w in str(e) for w in words)]


def test_a_node_whose_abort_hung_at_the_hand_over_is_cordoned_and_its_ranks_not_kept(
    tmp_path,
):
    script = {"kill_at": 17, "lose_node": "node-1", "abort_hung": "node-0"}
    ctl, _ = make(tmp_path, script, capacity=2)
    res = ctl.run()
    assert res["state"] == "finished", res["error"]
    first, second = FakeGroup.instances[:2]
    assert first.handed == {"node-1"} and first.survivors_out.nodes == []
    assert "node-0" in ctl.fake_cluster.cordoned
    assert "node-0" not in second.node_ids()
    assert _said(ctl, "cordoned node node-0", _ABORT)
    assert res["failures"] == 0 and res["node_losses"] == 1  # the loss is still weather


def test_a_node_named_by_a_ranks_hung_abort_or_destroy_is_cordoned(tmp_path):
    for what in (_ABORT, "destroying its old process group"):
        hung = CommsHung(2, "node-1", what, 30.0, "SPOTLINE_COMM_ABORT_TIMEOUT_S")
        step = RuntimeError("NCCL error: remote process exited")
        ctl, _ = make(tmp_path / what[:5], {"kill_at": 17, "cause": hung.after(step)}, 2)
        res = ctl.run()
        assert res["state"] == "finished", res["error"]
        assert "node-1" in ctl.fake_cluster.cordoned
        assert "node-1" not in FakeGroup.instances[1].node_ids()
        assert len(_said(ctl, "cordoned node node-1", f"rank 2 there: {what}")) == 1
        assert res["failures"] == 1  # a transient failure, not a hang counted twice


def test_with_cordons_off_a_hung_abort_is_said_and_nothing_is_cordoned(tmp_path):
    script = {"kill_at": 17, "lose_node": "node-1", "abort_hung": "node-0"}
    ctl, _ = make(tmp_path, script, capacity=2, **{"failure.cordon": False})
    assert ctl.run()["state"] == "finished"
    assert not len(ctl.fake_cluster.cordoned)
    assert _said(ctl, "node node-0", "not cordoned (failure.cordon is off)")


def test_an_abort_that_fails_is_said_once_whoever_asks(caplog):
    def abort():
        raise RuntimeError("NCCL error: invalid usage")

    comms = NcclAbort(2, "node-7", abort_groups=abort, timeout_s=5.0)
    with caplog.at_level(logging.WARNING, logger="spotline.comms"):
        assert comms.abort() == comms.abort() == Cut()  # the step's path, the restart's
    assert caplog.text.count("failed (RuntimeError: NCCL error: invalid usage)") == 1
    assert comms.hung is None


def test_an_abort_without_a_thread_to_run_on_fails_instead_of_hanging(monkeypatch):
    def no_thread(self):
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(threading.Thread, "start", no_thread)
    comms = NcclAbort(2, "node-7", abort_groups=lambda: True, timeout_s=5.0)
    assert comms.abort() == comms.abort() == Cut()
    assert comms.hung is None
