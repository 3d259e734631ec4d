"""The routing benchmark's workloads (bench/routing.py), seeded: multi-turn chat and its no-sharing twin.

Multi-turn: conversations arrive as a Poisson process; each sends its turns one after another, the
next when the previous reply ends, and each turn's prompt is the previous prompt, the reply's token
ids and a new user message, after a system prompt every conversation shares. No-sharing: the same
conversations, arrivals and prompt lengths, but every prompt is fresh random ids, so no two
requests share a block. Prompts are raw token ids (no tokenizer); no session ids, so only the
gateway's prefix index can find a conversation's worker. Pure Python, no I/O.
"""
from __future__ import annotations

import random
from dataclasses import asdict, dataclass, field

FIRST_ORDINARY_ID = 8  # clear of the special ids (bench/load_workload.py uses the same)
# multi_turn: each turn as the previous reply ends; multi_turn_think: after a pause (ChatSpec.think_s).
WORKLOADS = ("multi_turn", "multi_turn_think", "no_sharing")


@dataclass(frozen=True)
class ChatSpec:
    num_conversations: int = 64
    num_turns: int = 6
    system_len: int = 300
    user_len: int = 40
    reply_len: int = 32  # max_tokens, EOS ignored: every reply is exactly as long as drawn
    # User messages and replies vary by up to this fraction either way, uniformly, so turns do not end
    # in lockstep (with equal turns, the worker a turn just left is always the least loaded).
    jitter: float = 0.25
    rate: float = 4.0  # conversations arriving per second
    # multi_turn_think: the mean pause (exponential) between a reply's end and the next turn. Without
    # one, the worker a turn just left has a free slot the moment the next turn arrives, so
    # least-loaded routing keeps most conversations on one worker by accident.
    think_s: float = 1.0
    seed: int = 11

    def user_range(self) -> tuple[int, int]:
        return _range(self.user_len, self.jitter)

    def reply_range(self) -> tuple[int, int]:
        return _range(self.reply_len, self.jitter)

    @property
    def max_model_len(self) -> int:
        return self.system_len + self.num_turns * (self.user_range()[1] + self.reply_range()[1])

    def describe(self) -> str:
        (u0, u1), (r0, r1) = self.user_range(), self.reply_range()
        return (f"{self.num_conversations} conversations x {self.num_turns} turns, system prompt {self.system_len}, "
                f"user messages {u0}-{u1}, replies {r0}-{r1} tokens (max_tokens, ignore_eos), Poisson arrivals at "
                f"{self.rate:g} conversations/s, each turn as the previous reply ends (multi_turn, no_sharing) or "
                f"after a think time of {self.think_s:g} s mean (multi_turn_think), seed {self.seed}")

    def to_dict(self) -> dict:
        return asdict(self)


def _range(mean: int, jitter: float) -> tuple[int, int]:
    return max(1, round(mean * (1 - jitter))), max(1, round(mean * (1 + jitter)))


@dataclass
class Conversation:
    index: int
    arrival_s: float
    reply_lens: list[int]  # each turn's max_tokens
    think_s: list[float]  # before each turn after the first: the pause after the previous reply
    users: list[list[int]] = field(default_factory=list)  # multi-turn: each turn's user message
    system: list[int] = field(default_factory=list)  # multi-turn: shared by every conversation
    prompts: list[list[int]] = field(default_factory=list)  # no-sharing: each turn's whole prompt

    def prompt(self, turn: int, history: list[int] | None) -> list[int]:
        """Turn `turn`'s prompt; `history` is the previous turn's prompt + its reply ids (multi-turn)."""
        if self.prompts:
            return list(self.prompts[turn])
        return (list(self.system) if turn == 0 else list(history)) + self.users[turn]


def make_conversations(spec: ChatSpec, vocab_size: int, workload: str) -> list[Conversation]:
    """The conversations of `workload` (one of WORKLOADS): the same arrivals and lengths for all, so only
    the sharing (and the think time) differs."""
    if workload not in WORKLOADS:
        raise ValueError(f"workload {workload!r}: one of {WORKLOADS}")
    shape = random.Random(spec.seed)
    arrivals, t = [], 0.0
    for _ in range(spec.num_conversations):
        arrivals.append(t)
        t += shape.expovariate(spec.rate) if spec.rate > 0 else 0.0
    user_lens = [[shape.randint(*spec.user_range()) for _ in range(spec.num_turns)]
                 for _ in range(spec.num_conversations)]
    reply_lens = [[shape.randint(*spec.reply_range()) for _ in range(spec.num_turns)]
                  for _ in range(spec.num_conversations)]
    pauses = random.Random(spec.seed + 7)
    thinks = workload == "multi_turn_think" and spec.think_s > 0
    think = [[pauses.expovariate(1 / spec.think_s) if thinks else 0.0 for _ in range(spec.num_turns)]
             for _ in range(spec.num_conversations)]
    # Token ids from each workload's own stream (its own system prompt too): one workload's cached
    # blocks never serve the next one played on the same cluster.
    ids = random.Random(spec.seed + 1 + WORKLOADS.index(workload))
    draw = lambda n: [ids.randrange(FIRST_ORDINARY_ID, vocab_size) for _ in range(n)]  # noqa: E731
    if workload != "no_sharing":
        system = draw(spec.system_len)
        return [Conversation(c, arrivals[c], reply_lens[c], think[c], users=[draw(n) for n in user_lens[c]],
                             system=system) for c in range(spec.num_conversations)]
    out = []
    for c in range(spec.num_conversations):
        # Turn k's prompt: the system prompt, k + 1 user messages and k replies, as long as in multi-turn.
        lens = [spec.system_len + sum(user_lens[c][:k + 1]) + sum(reply_lens[c][:k]) for k in range(spec.num_turns)]
        out.append(Conversation(c, arrivals[c], reply_lens[c], think[c], prompts=[draw(n) for n in lens]))
    return out
