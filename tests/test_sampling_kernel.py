"""Each sampled row's draw by our CPU kernel (sample_rows) and by the torch path every other device runs
(sample_rows_torch), both held to a float64 statement of the rules: the filters' kept set
(sampler_harness.reference_keep) over the temperature-scaled logits, then the first kept token, in id order,
at which the running sum of the weights passes u times their total. Also the kernel's repetition penalty
bit for bit against torch's, rows with no distribution to draw from, and the kernel built without AVX2
(its scalar loops) held to the same statement."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sampler_harness import reference_keep
from shared.sampling_params import SamplingParams
from worker.model import cpu_kernels
from worker.sampler import apply_repetition_penalty
from worker.sampling_draws import sample_rows_torch

pytestmark = pytest.mark.usefixtures("single_torch_thread")
KERNELS = cpu_kernels.load()
needs_kernels = pytest.mark.skipif(KERNELS is None, reason="our CPU kernels did not build")
# How near (relative to the kept mass) a boundary may lie before float32's and float64's sums could fall
# on different sides of it: such a draw (or a top-p / min-p cut) is ambiguous and not compared.
MARGIN = 1e-5


def kernel_arguments(params: list[SamplingParams], uniforms: torch.Tensor) -> tuple[list, ...]:
    """sample_rows' arguments after the logits."""
    return ([p.temperature for p in params], [p.top_k for p in params], [p.top_p for p in params],
            [p.min_p for p in params], uniforms.tolist())


def kernel_path(x: torch.Tensor, params: list[SamplingParams], uniforms: torch.Tensor) -> list[int]:
    return KERNELS.sample_rows(x, *kernel_arguments(params, uniforms)).tolist()


def torch_path(x: torch.Tensor, params: list[SamplingParams], uniforms: torch.Tensor) -> list[int]:
    return sample_rows_torch(x.clone(), params, uniforms).tolist()


PATHS = [pytest.param(kernel_path, marks=needs_kernels, id="kernel"), pytest.param(torch_path, id="torch")]

# sample_rows alone, bound as bindings.cpp binds it, for a build without AVX2.
_PORTABLE_BINDINGS = """
#include <torch/csrc/utils/pybind.h>
#include "kernels.h"
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("sample_rows", &sample_rows); }
"""


@pytest.fixture(scope="module")
def portable_kernels(tmp_path_factory):
    from torch.utils.cpp_extension import load
    folder = tmp_path_factory.mktemp("portable_sampling")
    (folder / "bindings.cpp").write_text(_PORTABLE_BINDINGS)
    return load(name="portable_sampling", sources=[str(folder / "bindings.cpp"),
                                                   str(cpu_kernels._SOURCE_DIR / "sampling.cpp")],
                build_directory=str(folder), extra_cflags=["-O1", f"-I{cpu_kernels._SOURCE_DIR}", "-march=native",
                                                           "-mno-avx512f", "-mno-avx2", "-mno-fma", "-fopenmp"],
                extra_ldflags=["-fopenmp"], verbose=False)


def scaled(row: torch.Tensor, temperature: float) -> list[float]:
    """The row's scaled logits as both paths round them: (x - max) / T in float32."""
    return ((row - row.max()) / torch.tensor(temperature, dtype=torch.float32)).double().tolist()


def reference_token(s: list[float], keep: set[int], u: float) -> tuple[int, float]:
    """The rule's token for uniform u, and how far (relative to the total) u * total lies from the nearest
    boundary between two kept tokens."""
    ids = sorted(keep)
    weights = [math.exp(s[i]) for i in ids]
    total = sum(weights)
    target, running, token, gap = u * total, 0.0, ids[-1], math.inf
    for i, w in zip(ids, weights):
        running += w
        gap = min(gap, abs(running - target) / total)
        if running > target and token == ids[-1]:
            token = i
    return token, gap


def unambiguous_keep(s: list[float], p: SamplingParams) -> set[int] | None:
    """reference_keep, or None where a nudge of top_p or min_p by MARGIN changes the kept set."""
    keep = reference_keep(s, p.top_k, p.top_p, p.min_p)
    nudges = [(p.top_p * (1 + d), p.min_p * (1 + d)) for d in (-MARGIN, MARGIN)]
    for top_p, min_p in nudges:
        if reference_keep(s, p.top_k, min(top_p, 1.0) if p.top_p < 1 else 1.0, min_p) != keep:
            return None
    return keep


def random_rows(num_rows: int, vocab_size: int, seed: int) -> tuple[torch.Tensor, list[SamplingParams], torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    # Peaked rows (as a trained model's are) and flat ones, with exact ties in a few.
    spread = torch.tensor([0.5, 2.0, 6.0])[torch.randint(0, 3, (num_rows, 1), generator=gen)]
    x = torch.randn(num_rows, vocab_size, generator=gen) * spread
    x[::7] = x[::7].round()
    params = []
    for _ in range(num_rows):
        pick = torch.rand(4, generator=gen).tolist()
        params.append(SamplingParams(
            temperature=[0.3, 0.7, 1.0, 1.6][int(pick[0] * 4)],
            top_k=[0, 0, 1, 5, 40][int(pick[1] * 5)] if vocab_size > 1 else 0,
            top_p=[1.0, 1.0, 0.9, 0.5, 0.05][int(pick[2] * 5)],
            min_p=[0.0, 0.0, 0.05, 0.3][int(pick[3] * 4)]))
    return x, params, torch.rand(num_rows, dtype=torch.float64, generator=gen)


def assert_rules_tokens(path, vocab_size: int) -> None:
    x, params, uniforms = random_rows(120, vocab_size, seed=vocab_size)
    tokens = path(x, params, uniforms)
    compared = 0
    for row, (token, p, u) in enumerate(zip(tokens, params, uniforms.tolist())):
        s = scaled(x[row], p.temperature)
        keep = unambiguous_keep(s, p)
        if keep is None:
            continue
        expected, gap = reference_token(s, keep, u)
        if gap < MARGIN:
            continue
        assert token == expected, (row, p, u)
        compared += 1
    assert compared >= 100  # ambiguity is rare: the test compares nearly every row


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("vocab_size", [1, 7, 9, 63, 64, 1000, 5000])
def test_each_row_takes_the_rules_token(path, vocab_size):
    assert_rules_tokens(path, vocab_size)


@needs_kernels
@pytest.mark.slow
@pytest.mark.parametrize("vocab_size", [7, 1000])
def test_a_build_without_avx2_takes_the_rules_token(portable_kernels, vocab_size):
    def portable_path(x, params, uniforms):
        return portable_kernels.sample_rows(x, *kernel_arguments(params, uniforms)).tolist()

    assert_rules_tokens(portable_path, vocab_size)


@pytest.mark.parametrize("path", PATHS)
def test_uniforms_across_the_unit_interval_visit_every_kept_token_in_id_order(path):
    # Three kept tokens of probability 0.2, 0.3 and 0.5 among ones top-p drops: u in [0, 0.2) takes the first.
    x = torch.log(torch.tensor([[0.01, 0.2, 0.005, 0.3, 0.5, 0.01]])).repeat(9, 1)
    params = [SamplingParams(top_p=0.95)] * 9
    uniforms = torch.tensor([0.0, 0.1, 0.19, 0.21, 0.4, 0.49, 0.51, 0.9, 1 - 2**-53], dtype=torch.float64)
    assert path(x, params, uniforms) == [1, 1, 1, 3, 3, 3, 4, 4, 4]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("row, top_p", [
    ([2.0, 0.0], 0.5),  # the cut right after the top token, at the end of its bin
    ([8.0] + [0.0] * 999, 0.1),  # one peak (p = 0.75) over a flat tail that lies under the floor
    ([0.0] + [-0.24] * 8, 0.8),  # eight tied tokens, some in the vector loop, one in its tail
    ([0.0] + [-0.24] * 62, 0.3),
], ids=["two", "peak-and-flat-tail", "ties-9", "ties-63"])
def test_a_draw_never_takes_a_token_top_p_removes(path, row, top_p):
    x = torch.tensor([row]).repeat(64, 1)
    params = [SamplingParams(top_p=top_p)] * 64
    uniforms = torch.linspace(0, 1 - 2**-20, 64, dtype=torch.float64)
    s = scaled(x[0], 1.0)
    keep = reference_keep(s, 0, top_p, 0.0)
    expected = [reference_token(s, keep, u)[0] for u in uniforms.tolist()]
    assert path(x, params, uniforms) == expected


@pytest.mark.parametrize("path", PATHS)
def test_temperatures_float32_cannot_hold_are_held_to_its_range(path):
    # 1e-50 rounds to 0 and 1e39 to inf in float32: the first largest, and a draw among the tokens left in.
    x = torch.tensor([[1.0, 5.0, 2.0, -math.inf]]).repeat(4, 1)
    params = [SamplingParams(temperature=1e-50)] * 2 + [SamplingParams(temperature=1e39)] * 2
    tokens = path(x, params, torch.tensor([0.1, 0.99, 0.1, 0.99], dtype=torch.float64))
    assert tokens[:2] == [1, 1] and tokens[2] == 0 and tokens[3] == 2


@pytest.mark.parametrize("path", PATHS)
def test_ties_at_the_top_p_cut_keep_the_lower_ids(path):
    x = torch.zeros(4, 10)
    x[:, [3, 6]] = 5.0  # two tied top tokens; top_p 0.01 keeps one, the lower id
    params = [SamplingParams(top_p=0.01)] * 4
    assert path(x, params, torch.tensor([0.0, 0.3, 0.7, 0.999], dtype=torch.float64)) == [3, 3, 3, 3]
    # top_k = 1 keeps both (ties at the k-th are kept), drawn by u.
    params = [SamplingParams(top_k=1)] * 4
    assert path(x, params, torch.tensor([0.0, 0.3, 0.7, 0.999], dtype=torch.float64)) == [3, 3, 6, 6]


@pytest.mark.parametrize("path", PATHS)
def test_top_k_beyond_the_tokens_left_in_keeps_them_all(path):
    # Tokens 2 and 5 are the only ones not banned; top_k 3 finds no third and keeps both, by u.
    x = torch.full((4, 9), -math.inf)
    x[:, 2], x[:, 5] = 1.0, 1.0 - math.log(3.0)  # probabilities 3/4 and 1/4
    params = [SamplingParams(top_k=3)] * 4
    assert path(x, params, torch.tensor([0.0, 0.7, 0.76, 0.99], dtype=torch.float64)) == [2, 2, 5, 5]


@pytest.mark.parametrize("path", PATHS)
def test_tiny_temperature_takes_the_first_largest(path):
    x = torch.randn(3, 300, generator=torch.Generator().manual_seed(4)) * 10
    params = [SamplingParams(temperature=1e-30)] * 3
    assert path(x, params, torch.tensor([0.0, 0.5, 0.999], dtype=torch.float64)) == x.argmax(dim=-1).tolist()


@needs_kernels
def test_rows_without_a_distribution_give_a_token_in_range_and_never_crash():
    inf, nan = math.inf, math.nan
    x = torch.tensor([[-inf, -inf, -inf, -inf],  # all banned
                      [nan, nan, nan, nan],
                      [0.0, nan, 1.0, -inf],  # NaN ignored: 0 and 2 share the draw
                      [0.0, inf, 1.0, 2.0]])  # +inf: that token
    params = [SamplingParams()] * 4
    tokens = kernel_path(x, params, torch.tensor([0.5, 0.5, 0.99, 0.5], dtype=torch.float64))
    assert all(0 <= t < 4 for t in tokens)
    assert tokens[2] == 2 and tokens[3] == 1


@needs_kernels
@settings(max_examples=400, deadline=None)
@given(values=st.lists(st.one_of(st.floats(width=32), st.sampled_from([0.0, -1e38, 1e38, 87.0, -88.0])),
                       min_size=1, max_size=70),
       temperature=st.floats(1e-6, 100.0), top_k=st.integers(0, 80), top_p=st.floats(0.001, 1.0),
       min_p=st.floats(0.0, 1.0), u=st.floats(0.0, 1.0, exclude_max=True))
def test_any_row_gives_a_token_in_range_with_a_finite_logit_where_one_is(values, temperature, top_k, top_p, min_p, u):
    # Any float32 values at all (NaN, +-inf, the extremes) and any settings in their ranges: never out of
    # range, and where the row has finite logits and no +inf, a token with a finite logit.
    x = torch.tensor([values], dtype=torch.float32)
    params = [SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)]
    token = kernel_path(x, params, torch.tensor([u], dtype=torch.float64))[0]
    assert 0 <= token < len(values)
    if torch.isfinite(x).any() and not (x == math.inf).any():
        assert math.isfinite(values[token])


@needs_kernels
def test_the_kernel_refuses_settings_outside_their_ranges():
    x = torch.zeros(1, 4)
    u = [0.0]
    for temperature, top_k, top_p, min_p in ((0.0, 0, 1.0, 0.0), (1.0, -1, 1.0, 0.0), (1.0, 0, 0.0, 0.0),
                                             (1.0, 0, 1.5, 0.0), (1.0, 0, 1.0, -0.1)):
        with pytest.raises(RuntimeError, match="sample_rows: row 0"):
            KERNELS.sample_rows(x, [temperature], [top_k], [top_p], [min_p], u)
    with pytest.raises(RuntimeError, match="one uniform per row"):
        KERNELS.sample_rows(x, [1.0], [0], [1.0], [0.0], [0.0, 0.5])


@needs_kernels
def test_the_kernels_repetition_penalty_is_torchs_bit_for_bit():
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(5, 300, generator=gen) * 4
    x[0, :10] = 0.0  # zero logits take the product branch
    histories = [torch.randint(0, 300, (n,), generator=gen).tolist() for n in (0, 1, 50, 400, 299)]
    penalties = [1.3, 0.7, 1.1, 2.0, 1.0]
    rows = [0, 1, 2, 3]  # row 4's penalty is 1: not listed, left as it is
    expected = apply_repetition_penalty(x.clone(), histories, penalties, rows=rows)
    ours = x.clone()
    penalised = KERNELS.repetition_penalty_rows(ours, rows, [histories[r] for r in rows], [penalties[r] for r in rows])
    assert penalised is None
    assert torch.equal(ours.view(torch.int32), expected.view(torch.int32))
    assert torch.equal(ours[4], x[4])


@needs_kernels
def test_the_kernels_repetition_penalty_returns_an_id_outside_the_vocabulary_and_changes_nothing():
    x = torch.randn(2, 10)
    before = x.clone()
    assert KERNELS.repetition_penalty_rows(x, [0, 1], [[1, 2], [3, 10]], [1.5, 1.5]) == 10
    assert KERNELS.repetition_penalty_rows(x, [0], [[-1]], [1.5]) == -1
    assert torch.equal(x, before)


def test_a_sampler_reads_histories_of_any_sequence_type_to_the_same_result():
    from sampler_harness import make_batch
    from worker.sampler import Sampler

    logits = torch.randn(2, 50, generator=torch.Generator().manual_seed(3)) * 3
    params = [SamplingParams(temperature=0, repetition_penalty=1.8)] * 2
    as_lists = Sampler()(logits, make_batch(params, histories=[[1, 2, 3], [4, 5]])).token_ids
    # A tensor history is not a list of ints to the kernel's binding: the sampler gives it to torch's path.
    if KERNELS is not None:
        with pytest.raises(TypeError):
            KERNELS.repetition_penalty_rows(logits.clone(), [0], [torch.tensor([1, 2, 3])], [1.8])
    as_tensors = Sampler()(logits, make_batch(params, histories=[torch.tensor([1, 2, 3]), torch.tensor([4, 5])]))
    penalised = apply_repetition_penalty(logits.clone(), [[1, 2, 3], [4, 5]], [1.8, 1.8])
    assert as_lists == as_tensors.token_ids == penalised.argmax(dim=-1).tolist()


@needs_kernels
def test_the_kernels_presence_and_frequency_penalties_are_torchs_bit_for_bit():
    from worker.logits_processors import apply_presence_frequency_penalties

    gen = torch.Generator().manual_seed(10)
    x = torch.randn(4, 200, generator=gen) * 3
    outputs = [torch.randint(0, 200, (n,), generator=gen).tolist() for n in (0, 3, 150, 600)]
    presence, frequency = [0.0, 0.5, -1.3, 2.0], [0.1, 0.0, 0.37, -0.7]
    rows = [1, 2, 3]
    expected = apply_presence_frequency_penalties(x.clone(), outputs, presence, frequency, rows=rows)
    ours = x.clone()
    edited = KERNELS.presence_frequency_rows(ours, rows, [outputs[r] for r in rows], [presence[r] for r in rows],
                                             [frequency[r] for r in rows])
    assert edited is None
    assert torch.equal(ours.view(torch.int32), expected.view(torch.int32))
    assert torch.equal(ours[0], x[0])
    before = ours.clone()
    assert KERNELS.presence_frequency_rows(ours, [0], [[5, 200]], [1.0], [1.0]) == 200
    assert torch.equal(ours, before)


def test_logits_in_any_memory_layout_are_sampled():
    from sampler_harness import make_batch
    from worker.sampler import Sampler

    logits = (torch.randn(50, 3, generator=torch.Generator().manual_seed(4)) * 3).t()  # [3, 50], column-major
    params = [SamplingParams(temperature=0.8, top_p=0.9, repetition_penalty=1.2, presence_penalty=0.5, seed=s)
              for s in range(3)]
    histories = [[1, 2], [3], [4, 4]]
    batch = make_batch(params, histories=histories)
    batch.output_token_ids = histories
    tokens = Sampler()(logits, batch).token_ids
    batch = make_batch(params, histories=histories)
    batch.output_token_ids = histories
    assert tokens == Sampler()(logits.contiguous(), batch).token_ids
