"""worker.sampler: greedy rows, repetition penalty, seeded batch-invariance, sampling statistics, logprobs,
refused inputs and rows of non-finite logits."""

from __future__ import annotations

import pytest
import torch

from sampler_harness import log_probs, make_batch
from shared.sampling_params import SamplingParams
from worker.sampler import Sampler, SamplingBatch, apply_repetition_penalty
from worker.sampling_draws import make_generator, position_uniform, token_seed

pytestmark = pytest.mark.usefixtures("single_torch_thread")


# --------------------------------------------------------------------------------------------- greedy


def test_greedy_is_argmax():
    logits = torch.randn(5, 37, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams(temperature=0)] * 5
    out = Sampler(seed=0)(logits, make_batch(params))
    assert out.token_ids == logits.argmax(dim=-1).tolist()
    assert out.logprobs is None
    # Same tokens on the non-fast path (logprobs requested).
    out = Sampler(seed=0)(logits, make_batch([SamplingParams(temperature=0, logprobs=True)] * 5))
    assert out.token_ids == logits.argmax(dim=-1).tolist()


def test_tiny_temperature_behaves_like_argmax_without_nan():
    logits = torch.randn(3, 1000, generator=torch.Generator().manual_seed(1)) * 30
    out = Sampler(seed=0)(logits, make_batch([SamplingParams(temperature=1e-30)] * 3))
    assert out.token_ids == logits.argmax(dim=-1).tolist()


def test_greedy_rows_consume_no_randomness():
    logits = torch.randn(3, 11, generator=torch.Generator().manual_seed(2))
    params = [
        SamplingParams(temperature=0, seed=5, logprobs=True),
        SamplingParams(temperature=0, repetition_penalty=1.5),
        SamplingParams(temperature=0),
    ]
    batch = make_batch(params, histories=[[1], [2, 3], []])
    sampler = Sampler(seed=0)
    seeded_state = batch.generators[0].get_state()
    own_state = sampler._generator.get_state()
    sampler(logits, batch)
    assert torch.equal(batch.generators[0].get_state(), seeded_state)
    assert torch.equal(sampler._generator.get_state(), own_state)


def test_empty_batch():
    out = Sampler()(torch.empty(0, 8), make_batch([]))
    assert out.token_ids == [] and out.logprobs is None


# --------------------------------------------------------------------------------- repetition penalty


def test_repetition_penalty_matches_hand_computation():
    logits = torch.tensor([[2.0, -1.0, 1.5, 0.5, 0.0], [2.0, -1.0, 1.5, 0.5, 0.0], [2.0, -1.0, 1.5, 0.5, 0.0]])
    histories = [[0, 1, 1, 4], [0, 1], [0, 1, 2, 3]]
    apply_repetition_penalty(logits, histories, [2.0, 0.5, 1.0])
    # Row 0, p = 2: 2.0 -> 1.0 (positive: divide), -1.0 -> -2.0 once despite appearing twice (negative: multiply),
    # 0.0 stays 0.0; unseen tokens 2 and 3 untouched.
    assert logits[0].tolist() == [1.0, -2.0, 1.5, 0.5, 0.0]
    # Row 1, p = 0.5 encourages: 2.0 -> 4.0, -1.0 -> -0.5.
    assert logits[1].tolist() == [4.0, -0.5, 1.5, 0.5, 0.0]
    # Row 2, p = 1: untouched even though its history is non-empty.
    assert logits[2].tolist() == [2.0, -1.0, 1.5, 0.5, 0.0]


def test_repetition_penalty_changes_the_argmax():
    logits = torch.tensor([[2.0, -1.0, 1.5, 0.5]])
    assert logits.argmax().item() == 0
    params = [SamplingParams(temperature=0, repetition_penalty=2.0)]
    out = Sampler(seed=0)(logits, make_batch(params, histories=[[0, 1, 1]]))
    assert out.token_ids == [2]  # 2.0 / 2 = 1.0 < 1.5
    # Without the penalty the same history does nothing.
    out = Sampler(seed=0)(logits, make_batch([SamplingParams(temperature=0)], histories=[[0, 1, 1]]))
    assert out.token_ids == [0]


def test_repetition_penalty_rejects_out_of_vocab_history():
    with pytest.raises(ValueError, match="token id 9"):
        apply_repetition_penalty(torch.zeros(1, 4), [[1, 9]], [1.3])
    with pytest.raises(ValueError, match="token id -1"):
        Sampler()(torch.zeros(1, 4), make_batch([SamplingParams(repetition_penalty=1.3)], histories=[[-1]]))


# ----------------------------------------------------------------------------------------- seeded rows


def run_steps(target: SamplingParams, position: int, num_rows: int, step_logits: torch.Tensor, noise_seed: int):
    """Tokens chosen for the target row over len(step_logits) steps at `position` of a batch of num_rows."""
    others = [
        SamplingParams(seed=7),
        SamplingParams(),
        SamplingParams(temperature=0),
        SamplingParams(seed=99, top_k=5),
        SamplingParams(min_p=0.1, repetition_penalty=1.3, top_p=0.5),
    ]
    params = others[: num_rows - 1]
    params.insert(position, target)
    batch = make_batch(params, histories=[[1, 2, 3] for _ in params])
    sampler = Sampler(seed=noise_seed)
    noise = torch.Generator().manual_seed(noise_seed)
    tokens = []
    for logits_row in step_logits:
        logits = torch.randn(num_rows, step_logits.shape[1], generator=noise) * 2
        logits[position] = logits_row
        chosen = sampler(logits, batch).token_ids
        tokens.append(chosen[position])
        for history, token in zip(batch.token_histories, chosen):
            history.append(token)
    return tokens


def test_seeded_row_is_independent_of_the_rest_of_the_batch():
    step_logits = torch.randn(20, 50, generator=torch.Generator().manual_seed(6))
    # Repetition penalty makes the target depend on its own history too, which must also be batch-independent.
    target = SamplingParams(seed=1234, temperature=1.3, top_p=0.95, repetition_penalty=1.1)
    alone = run_steps(target, 0, 1, step_logits, noise_seed=10)
    first = run_steps(target, 0, 6, step_logits, noise_seed=11)
    fourth = run_steps(target, 3, 6, step_logits, noise_seed=12)
    assert alone == first == fourth
    assert len(set(alone)) > 5  # really sampled, not argmax

    other_seed = run_steps(SamplingParams(seed=1235, temperature=1.3, top_p=0.95), 3, 6, step_logits, 13)
    assert other_seed != alone


def test_same_seed_reproduces_and_different_seeds_differ():
    logits = torch.zeros(1, 1000)  # uniform: any two different streams disagree almost surely

    def sequence(seed: int) -> list[int]:
        batch = make_batch([SamplingParams(seed=seed)])
        sampler = Sampler()  # its own (random) generator must not matter for a seeded row
        return [sampler(logits, batch).token_ids[0] for _ in range(20)]

    assert sequence(1) == sequence(1)
    assert sequence(1) != sequence(2)


def test_position_uniforms_are_uniform_and_independent_across_positions():
    # The uniforms a seeded request draws with, position after position: 20 equal bins by chi-square
    # (19 degrees of freedom, 43.82 at 0.001; fixed seeds, so deterministic), and no correlation between
    # neighbours (the per-position seeds are close together before mixing).
    for seed in (0, 1, 2**62 + 7):
        values = [position_uniform(token_seed(seed, i)) for i in range(20000)]
        assert all(0.0 <= u < 1.0 for u in values)
        counts = [0] * 20
        for u in values:
            counts[int(u * 20)] += 1
        assert sum((c - 1000) ** 2 / 1000 for c in counts) < 43.82
        mean = sum(values) / len(values)
        covariance = sum((a - mean) * (b - mean) for a, b in zip(values, values[1:])) / (len(values) - 1)
        assert abs(covariance / (1 / 12)) < 0.03
    assert position_uniform(token_seed(5, 3)) == position_uniform(token_seed(5, 3))


def test_make_generator_validates_seed():
    assert make_generator(0, "cpu").initial_seed() == 0
    for bad in (-1, 2**63, 1.5, True):
        with pytest.raises(ValueError, match="seed"):
            make_generator(bad, "cpu")  # type: ignore[arg-type]


# -------------------------------------------------------------------------------------------- statistics

# Pearson chi-square critical values at significance 0.001: a correct sampler exceeds them with probability
# 0.1%, and the seeds are fixed so the test is deterministic. A 0.03 error on a 0.1 probability with 4000 draws
# adds about 4000 * 0.03**2 / 0.1 = 36 to the statistic, far above the threshold, so real bugs are caught.
CHI2_CRITICAL_0_001 = {1: 10.83, 2: 13.82, 3: 16.27}


def chi_square(tokens: list[int], expected_probs: dict[int, float]) -> float:
    assert set(tokens) <= set(expected_probs), "sampled a token with probability 0"
    n = len(tokens)
    return sum((tokens.count(t) - n * p) ** 2 / (n * p) for t, p in expected_probs.items())


def test_empirical_distribution_unseeded_rows():
    probs = [0.1, 0.2, 0.3, 0.4]
    logits = torch.tensor([log_probs(*probs)] * 4000)
    tokens = Sampler(seed=0)(logits, make_batch([SamplingParams()] * 4000)).token_ids
    assert chi_square(tokens, dict(enumerate(probs))) < CHI2_CRITICAL_0_001[3]


def test_empirical_distribution_seeded_rows_and_steps():
    probs = [0.1, 0.2, 0.3, 0.4]
    logits = torch.tensor([log_probs(*probs)] * 2000)
    # 2000 rows with distinct seeds in one step ...
    params = [SamplingParams(seed=s) for s in range(2000)]
    tokens = Sampler(seed=0)(logits, make_batch(params)).token_ids
    assert chi_square(tokens, dict(enumerate(probs))) < CHI2_CRITICAL_0_001[3]
    # ... and one seeded row over 1000 steps.
    batch = make_batch([SamplingParams(seed=42)])
    sampler = Sampler(seed=0)
    tokens = [sampler(logits[:1], batch).token_ids[0] for _ in range(1000)]
    assert chi_square(tokens, dict(enumerate(probs))) < CHI2_CRITICAL_0_001[3]


def test_empirical_distribution_with_temperature_and_top_k():
    # T = 0.5 squares the probabilities; top_k = 3 drops token 0: p ∝ [0.04, 0.09, 0.16] over tokens 1..3.
    logits = torch.tensor([log_probs(0.1, 0.2, 0.3, 0.4)] * 4000)
    tokens = Sampler(seed=1)(logits, make_batch([SamplingParams(temperature=0.5, top_k=3)] * 4000)).token_ids
    expected = {1: 0.04 / 0.29, 2: 0.09 / 0.29, 3: 0.16 / 0.29}
    assert chi_square(tokens, expected) < CHI2_CRITICAL_0_001[2]


# -------------------------------------------------------------------------------------------- logprobs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_logprobs_are_raw_log_softmax_at_chosen_tokens(dtype):
    gen = torch.Generator().manual_seed(7)
    logits = (torch.randn(5, 30, generator=gen) * 3).to(dtype)
    original = logits.clone()
    params = [
        SamplingParams(logprobs=True, temperature=0.7, top_k=5),
        SamplingParams(logprobs=True, temperature=0, repetition_penalty=3.0),
        SamplingParams(logprobs=False),
        SamplingParams(logprobs=True, seed=3, top_p=0.5, min_p=0.1),
        SamplingParams(logprobs=True, temperature=2.0, repetition_penalty=0.7),
    ]
    raw_argmax_1 = int(original[1].float().argmax())
    histories = [[0, 1], [raw_argmax_1], [], [], [2]]
    out = Sampler(seed=0)(logits, make_batch(params, histories=histories))
    assert torch.equal(logits, original)  # the caller's logits are never modified
    raw = torch.log_softmax(original.float(), dim=-1)
    expected = raw[torch.arange(5), torch.tensor(out.token_ids)].tolist()
    assert out.logprobs is not None
    for row in (0, 1, 3, 4):
        assert out.logprobs[row] == expected[row]
    # The penalty moved row 1 off its raw argmax, and the logprob still refers to the raw distribution.
    assert out.token_ids[1] != raw_argmax_1


def test_no_logprobs_when_no_row_asks():
    logits = torch.randn(3, 10, generator=torch.Generator().manual_seed(8))
    out = Sampler(seed=0)(logits, make_batch([SamplingParams(), SamplingParams(temperature=0), SamplingParams()]))
    assert out.logprobs is None


# ----------------------------------------------------------------------------------------------- errors


def test_invalid_inputs_raise_value_error():
    sampler = Sampler()
    two = [SamplingParams(), SamplingParams()]
    cases = [
        (torch.zeros(4), make_batch(two[:1]), "2-D"),
        (torch.zeros(1, 2, 4), make_batch(two[:1]), "2-D"),
        (torch.zeros(2, 4, dtype=torch.long), make_batch(two), "float"),
        (torch.zeros(2, 0), make_batch(two), "V == 0"),
        (torch.zeros(3, 4), make_batch(two), "3 rows but batch.params has 2"),
        (torch.zeros(2, 4), SamplingBatch(two, [None], [[], []]), "batch.generators has 1"),
        (torch.zeros(2, 4), SamplingBatch(two, [None, None], [[]]), "batch.token_histories has 1"),
        (torch.zeros(1, 4), SamplingBatch([SamplingParams(seed=1)], [None], [[]]), "no generator"),
        (torch.zeros(1, 4), SamplingBatch([{"temperature": 0}], [None], [[]]), "SamplingParams"),  # type: ignore
        ([[0.0, 1.0]], make_batch(two[:1]), "torch.Tensor"),
    ]
    for logits, batch, message in cases:
        with pytest.raises(ValueError, match=message):
            sampler(logits, batch)  # type: ignore[arg-type]


def test_a_bad_row_anywhere_in_a_batch_is_refused_before_any_row_draws():
    # Rows are checked in the pass that decides each row's work, and only a row with a seed, a generator or
    # params of another type is looked at closely: a bad one behind plain rows is still refused, by its
    # index, and before the sampled row ahead of it has drawn from the shared generator.
    class ElsewhereGenerator:  # all the check reads of a generator
        device = torch.device("meta")

    class Params(SamplingParams):
        pass

    sampler = Sampler(seed=0)
    state = sampler._generator.get_state()
    plain, sampled = SamplingParams(temperature=0), SamplingParams(temperature=1.0)
    cases = [
        ([plain, sampled, plain, SamplingParams(seed=3)], [None] * 4, "row 3 has seed=3 but no generator"),
        ([plain, sampled, {"temperature": 0}, plain], [None] * 4, r"batch.params\[2\] must be a SamplingParams"),
        ([plain, sampled, plain, plain], [None, None, ElsewhereGenerator(), None], "row 2's generator is on meta"),
    ]
    for params, generators, message in cases:
        with pytest.raises(ValueError, match=message):
            sampler(torch.zeros(4, 8), SamplingBatch(params, generators, [[]] * 4))
        assert torch.equal(sampler._generator.get_state(), state)
    # A subclass of SamplingParams is looked at closely too, and passes.
    out = sampler(torch.eye(2, 8), make_batch([plain, Params(temperature=0)]))
    assert out.token_ids == [0, 1]


# ------------------------------------------------------------------------------------ non-finite logits


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])  # our argmax kernel, torch's
def test_rows_of_nan_logits_are_reported_by_every_path_and_finite_rows_never(dtype):
    """A NaN row's token means nothing: the output names the row (the runner fails its request), whichever
    path it took (argmax, edited, banned at token 0, sampled); a finite row that takes token 0 is not named."""
    vocab = 50
    logits = torch.randn(8, vocab, generator=torch.Generator().manual_seed(0)).to(dtype)
    logits[0, 0] = 30.0  # a finite row whose argmax is token 0
    nan_rows = [1, 3, 4, 5, 6, 7]
    logits[nan_rows[:-1]] = float("nan")
    logits[6, 7] = float("inf")
    logits[7, 9] = float("inf")  # one overflowed logit: argmax takes it, not token 0
    params = [SamplingParams(temperature=0), SamplingParams(temperature=0), SamplingParams(temperature=0),
              SamplingParams(temperature=0, repetition_penalty=1.3),
              SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[0]),  # 0 banned: the first NaN is 1
              SamplingParams(temperature=1.0, seed=3), SamplingParams(temperature=0.7, top_k=5),
              SamplingParams(temperature=0)]
    batch = make_batch(params, histories=[[1, 2]] * 8)
    batch.output_token_ids, batch.eos_token_ids = [[]] * 8, [[]] * 8
    out = Sampler(seed=0)(logits, batch)
    assert out.non_finite_rows == nan_rows
    assert out.token_ids[0] == 0 and out.token_ids[2] == logits[2].float().argmax().item()
    # Every row finite: no row named, and nothing looked at again.
    finite = Sampler(seed=0)(logits[[0, 2]], make_batch([SamplingParams(temperature=0)] * 2))
    assert finite.non_finite_rows is None and finite.token_ids[0] == 0
    greedy = Sampler(seed=0)(logits[[0, 7]], make_batch([SamplingParams(temperature=0)] * 2))  # the fast path
    assert greedy.non_finite_rows == [1] and greedy.token_ids == [0, 0]
