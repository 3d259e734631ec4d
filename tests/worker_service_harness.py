"""The worker loop driven by hand for tests: a fake routed socket, a memory reading that follows the
KV pool, a bare CURVE router in the gateway's place, and a service built around a real engine."""
from __future__ import annotations

import zmq

from cluster_harness import free_port
from protos import worker_pb2
from shared.config import load_config
from shared.curve import GATEWAY, cluster_keys_dir, load_server_keys
from shared.wire import sampling_to_wire
from worker.engine import Engine, SamplingParams
from worker.memory import MemoryReading
from worker.service import WorkerService


GREEDY = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=20, temperature=1.0, top_k=40, seed=7, ignore_eos=True)


class FakeSocket:
    """Stands in for the worker's routed socket: frames to deliver, frames sent."""

    def __init__(self):
        self.inbox: list[worker_pb2.Envelope] = []
        self.sent: list[worker_pb2.Envelope] = []
        self.closed_with_linger_ms: int | None = None

    def send(self, envelope: worker_pb2.Envelope, wait: bool = True) -> bool:
        self.sent.append(envelope)
        return True

    def recv_all(self, timeout_s: float) -> list[worker_pb2.Envelope]:
        frames, self.inbox = self.inbox, []
        return frames

    def close(self, linger_ms: int = 0) -> None:
        self.closed_with_linger_ms = linger_ms

    def deltas(self) -> list[worker_pb2.TokenDelta]:
        return [d for e in self.sent if e.WhichOneof("body") == "outputs" for d in e.outputs.deltas]

    def kv_events(self) -> list[worker_pb2.KvEvents]:
        return [e.kv_events for e in self.sent if e.WhichOneof("body") == "kv_events"]


class Pressure:
    """A memory reading of the KV pool alone plus `extra` bytes, so the level follows block use."""

    def __init__(self):
        self.pool_bytes = 0
        self.extra = 0

    def __call__(self, detailed: bool = False) -> MemoryReading:
        return MemoryReading(used_bytes=self.pool_bytes + self.extra, total_bytes=1 << 40)


def curve_router(endpoint: str) -> zmq.Socket:
    """A bare ROUTER in the gateway's place: a CURVE server with the cluster's own keys
    (<run_dir>/keys, shared/curve.py), as a worker requires on ipc://."""
    keys = load_server_keys(cluster_keys_dir(load_config(None, {}), GATEWAY))
    router = zmq.Context.instance().socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.curve_server = True
    router.curve_secretkey, router.curve_publickey = keys.secret, keys.public
    router.bind(endpoint)
    return router


def make_service(model_dir, read_memory=None, endpoint=None, engine=None, **worker) -> WorkerService:
    engine = engine or Engine.from_model_dir(model_dir, num_kv_blocks=64, block_size=4, max_num_seqs=8)
    config = load_config(None, {"model_dir": str(model_dir),
                                "gateway.worker_endpoint": endpoint or f"tcp://127.0.0.1:{free_port()}",
                                **{f"worker.{k}": v for k, v in worker.items()}})
    service = WorkerService(config, "worker-t", engine=engine, read_memory=read_memory)
    if endpoint is None:
        service.socket.close()
        service.socket = FakeSocket()
    service._loaded = True
    return service


def submit(service: WorkerService, request_id: str, prompt: list[int], params=GREEDY, priority: int = 0) -> None:
    wire = worker_pb2.WireRequest(request_id=request_id, prompt_token_ids=prompt, sampling=sampling_to_wire(params),
                                  priority=priority)
    service._handle(worker_pb2.Envelope(submit=worker_pb2.SubmitBatch(requests=[wire])))


def drain(service: WorkerService, max_steps: int = 2000) -> dict[str, list[int]]:
    for _ in range(max_steps):
        if not service.engine.has_unfinished_requests():
            break
        service.run_once()
        service.engine.check_integrity()
    tokens: dict[str, list[int]] = {}
    for d in service.socket.deltas():
        tokens.setdefault(d.request_id, []).extend(d.new_token_ids)
    return tokens


PROMPTS = {f"p{i}": [3 + i, 40 + 7 * i, 9, 100 + i, 11, 12 + i, 13, 14, 15, 16 + i] for i in range(4)}


def reference_outputs(llama_dir) -> dict:
    """Greedy outputs of PROMPTS and the seeded one of p0, from an engine alone."""
    engine = Engine.from_model_dir(llama_dir, num_kv_blocks=64, block_size=4, max_num_seqs=8)
    outs = engine.generate(list(PROMPTS.values()), GREEDY, use_tqdm=False)
    seeded = engine.generate([PROMPTS["p0"]], SEEDED, use_tqdm=False)[0]
    return {"greedy": dict(zip(PROMPTS, (o.token_ids for o in outs))), "seeded": seeded.token_ids}
