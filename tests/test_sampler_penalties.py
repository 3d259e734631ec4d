"""The OpenAI sampling features in the sampler: logit bias, presence/frequency penalties, min_tokens, top_logprobs;
in the greedy path, under sampling, in mixed batches (each row as if alone), and seeded."""

from __future__ import annotations

import pytest
import torch

from shared.sampling_params import SamplingParams
from worker.logits_processors import apply_logit_bias, apply_min_tokens, apply_presence_frequency_penalties
from worker.sampler import Sampler, SamplingBatch, top_logprobs
from worker.sampling_draws import make_generator


pytestmark = pytest.mark.usefixtures("single_torch_thread")


def make_batch(params, outputs=None, prompts=None, eos=None) -> SamplingBatch:
    """A batch whose histories are prompt + output, as the runner builds them."""
    params = list(params)
    outputs = [list(o) for o in outputs] if outputs is not None else [[] for _ in params]
    prompts = [list(p) for p in prompts] if prompts is not None else [[] for _ in params]
    return SamplingBatch(
        params=params,
        generators=[None if p.seed is None else make_generator(p.seed, "cpu") for p in params],
        token_histories=[p + o for p, o in zip(prompts, outputs)],
        output_token_ids=outputs,
        eos_token_ids=[list(eos or ()) for _ in params],
    )


def greedy(**kwargs) -> SamplingParams:
    return SamplingParams(temperature=0.0, **kwargs)


# ------------------------------------------------------------------------------------------ logit bias


def test_logit_bias_flips_a_greedy_choice():
    logits = torch.tensor([[2.0, 1.0, 0.5], [2.0, 1.0, 0.5], [2.0, 1.0, 0.5]])
    params = [greedy(), greedy(logit_bias={2: 1.6}), greedy(logit_bias=[(0, -1.5), (2, 0.4)])]
    out = Sampler(seed=0)(logits, make_batch(params))
    # Row 1: 0.5 + 1.6 = 2.1 > 2.0. Row 2: 2.0 - 1.5 = 0.5 < 1.0 > 0.9.
    assert out.token_ids == [0, 2, 1]


def test_logit_bias_alone_in_a_greedy_batch_is_not_skipped_by_the_fast_path():
    logits = torch.tensor([[2.0, 1.0, 0.5]])
    sampler = Sampler(seed=0)
    assert sampler(logits, make_batch([greedy(logit_bias={1: 5.0})])).token_ids == [1]
    assert sampler(logits.to(torch.bfloat16), make_batch([greedy(logit_bias={1: 5.0})])).token_ids == [1]


def test_a_plus_100_bias_forces_a_token_under_sampling():
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(1)) * 4
    params = [SamplingParams(temperature=1.5, logit_bias={17: 100.0}),
              SamplingParams(temperature=1.0, top_k=3, logit_bias={17: 100.0}),  # 17 is in the top 3 after bias
              SamplingParams(temperature=0.8, top_p=0.5, min_p=0.2, seed=5, logit_bias={17: 100.0}),
              SamplingParams(temperature=1.0, seed=6, logit_bias={17: 100.0, 3: 50.0}),
              SamplingParams(temperature=1.0, repetition_penalty=1.5, presence_penalty=2.0,
                             logit_bias={17: 100.0}),
              SamplingParams(temperature=1.0)]
    sampler = Sampler(seed=0)
    for _ in range(20):
        out = sampler(logits, make_batch(params, outputs=[[17]] * 6))
        assert out.token_ids[:5] == [17] * 5


def test_logit_bias_comes_before_penalties_and_temperature():
    # Bias first: (1.0 + 1.0) / 2 = 1.0 < 1.2, token 1. Penalty first would give 1.0 / 2 + 1.0 = 1.5, token 0.
    logits = torch.tensor([[1.0, 1.2]])
    out = Sampler(seed=0)(logits, make_batch([greedy(logit_bias={0: 1.0}, repetition_penalty=2.0)], outputs=[[0]]))
    assert out.token_ids == [1]
    # Temperature scales the biased logits: a tiny temperature makes the biased winner certain.
    out = Sampler(seed=0)(logits, make_batch([SamplingParams(temperature=1e-4, logit_bias={0: 0.3})]))
    assert out.token_ids == [0]


def test_logit_bias_outside_the_vocabulary_is_a_clear_value_error():
    with pytest.raises(ValueError, match=r"logit_bias contains token id 7, outside the vocabulary \[0, 4\)"):
        Sampler()(torch.zeros(1, 4), make_batch([greedy(logit_bias={7: 1.0})]))
    with pytest.raises(ValueError, match="one logit_bias per row"):
        apply_logit_bias(torch.zeros(2, 4), [((1, 1.0),)])


def test_apply_logit_bias_adds_exactly_and_touches_nothing_else():
    logits = torch.tensor([[0.5, -1.0, 2.0], [0.5, -1.0, 2.0]])
    apply_logit_bias(logits, [((0, 1.25), (2, -100.0)), ()])
    assert logits.tolist() == [[1.75, -1.0, -98.0], [0.5, -1.0, 2.0]]


# ----------------------------------------------------------------------------- presence / frequency


def test_presence_and_frequency_penalties_match_hand_computation():
    logits = torch.tensor([[1.0, 2.0, 3.0, 4.0, 5.0]] * 3)
    outputs = [[1, 3, 3, 3], [0, 0, 4], [1, 2]]
    apply_presence_frequency_penalties(logits, outputs, [0.5, -1.0, 0.0], [0.25, -0.5, 0.0])
    # Row 0: t1 seen once: 2 - 0.5 - 0.25; t3 three times: 4 - 0.5 - 0.75. Unseen tokens untouched.
    assert logits[0].tolist() == [1.0, 1.25, 3.0, 2.75, 5.0]
    # Row 1, negative penalties encourage: t0 twice: 1 + 1 + 1; t4 once: 5 + 1 + 0.5.
    assert logits[1].tolist() == [3.0, 2.0, 3.0, 4.0, 6.5]
    # Row 2: both penalties 0, untouched whatever its output.
    assert logits[2].tolist() == [1.0, 2.0, 3.0, 4.0, 5.0]


def test_penalties_against_a_reference_on_random_logits():
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 20, generator=gen)
    outputs = [torch.randint(0, 20, (n,), generator=gen).tolist() for n in (0, 5, 12, 30)]
    presence, frequency = [1.5, -0.7, 0.3, 2.0], [0.2, 1.1, -2.0, 0.05]
    expected = logits.clone()
    for row, out in enumerate(outputs):
        for token in set(out):
            expected[row, token] -= presence[row] + frequency[row] * out.count(token)
    got = apply_presence_frequency_penalties(logits.clone(), outputs, presence, frequency)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)


def test_frequency_penalty_grows_with_the_count_and_flips_greedy_choices():
    logits = torch.tensor([[3.0, 2.9]] * 3)
    params = [greedy(frequency_penalty=0.05)] * 2 + [greedy(presence_penalty=0.2)]
    out = Sampler(seed=0)(logits, make_batch(params, outputs=[[0], [0, 0, 0], [0]]))
    # 3 - 0.05 = 2.95 still wins; 3 - 0.15 = 2.85 does not; presence: 3 - 0.2 = 2.8 does not.
    assert out.token_ids == [0, 1, 1]


def test_penalties_count_only_generated_tokens_not_the_prompt():
    logits = torch.tensor([[3.0, 2.9]])
    params = [greedy(presence_penalty=2.0, frequency_penalty=2.0)]
    sampler = Sampler(seed=0)
    # Token 0 fills the prompt, not the output: nothing is penalised.
    assert sampler(logits, make_batch(params, prompts=[[0, 0, 0]], outputs=[[1]])).token_ids == [0]
    assert sampler(logits, make_batch(params, prompts=[[0, 0, 0]], outputs=[[0]])).token_ids == [1]


def test_penalties_and_min_tokens_need_the_output_histories():
    batch = make_batch([greedy(presence_penalty=1.0)])
    batch.output_token_ids = None
    with pytest.raises(ValueError, match="output_token_ids is required"):
        Sampler()(torch.zeros(1, 4), batch)
    with pytest.raises(ValueError, match="output history contains token id 9"):
        Sampler()(torch.zeros(1, 4), make_batch([greedy(frequency_penalty=1.0)], outputs=[[9]]))
    batch = make_batch([greedy(), greedy()])
    batch.output_token_ids = [[]]
    with pytest.raises(ValueError, match="batch.output_token_ids has 1"):
        Sampler()(torch.zeros(2, 4), batch)


# ------------------------------------------------------------------------------------------ min_tokens

EOS = 2


def test_min_tokens_blocks_eos_and_stop_ids_until_reached_then_allows_them():
    logits = torch.tensor([[0.0, 1.0, 9.0, 8.0, 0.5]])  # EOS (2) first, the stop id (3) second
    params = [greedy(min_tokens=3, stop_token_ids=[3])]
    sampler = Sampler(seed=0)
    chosen = [sampler(logits, make_batch(params, outputs=[[4] * n], eos=[EOS])).token_ids[0] for n in range(5)]
    assert chosen == [1, 1, 1, EOS, EOS]
    # With EOS allowed by the count but banned by nothing else, the plain argmax comes back.
    assert sampler(logits, make_batch([greedy(stop_token_ids=[3])], eos=[EOS])).token_ids == [EOS]


def test_min_tokens_counts_resumed_output_not_the_prompt():
    logits = torch.tensor([[0.0, 1.0, 9.0]])
    params = [greedy(min_tokens=2)]
    sampler = Sampler(seed=0)
    assert sampler(logits, make_batch(params, prompts=[[1] * 10], outputs=[[1]], eos=[EOS])).token_ids == [1]
    assert sampler(logits, make_batch(params, prompts=[[1]], outputs=[[1, 1]], eos=[EOS])).token_ids == [EOS]


def test_min_tokens_under_sampling_never_draws_a_banned_token():
    logits = torch.zeros(3, 8)
    logits[:, EOS] = 6.0
    logits[:, 5] = 6.0
    params = [SamplingParams(temperature=1.0, min_tokens=4, stop_token_ids=[5]),
              SamplingParams(temperature=2.0, seed=1, min_tokens=4, stop_token_ids=[5], top_p=0.9),
              SamplingParams(temperature=1.0, min_tokens=4, stop_token_ids=[5], ignore_eos=True)]
    sampler = Sampler(seed=0)
    for _ in range(50):
        out = sampler(logits, make_batch(params, outputs=[[0, 1, 3]] * 3, eos=[EOS]))
        # ignore_eos or not, EOS is banned under min_tokens (vLLM's rule).
        assert not {EOS, 5} & set(out.token_ids)
    seen = set()
    for _ in range(50):
        seen |= set(sampler(logits, make_batch(params, outputs=[[0, 1, 3, 4]] * 3, eos=[EOS])).token_ids)
    assert {EOS, 5} <= seen  # reached: both are likely again


def test_apply_min_tokens_skips_ids_outside_the_vocabulary():
    logits = torch.zeros(2, 4)
    apply_min_tokens(logits, [[1, 7], [3]], rows=[0])
    assert logits.tolist() == [[0.0, float("-inf"), 0.0, 0.0], [0.0] * 4]


# ---------------------------------------------------------------------------------------- top_logprobs


def test_top_logprobs_equal_the_raw_log_softmax_topk_sorted_and_leave_the_chosen_logprob_alone():
    gen = torch.Generator().manual_seed(11)
    logits = torch.randn(5, 40, generator=gen) * 3
    params = [SamplingParams(logprobs=True, top_logprobs=5, temperature=0.7, seed=1),
              greedy(logprobs=True, top_logprobs=3, logit_bias={0: 50.0}, presence_penalty=1.0),
              greedy(logprobs=True),
              SamplingParams(logprobs=True, top_logprobs=1, temperature=1.3, seed=2, frequency_penalty=-1.0),
              greedy()]
    outputs = [[1, 2], [3], [], [4, 4], []]
    out = Sampler(seed=0)(logits, make_batch(params, outputs=outputs))
    raw = torch.log_softmax(logits, dim=-1)
    assert out.top_logprobs is not None and out.logprobs is not None
    for row, p in enumerate(params):
        k = p.top_logprobs
        if k == 0:
            assert out.top_logprobs[row] == ()
            continue
        values, ids = raw[row].topk(k)
        assert [t for t, _ in out.top_logprobs[row]] == ids.tolist()
        assert [lp for _, lp in out.top_logprobs[row]] == values.tolist()
        assert values.tolist() == sorted(values.tolist(), reverse=True)
    # The chosen logprob is the raw one at the chosen token, bias and penalties notwithstanding...
    assert out.token_ids[1] == 0
    assert out.logprobs[:4] == raw[torch.arange(4), torch.tensor(out.token_ids[:4])].tolist()
    assert out.logprobs[4] is None  # the row did not ask: nothing was computed for it
    # ...and the same as without top_logprobs.
    plain = [SamplingParams(**{**p.to_dict(), "top_logprobs": 0}) for p in params]
    again = Sampler(seed=0)(logits, make_batch(plain, outputs=outputs))
    assert again.logprobs == out.logprobs and again.token_ids == out.token_ids and again.top_logprobs is None


def test_top_logprobs_break_ties_by_ascending_token_id():
    row = torch.log_softmax(torch.tensor([1.0, 3.0, 3.0, 0.0, 3.0, 2.0]), dim=-1)
    assert [t for t, _ in top_logprobs(row, 2)] == [1, 2]
    assert [t for t, _ in top_logprobs(row, 4)] == [1, 2, 4, 5]
    assert [t for t, _ in top_logprobs(torch.zeros(7), 5)] == [0, 1, 2, 3, 4]
    assert len(top_logprobs(torch.zeros(3), 5)) == 3  # k clamped to V


# ----------------------------------------------------------------------------- mixed batches and seeds

MIXED = [
    greedy(),
    greedy(logit_bias={5: 3.0}, logprobs=True, top_logprobs=2),
    SamplingParams(temperature=0.9, seed=3, presence_penalty=1.0, frequency_penalty=0.5),
    SamplingParams(temperature=1.1, top_k=10, seed=4, logprobs=True),
    greedy(min_tokens=3, stop_token_ids=[7], repetition_penalty=1.3),
    SamplingParams(temperature=0.8, seed=9, min_tokens=1, logit_bias=[(2, -5.0), (9, 2.0)], top_logprobs=5,
                   logprobs=True),
]
MIXED_OUTPUTS = [[1], [5, 5], [2, 3, 3], [], [7, 2], [4]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_row_of_a_mixed_batch_equals_running_it_alone(dtype):
    logits = (torch.randn(len(MIXED), 24, generator=torch.Generator().manual_seed(5)) * 2).to(dtype)
    prompts = [[0, 1, 2, 7, 9]] * len(MIXED)
    together = Sampler(seed=0)(logits, make_batch(MIXED, MIXED_OUTPUTS, prompts, eos=[EOS]))
    for row, p in enumerate(MIXED):
        alone = Sampler(seed=1)(logits[row:row + 1], make_batch([p], [MIXED_OUTPUTS[row]], [prompts[row]], [EOS]))
        assert alone.token_ids[0] == together.token_ids[row], row
        if p.logprobs:
            assert alone.logprobs[0] == pytest.approx(together.logprobs[row], abs=1e-6), row
        if p.top_logprobs:
            assert [t for t, _ in alone.top_logprobs[0]] == [t for t, _ in together.top_logprobs[row]], row
            assert [lp for _, lp in alone.top_logprobs[0]] == pytest.approx(
                [lp for _, lp in together.top_logprobs[row]], abs=1e-6), row
    # Rows asking nothing of the new features still got the plain result.
    assert together.token_ids[0] == int(logits[0].float().argmax())
    assert together.token_ids[4] != 7  # banned while under min_tokens


def test_seeded_rows_with_the_new_features_reproduce_and_depend_on_the_seed():
    logits = torch.randn(1, 64, generator=torch.Generator().manual_seed(6))
    params = SamplingParams(temperature=1.0, seed=42, presence_penalty=0.5, logit_bias={1: 1.0}, min_tokens=2)
    draws = [Sampler(seed=s)(logits, make_batch([params], [[3]], eos=[EOS])).token_ids[0] for s in range(3)]
    assert len(set(draws)) == 1  # the request's seed, not the sampler's, decides
    other = SamplingParams(**{**params.to_dict(), "seed": 43})
    sequence = [Sampler()(logits, make_batch([params], [[3]], eos=[EOS])).token_ids[0] for _ in range(3)]
    others = [Sampler()(logits, make_batch([other], [[3]], eos=[EOS])).token_ids[0] for _ in range(20)]
    assert set(sequence) == {draws[0]} and set(others) != {draws[0]}


@pytest.mark.parametrize("params", [
    greedy(logit_bias={1: 0.1}), greedy(presence_penalty=0.1), greedy(frequency_penalty=-0.1),
    greedy(min_tokens=5, stop_token_ids=[3]), greedy(logprobs=True), greedy(logprobs=True, top_logprobs=1),
], ids=["logit_bias", "presence", "frequency", "min_tokens", "logprobs", "top_logprobs"])
def test_rows_that_need_only_an_argmax_take_the_fast_path_even_beside_a_feature_row(params):
    sampler = Sampler(seed=0)
    calls = []  # rows per kernel call, and whether the kernel read the caller's logits in place

    def argmax_rows(rows):
        calls.append((rows.shape[0], rows.untyped_storage().data_ptr() == logits.untyped_storage().data_ptr()))
        return rows.argmax(dim=-1)

    sampler._argmax_rows = argmax_rows
    logits = torch.randn(2, 8, generator=torch.Generator().manual_seed(2))
    sampler(logits, make_batch([greedy(), greedy()], outputs=[[1], [2]], eos=[EOS]))
    assert calls == [(2, True)]
    calls.clear()
    out = sampler(logits, make_batch([greedy(), params], outputs=[[1], [2]], eos=[EOS]))
    # A greedy row that only asks for logprobs needs the raw argmax too; any other feature row is processed
    # apart (its argmax by the kernel too, on its edited copy), and the plain row alone goes to the kernel,
    # with no copy.
    assert calls == ([(2, True)] if params.logprobs else [(1, False), (1, True)])
    assert out.token_ids[0] == int(logits[0].argmax())
    assert out.logprobs is None if not params.logprobs else out.logprobs[0] is None
    calls.clear()
    # min_tokens already reached: nothing is banned, so both rows are plain.
    sampler(logits, make_batch([greedy(min_tokens=1), greedy()], outputs=[[1], [2]], eos=[EOS]))
    assert calls == [(2, True)]


# Every kind of row, plain greedy rows around and between them (so the plain rows come in several runs).
EVERY_KIND = [
    greedy(),
    greedy(logit_bias={5: 3.0}),
    greedy(),
    greedy(),
    SamplingParams(temperature=0.9, seed=3),
    greedy(logprobs=True),
    greedy(presence_penalty=1.0, frequency_penalty=0.5, logprobs=True, top_logprobs=3),
    greedy(),
    greedy(min_tokens=4, stop_token_ids=[7]),
    SamplingParams(temperature=1.1, top_k=10, top_p=0.9, seed=4, logprobs=True),
    greedy(repetition_penalty=1.3),
    greedy(min_tokens=1),  # already past it: a plain row
    SamplingParams(temperature=0.8, seed=9, logit_bias=[(2, -5.0), (9, 2.0)], min_tokens=3, logprobs=True,
                   top_logprobs=2),
    greedy(),
]
EVERY_KIND_OUTPUTS = [[1], [5], [], [3, 3], [2], [], [4, 4, 6], [1], [7], [], [9, 9], [8], [4], [0]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kernel", [True, False], ids=["kernel", "torch-argmax"])
def test_a_mixed_batch_gives_every_row_exactly_what_it_gets_alone(dtype, kernel):
    logits = (torch.randn(len(EVERY_KIND), 24, generator=torch.Generator().manual_seed(12)) * 2).to(dtype)
    original = logits.clone()
    prompts = [[0, 1, 2, 7, 9]] * len(EVERY_KIND)

    def sampler(seed):
        s = Sampler(seed=seed)
        if not kernel:
            s._argmax_rows = None
        return s

    together = sampler(0)(logits, make_batch(EVERY_KIND, EVERY_KIND_OUTPUTS, prompts, eos=[EOS]))
    assert torch.equal(logits, original)
    for row, p in enumerate(EVERY_KIND):
        alone = sampler(1)(logits[row:row + 1],
                           make_batch([p], [EVERY_KIND_OUTPUTS[row]], [prompts[row]], [EOS]))
        assert together.token_ids[row] == alone.token_ids[0], row
        assert together.logprobs[row] == (alone.logprobs[0] if p.logprobs else None), row
        assert together.top_logprobs[row] == (alone.top_logprobs[0] if p.top_logprobs else ()), row
    plain = [row for row, p in enumerate(EVERY_KIND) if p == greedy() or p == greedy(min_tokens=1)]
    assert [together.token_ids[row] for row in plain] == [int(logits[row].float().argmax()) for row in plain]
