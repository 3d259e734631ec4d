"""The gateway's live requests, by internal id, and the client's ids that name them while they live.

Every admission gets a fresh internal id (unique within this gateway process and across its
restarts): it is the id on the wire and in the worker, and each resumption of the request takes
another (`renew_id`). A client's `request_id` (within the
namespace of the API key that sent it: one key can neither see nor reach another's ids) points
at its request only until that request is forgotten, so a client may reuse an id at once, and nothing
addressed to the old request (a late delta, an abort) can reach the new one.
"""
from __future__ import annotations

import itertools
import uuid

from gateway.streams import RequestState


class DuplicateRequestError(KeyError):
    """A live request already has this client id."""


class RequestTable:
    def __init__(self) -> None:
        # A per-process prefix: a worker that outlived a gateway restart can still hold ids of
        # the old process, which the new one must never hand out again.
        self._prefix = f"g{uuid.uuid4().hex[:8]}-"
        self._seq = itertools.count(1)
        self._by_internal: dict[str, RequestState] = {}
        self._by_client: dict[tuple[str, str], str] = {}  # (owner, client id) -> internal id, while live
        # (owner, client id) of a request of several sequences -> how many of them are live: the id
        # is taken while any is (its sequences are live under ids of their own, "id-k").
        self._groups: dict[tuple[str, str], int] = {}

    def new_id(self) -> str:
        return f"{self._prefix}{next(self._seq):x}"

    def add(self, state: RequestState) -> None:
        """Make `state` live; DuplicateRequestError if its client id names a live request."""
        key = (state.owner, state.request_id)
        if key in self._by_client or key in self._groups:
            raise DuplicateRequestError(state.request_id)
        self._by_internal[state.internal_id] = state
        self._by_client[key] = state.internal_id
        if state.group_id:
            group = (state.owner, state.group_id)
            self._groups[group] = self._groups.get(group, 0) + 1

    def renew_id(self, state: RequestState) -> str:
        """Give a live request being resumed a fresh internal id (its old id plus the attempt, `.N`), so
        a worker that still runs the old attempt (one declared dead that comes back) can neither
        refuse the new one as a duplicate nor end it with the old one's deltas."""
        root = state.internal_id.split(".", 1)[0]
        old, state.internal_id = state.internal_id, f"{root}.{state.num_resumes}"
        del self._by_internal[old]
        self._by_internal[state.internal_id] = state
        key = (state.owner, state.request_id)
        if self._by_client.get(key) == old:
            self._by_client[key] = state.internal_id
        return state.internal_id

    def get(self, internal_id: str) -> RequestState | None:
        return self._by_internal.get(internal_id)

    def by_client(self, request_id: str, owner: str = "") -> RequestState | None:
        internal_id = self._by_client.get((owner, request_id))
        return None if internal_id is None else self._by_internal[internal_id]

    def is_live(self, request_id: str, owner: str = "") -> bool:
        return (owner, request_id) in self._by_client or (owner, request_id) in self._groups

    def pop(self, internal_id: str) -> RequestState | None:
        """Forget a request; its client id is free again."""
        state = self._by_internal.pop(internal_id, None)
        if state is not None and self._by_client.get((state.owner, state.request_id)) == internal_id:
            del self._by_client[(state.owner, state.request_id)]
            if state.group_id:
                group = (state.owner, state.group_id)
                self._groups[group] -= 1
                if not self._groups[group]:
                    del self._groups[group]
        return state

    def __len__(self) -> int:
        return len(self._by_internal)
