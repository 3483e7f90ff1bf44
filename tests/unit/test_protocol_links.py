"""The multi-rank protocol's links over an in-memory store: each role's calls meet the other end's, and a batch
leaves no key behind once rank 0 has its report."""

from __future__ import annotations

import pytest

torch_dist = pytest.importorskip("torch.distributed")

from diffuserve.executor.channel import ChannelClosed, StoreChannel  # noqa: E402
from diffuserve.executor.protocol import (  # noqa: E402
    BatchMessage,
    BatchReport,
    CallMessage,
    RankLink,
    ReplicaLink,
    StepMessage,
)
from diffuserve.sampling import SamplingParams  # noqa: E402


def _channel() -> tuple[StoreChannel, object]:
    store = torch_dist.HashStore()
    return StoreChannel(store), store


def test_a_remote_batch_round_trip_relays_progress_and_cancel_and_cleans_up():
    channel, store = _channel()
    rank0, leader = ReplicaLink(channel, 1), ReplicaLink(channel, 1)
    rank0.post_batch(BatchMessage(seq=0, kind="batch", request_ids=("a",), params=(SamplingParams(prompt="x"),)))
    message = leader.receive_batch(0, keep_waiting=lambda: True)
    assert message.request_ids == ("a",) and message.params[0].prompt == "x"
    assert rank0.read_progress(0) == (0, 0)
    leader.report_progress(0, 0, 4)
    leader.report_progress(0, 1, 4)
    assert rank0.read_progress(0) == (2, 4)
    assert not leader.cancelled(0)
    rank0.request_cancel(0)
    assert leader.cancelled(0) and not ReplicaLink(channel, 2).cancelled(0)
    assert rank0.poll_report(0) is None
    leader.post_report(BatchReport(seq=0, inference_seconds=1.5))
    report = rank0.poll_report(0)
    assert report is not None and report.inference_seconds == 1.5
    assert store.num_keys() == 0, "the batch's keys outlived its report"


def test_calls_and_acks_reach_each_follower_and_a_missing_ack_times_out():
    channel, _ = _channel()
    link = ReplicaLink(channel, 0)
    link.post_call(1, CallMessage(seq=0, kind="call", params=(SamplingParams(prompt="y"),)))
    link.post_call(2, StepMessage(seq=0, rows=("a",)))
    assert isinstance(link.receive_call(0, 1, keep_waiting=lambda: True), CallMessage)
    assert link.receive_call(0, 2, keep_waiting=lambda: True).rows == ("a",)
    link.post_ack(0, 1, ("ok", 0.01))
    assert link.receive_ack(0, 1, keep_waiting=lambda: True, timeout_s=5) == ("ok", 0.01)
    with pytest.raises(ChannelClosed):
        link.receive_ack(0, 2, keep_waiting=lambda: False, timeout_s=5)


def test_rank_link_keeps_descriptions_and_faults_and_counts_heartbeats():
    channel, _ = _channel()
    ranks = RankLink(channel)
    assert ranks.rank_info(1) is None and ranks.fault(1) is None and ranks.heartbeats(1) == 0
    ranks.publish_rank(1, {"rank": 1, "pid": 7})
    ranks.beat(1)
    ranks.beat(1)
    ranks.report_fault(1, "RuntimeError: boom")
    assert ranks.rank_info(1) == {"rank": 1, "pid": 7} and ranks.rank_info(1) is not None  # kept, not consumed
    assert ranks.heartbeats(1) == 2 and ranks.fault(1) == "RuntimeError: boom" and ranks.fault(1) is not None
    ranks.say_bye(1)
    ranks.wait_bye(1, timeout_s=5)
