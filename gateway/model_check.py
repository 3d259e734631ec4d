"""Which workers serve this gateway's model: each heartbeat names what its worker serves (a
fingerprint, shared/model_fingerprint.py), and a worker serving anything else is refused, once per
incarnation, with a log line naming both models. Frames from a refused incarnation are dropped."""
from __future__ import annotations

import logging
from pathlib import Path

from protos import worker_pb2
from shared.model_fingerprint import model_fingerprint, scheme_of

log = logging.getLogger(__name__)


class ModelCheck:
    def __init__(self, model_dir: str):
        self.model_name = Path(model_dir).name
        self.fingerprint = model_fingerprint(model_dir)
        self._refused: dict[str, str] = {}  # worker id -> the incarnation refused

    def admits(self, envelope: worker_pb2.Envelope) -> tuple[bool, bool]:
        """(whether to take this frame, whether it just refused the worker)."""
        worker_id, incarnation = envelope.worker_id, envelope.incarnation
        if envelope.WhichOneof("body") != "heartbeat":
            return self._refused.get(worker_id) != incarnation, False
        if envelope.heartbeat.model_fingerprint == self.fingerprint:
            self._refused.pop(worker_id, None)
            return True, False
        if self._refused.get(worker_id) == incarnation:
            return False, False
        self._refused[worker_id] = incarnation
        theirs = envelope.heartbeat.model_fingerprint
        if theirs and scheme_of(theirs) != scheme_of(self.fingerprint):
            log.error("refusing %s (incarnation %s): it fingerprints its model by scheme %s, this gateway by %s, so "
                      "the two cannot tell whether they serve one model: run the same version of this project on "
                      "both; it gets no work", worker_id, incarnation, scheme_of(theirs), scheme_of(self.fingerprint))
            return False, True
        log.error("refusing %s (incarnation %s): it serves %s (fingerprint %s), this gateway serves %s "
                  "(fingerprint %s); it gets no work", worker_id, incarnation,
                  envelope.heartbeat.model_name or "an unnamed model", theirs or "none", self.model_name,
                  self.fingerprint)
        return False, True
