"""A client id reused the moment its request was cancelled names a new request, and only the new one:
nothing of the old request (a late token, its abort) reaches it.

Against a real one-worker cluster: a long stream runs, is cancelled (by the client, or by Abort
with its id), and a short greedy request with the same id follows at once; it must give exactly
the tokens it gives alone and end by length. 500 times, from two clients at once.
"""
from __future__ import annotations

import asyncio
import threading
import time

import grpc
import pytest

from cluster_harness import Cluster, generate
from gateway.dispatcher import Dispatcher
from gateway.request_table import DuplicateRequestError, RequestTable
from gateway.streams import RequestState
from protos import inference_pb2, worker_pb2
from shared.config import load_config
from shared.sampling_params import SamplingParams

pytestmark = pytest.mark.timeout(300)

ROUNDS_PER_CLIENT = 250
TIME_LIMIT_S = 25.0
LONG = inference_pb2.SamplingOptions(max_tokens=400, ignore_eos=True, temperature=0.0)
SHORT = dict(max_tokens=4, ignore_eos=True, temperature=0.0)
SHORT_PROMPT = [9, 10, 11]


def state(table: RequestTable, request_id: str) -> RequestState:
    return RequestState(request_id=request_id, internal_id=table.new_id(), prompt_ids=[5],
                        params=SamplingParams(), priority=0, tokenizer=None)


def test_a_client_id_names_its_request_only_while_it_lives():
    table, other = RequestTable(), RequestTable()
    old = state(table, "x")
    table.add(old)
    with pytest.raises(DuplicateRequestError):
        table.add(state(table, "x"))
    assert table.pop(old.internal_id) is old and not table.is_live("x")
    new = state(table, "x")
    table.add(new)
    assert new.internal_id != old.internal_id and table.by_client("x") is new
    # Whatever still names the old request (a late delta, a second cancel) finds nothing, and
    # forgetting it again leaves the new request's client id in place.
    assert table.get(old.internal_id) is None and table.pop(old.internal_id) is None
    assert table.by_client("x") is new and len(table) == 1
    # Another gateway process (a restart) never hands out the same internal ids.
    assert {other.new_id() for _ in range(100)}.isdisjoint({table.new_id() for _ in range(100)})


def test_a_request_of_several_sequences_holds_its_own_id_while_any_of_them_lives():
    """An HTTP request with n > 1 (or several prompts) runs as "id-0", "id-1", ...: its own id is
    taken too, in either order of arrival, until its last sequence ends."""
    table = RequestTable()
    sequences = [state(table, f"dup-{k}") for k in range(2)]
    for s in sequences:
        s.group_id = "dup"
        table.add(s)
    assert table.is_live("dup") and not table.is_live("dup", owner="another key")
    with pytest.raises(DuplicateRequestError):
        table.add(state(table, "dup"))
    table.pop(sequences[0].internal_id)
    assert table.is_live("dup")  # one sequence still runs
    table.pop(sequences[1].internal_id)
    assert not table.is_live("dup")
    table.add(state(table, "dup"))


def test_a_resumed_request_takes_a_fresh_internal_id_its_client_id_follows():
    table = RequestTable()
    resumed = state(table, "r")
    table.add(resumed)
    first = resumed.internal_id
    resumed.num_resumes = 1
    second = table.renew_id(resumed)
    resumed.num_resumes = 2
    third = table.renew_id(resumed)
    assert (second, third) == (f"{first}.1", f"{first}.2") and resumed.internal_id == third
    # The attempts before it name nothing: their late deltas are stale, not the resumed request's.
    assert table.get(first) is None and table.get(second) is None and table.get(third) is resumed
    assert table.by_client("r") is resumed and len(table) == 1
    assert table.pop(third) is resumed and not table.is_live("r")


def test_resuming_a_request_aborts_its_old_attempt_on_the_worker_it_left():
    """A worker declared dead for silence may run again: the attempt it still holds is aborted there,
    so it stops holding a slot and KV the gateway no longer counts."""
    sent: list[tuple[str, worker_pb2.Envelope]] = []

    class Socket:
        async def send(self, worker_id: str, envelope: worker_pb2.Envelope) -> bool:
            sent.append((worker_id, envelope))
            return True

    async def scenario():
        dispatcher = Dispatcher(load_config())
        dispatcher.socket = Socket()
        resumed = state(dispatcher.requests, "r")
        dispatcher.requests.add(resumed)
        first = resumed.internal_id
        resumed.worker_id = "worker-0"
        dispatcher.registry.assign("worker-0", first, 2)
        dispatcher._resume({first}, 0.0)
        await asyncio.sleep(0)
        assert [(w, list(e.abort.request_ids)) for w, e in sent] == [("worker-0", [first])]
        assert resumed.internal_id == f"{first}.1" and not dispatcher.registry.workers["worker-0"].assigned

    asyncio.run(scenario())


def reuse_once(cluster, client_id: str, abort: bool, expected: list[int], outcomes: dict) -> str | None:
    """One round: None when right, else what went wrong."""
    old = cluster.stub.Generate(inference_pb2.GenerateRequest(
        request_id=client_id, prompt_token_ids=[5, 6, 7, 8], sampling=LONG), timeout=30)
    first = next(old)  # running on the worker now
    finished_first = False
    if abort:
        try:
            cluster.stub.Abort(inference_pb2.AbortRequest(request_id=client_id), timeout=10)
        except grpc.RpcError as e:
            # On a loaded host the old request can finish all its tokens before the abort reaches
            # the gateway: then the id names nothing, NOT_FOUND is the answer, and its stream ends
            # by its length.
            if e.code() != grpc.StatusCode.NOT_FOUND:
                raise
            abort, finished_first = False, True
    else:
        old.cancel()
    wrong = None
    for _ in range(200):  # the gateway may not have seen the cancel yet: then the id is still live
        try:
            ids, _, last = generate(cluster.stub, timeout=30, request_id=client_id,
                                    prompt_token_ids=SHORT_PROMPT, sampling=SHORT)
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.ALREADY_EXISTS:
                outcomes["already_exists"] += 1
                time.sleep(0.001)
                continue
            raise
        if ids != expected or last.finish_reason != inference_pb2.FINISH_REASON_LENGTH:
            wrong = f"{inference_pb2.FinishReason.Name(last.finish_reason)} {ids}"
        break
    try:
        # An aborted stream ends by itself, with ABORT. On a loaded host the gateway may have sent
        # every token of the old request, and its end, in the one message already read.
        last_old = list(old)[-1:] or ([first] if first.finish_reason else [])
    except grpc.RpcError as e:
        if e.code() != grpc.StatusCode.CANCELLED or abort:
            raise
        last_old = []
    if abort and (not last_old or last_old[0].finish_reason != inference_pb2.FINISH_REASON_ABORT):
        wrong = wrong or f"the aborted stream did not end by its abort: {last_old}"
    if finished_first and (not last_old or last_old[0].finish_reason != inference_pb2.FINISH_REASON_LENGTH):
        wrong = wrong or f"an abort found no request, yet its stream did not end by its length: {last_old}"
    return wrong


def reuse_rounds(cluster, client_id: str, expected: list[int], deadline_s: float, outcomes: dict) -> None:
    for i in range(ROUNDS_PER_CLIENT):
        if time.monotonic() > deadline_s:
            return
        try:
            wrong = reuse_once(cluster, client_id, bool(i % 2), expected, outcomes)
        except (grpc.RpcError, StopIteration) as e:
            wrong = f"{e.code().name}: {e.details()}" if isinstance(e, grpc.RpcError) else "the stream ended at once"
        if wrong is None:
            outcomes["right"] += 1
        else:
            outcomes["wrong"].append(wrong)


def test_reused_id_after_cancel_gets_only_its_own_tokens(served_checkpoint):
    with Cluster(served_checkpoint, num_workers=1) as cluster:
        expected, _, _ = generate(cluster.stub, prompt_token_ids=SHORT_PROMPT, sampling=SHORT)
        outcomes = {"right": 0, "wrong": [], "already_exists": 0}
        deadline_s = time.monotonic() + TIME_LIMIT_S

        threads = [threading.Thread(target=reuse_rounds, args=(cluster, f"reused-{n}", expected, deadline_s, outcomes))
                   for n in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=TIME_LIMIT_S + 60)
        took_s = time.monotonic() - deadline_s + TIME_LIMIT_S
        print(f"reuse race: {outcomes['right']} right, {len(outcomes['wrong'])} wrong in {took_s:.1f} s "
              f"({outcomes['already_exists']} ALREADY_EXISTS retries)")
        assert outcomes["wrong"] == []
        assert outcomes["right"] >= 200, outcomes  # 500 on an unloaded host (~6 s); at least this many
