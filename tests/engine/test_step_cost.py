"""The step cost model: what it learns from measured steps and what it predicts."""
from __future__ import annotations

from typing import Callable

import pytest

from pdchat.engine.model_config import ModelConfig
from pdchat.engine.step_cost import (Coefficients, StepCost, attention_pairs, charged_tokens, pair_flops_ratio,
                                      vector_split, _linear_solve)
from pdchat.kernels import FastRows


def test_attention_pairs_count_each_token_seeing_itself_and_everything_before():
    assert attention_pairs(0, 1) == 1
    assert attention_pairs(0, 4) == 1 + 2 + 3 + 4
    assert attention_pairs(10, 2) == 11 + 12


def test_rows_past_a_whole_vector_are_charged_as_one():
    assert [charged_tokens(n, 1, 16) for n in (1, 15, 16, 31, 32)] == [15, 15, 31, 31, 47]
    assert [charged_tokens(n, 10, 16) for n in (6, 7)] == [6, 22]    # the decodes' vector is free to fill
    assert [charged_tokens(n, 0, 16) for n in (1, 16, 17)] == [16, 16, 32]
    assert [charged_tokens(n, 3, 1) for n in (1, 17)] == [1, 17]        # no vectors: a token is a token


Work = Callable[[int, int], float]     # a machine's prompt work: (start, tokens) -> seconds


def _seen(work: Work, slices, decode: float, pair_ratio: float, attention: Work | None = None) -> StepCost:
    """A cost model with rows by 16 that has seen `slices` ((start, tokens) each, beside one decode)
    on a machine whose decode step takes `decode` and a slice's prompt work exactly `work`; told
    the slices' attention time where `attention` gives it."""
    cost = StepCost(pair_ratio=pair_ratio, fast_rows=FastRows(48, 16))
    for _ in range(3):
        cost.record_decode(decode)
    for start, n in slices:
        cost.record_prefill(n, attention_pairs(start, n), True, decode + work(start, n), 1,
                            attention(start, n) if attention else None)
    return cost


def _vector_machine(per_token: float, per_pair: float, decode: float) -> StepCost:
    """A cost model that has seen a machine whose every charged token costs the same."""
    def work(start: int, n: int) -> float:
        return per_token * charged_tokens(n, 1, 16) + per_pair * attention_pairs(start, n)
    return _seen(work, ((0, 47), (47, 31), (78, 15), (93, 47), (140, 20), (160, 31), (500, 9), (900, 31)),
                 decode, per_pair / per_token)


def test_by_vectors_a_slice_fills_its_last_vector_early_and_ends_where_it_prefills_fastest():
    cost = _vector_machine(1e-3, 1e-6, 0.025)
    assert cost.coefficients() == ((pytest.approx(1e-3, rel=0.02),) * 3, pytest.approx(1e-6, rel=0.05))

    def rate(start: int, n: int) -> float:         # prompt tokens a second of the whole step
        return n / cost.step_seconds(cost.prefill_seconds(start, n, other_rows=1))
    # Early, pairs cost little: 47 tokens (3 vectors with the decode) fit 52 ms, 48 would need a 4th.
    assert cost.tokens_within(0.052, 0, other_rows=1) == 47
    assert cost.tokens_within(0.052, 0, other_rows=1, most=40) == 40
    # At position 300, 40 ms: two vectors with 28 tokens' pairs fit, 29 do not; the part-full
    # second vector prefills faster than one full vector.
    assert cost.tokens_within(0.040, 300, other_rows=1) == 28
    assert cost.prefill_seconds(300, 28, other_rows=1) <= 0.040 < cost.prefill_seconds(300, 29, other_rows=1)
    assert rate(300, 28) > rate(300, 15)
    # Late (from position 1,500 a token's pairs cost 1.5 ms), 60 ms: 19 tokens in two vectors fit,
    # but they pay for 31 and prefill slower than the 15 of one vector, in a shorter step.
    assert cost.tokens_within(0.060, 1500, other_rows=1) == 15
    assert cost.prefill_seconds(1500, 19, other_rows=1) <= 0.060
    assert rate(1500, 15) > rate(1500, 19)
    # In a step that costs far more whatever the slice (other slices planned), the fuller vector
    # pays off again.
    assert cost.tokens_within(0.060, 1500, other_rows=1, floor_s=0.2) == 19


def test_each_vector_of_a_step_has_its_own_price_and_one_never_measured_is_priced_as_the_one_before():
    assert [vector_split(n, 1, 16, 3) for n in (1, 15, 16, 31, 47)] == \
        [(15, 0, 0), (15, 0, 0), (15, 16, 0), (15, 16, 0), (15, 16, 16)]
    assert vector_split(5, 16, 16, 3) == (0, 16, 0)       # the decodes ended the first vector
    assert vector_split(5, 20, 16, 3) == (0, 12, 0)       # ... and began the second: the slice fills it
    assert vector_split(40, 1, 16, 2) == (15, 32)         # past the last vector: counted as the last's
    assert vector_split(20, 3, 1, 1) == (20,)             # rows by any count: every token the first's
    # A machine where the first 15 tokens beside a decode ride its read of the weights (0.5 ms
    # each), a second vector costs arithmetic (1.2 ms a token) and a third more (1.8).
    per_vector, per_pair, decode = (0.5e-3, 1.2e-3, 1.8e-3), 1e-6, 0.015

    def truth(start: int, n: int) -> float:
        split = vector_split(n, 1, 16, 3)
        return sum(c * k for c, k in zip(per_vector, split)) + per_pair * attention_pairs(start, n)

    # Seen one- and two-vector slices only: the third vector is priced as the second (and the
    # second, seen twice, a little towards the first).
    cost = _seen(truth, ((0, 15), (15, 15), (30, 31), (61, 15), (76, 15), (91, 31), (122, 15), (137, 15)),
                 decode, per_pair / 1.2e-3)
    second = cost.coefficients().vectors[1]
    assert cost.coefficients() == ((pytest.approx(0.5e-3, rel=0.05), pytest.approx(1.2e-3, rel=0.05),
                                    pytest.approx(second, rel=1e-9)),
                                   pytest.approx(per_pair, rel=0.05))
    # Then a three-vector one: each is the machine's, and so are the predictions.
    cost = _seen(truth, ((0, 15), (15, 15), (30, 31), (61, 15), (76, 47), (123, 15), (138, 31), (169, 15), (184, 15)),
                 decode, per_pair / 1.2e-3)
    assert cost.coefficients() == (tuple(pytest.approx(c, rel=0.05) for c in per_vector),
                                   pytest.approx(per_pair, rel=0.05))
    for n in (15, 31, 47):
        assert cost.prefill_seconds(300, n, other_rows=1) == pytest.approx(truth(300, n), rel=0.03)
    # At the start 47 tokens take 56.6 ms, 31 take 27.2: a budget of 57 holds either, and the
    # two vectors prefill more tokens a second of the whole step.
    assert truth(0, 47) <= 0.057
    assert cost.tokens_within(0.057, 0, other_rows=1) == 31
    assert 31 / (decode + truth(0, 31)) > 47 / (decode + truth(0, 47))


def _first_vector_free(per_pair: float) -> StepCost:
    """A cost model that has fitted the first vector at zero: two two-vector slices (the second
    vector 1.2 ms a token), then late one-vector slices that cost less than their pairs say (the
    decode step they are measured against was slower), the attention timed at `per_pair` a pair."""
    own, decode = 1.2e-3, 0.02
    cost = StepCost(pair_ratio=per_pair / own, fast_rows=FastRows(48, 16))
    cost.record_decode(decode)
    for start in (0, 31):
        pairs = attention_pairs(start, 31)
        cost.record_prefill(31, pairs, True, decode + 16 * own + per_pair * pairs, 1, per_pair * pairs)
    for start in range(1000, 1500, 15):
        pairs = attention_pairs(start, 15)
        cost.record_prefill(15, pairs, True, decode + per_pair * pairs - 0.0005, 1, per_pair * pairs)
    return cost


def test_a_first_vector_fitted_free_still_leaves_the_next_vectors_charged():
    # A second vector must still be paid for where the first is fitted at zero (it once was
    # not, and 18-27-token slices were planned at 80-109 ms against 64).
    per_pair = 1e-6
    cost = _first_vector_free(per_pair)
    assert cost.coefficients().token == 0.0
    budget = per_pair * attention_pairs(1500, 20)          # the pairs of 20 tokens, not a vector's worth
    assert cost.tokens_within(budget, 1500, other_rows=1) == 15
    assert cost.prefill_seconds(1500, 15, other_rows=1) <= budget < cost.prefill_seconds(1500, 16, other_rows=1)


def _late_slices_machine(timed: bool) -> tuple[StepCost, Work]:
    """A cost model that has seen a prompt prefilled beside a decode as a budget slices it: twelve
    two-vector slices, then one-vector slices to position 1,700, on a machine whose attention
    costs a little more per pair as the context grows; told the attention's time when `timed`."""
    vectors, per_pair, decode = (0.9e-3, 1.15e-3, 1.15e-3), 0.7e-6, 0.02

    def attention(start: int, n: int) -> float:
        pairs = attention_pairs(start, n)
        return per_pair * pairs * (1 + pairs / 40000)

    def truth(start: int, n: int) -> float:
        return sum(c * k for c, k in zip(vectors, vector_split(n, 1, 16, 3))) + attention(start, n)
    sizes = [31] * 12 + [15] * 88
    slices = [(sum(sizes[:i]), n) for i, n in enumerate(sizes)]
    return _seen(truth, slices, decode, per_pair / 1.15e-3, attention if timed else None), truth


def test_attention_timed_apart_keeps_the_vectors_price_through_slices_that_are_all_alike():
    timed, truth = _late_slices_machine(True)
    assert timed.coefficients().token == pytest.approx(0.9e-3, rel=0.02)
    assert timed.prefill_seconds(1700, 15, other_rows=1) == pytest.approx(truth(1700, 15), rel=0.03)
    # (the second vector, last measured 88 steps before, is priced near the first: see below)
    assert timed.prefill_seconds(0, 31, other_rows=1) == pytest.approx(truth(0, 31), rel=0.15)
    # From the step times alone the first vector takes a share of the growing attention's cost
    # and its price falls: the next prompt's two-vector slices would be planned at half their cost.
    untimed, _ = _late_slices_machine(False)
    assert untimed.coefficients().token < 0.5 * 0.9e-3
    assert untimed.prefill_seconds(0, 31, other_rows=1) < 0.5 * truth(0, 31)


def test_a_vector_measured_once_is_priced_as_its_neighbour_again_after_a_while():
    cost = StepCost(pair_ratio=1e-3, fast_rows=FastRows(48, 16))
    cost.record_decode(0.02)

    def one_vector_slices(count: int) -> None:
        for _ in range(count):
            cost.record_prefill(15, 0, True, 0.02 + 15 * 1e-3, 1, 0.0)
    one_vector_slices(10)
    cost.record_prefill(31, 0, True, 0.02 + 15 * 1e-3 + 16 * 4e-3, 1, 0.0)   # one slow step (a cold start)
    one_vector_slices(3)
    assert cost.coefficients().vectors[1] > 3.5e-3           # fresh, it holds
    one_vector_slices(60)
    assert cost.coefficients().vectors[1] < 1.3e-3           # long after, the first vector's price again
    cost.record_prefill(31, 0, True, 0.02 + 15 * 1e-3 + 16 * 2e-3, 1, 0.0)
    assert cost.coefficients().vectors[1] > 1.85e-3          # and a new measurement takes over


def test_a_wide_step_that_ran_fast_does_not_make_wider_steps_look_cheap():
    # Slices of 15 tokens beside a decode (vectors of 8: the first two, always split 7 and 8, so
    # the fit cannot tell them apart), then one of 31 whose last two vectors ran at a quarter of
    # the price. Fitted freely the third and fourth were priced at 0.6 and 0.23 ms a token, the
    # never measured fifth and sixth as the fourth, and 47 tokens predicted at 35 ms where 15
    # take 22.5: a budget of 40 ms would have planned the 47 (the 64-row step planned at 107 ms
    # that took 170 on a 2-core AMD EPYC).
    cost = StepCost(pair_ratio=1e-3, fast_rows=FastRows(48, 8))
    cost.record_decode(0.03)
    for _ in range(12):
        cost.record_prefill(15, 0, True, 0.03 + 15 * 1.5e-3, 1, 0.0)
    cost.record_prefill(31, 0, True, 0.03 + 15 * 1.5e-3 + 16 * 0.4e-3, 1, 0.0)
    for _ in range(2):
        cost.record_prefill(15, 0, True, 0.03 + 15 * 1.5e-3, 1, 0.0)
    prices = cost.coefficients().vectors
    assert all(a <= b for a, b in zip(prices, prices[1:]))
    at = {n: cost.prefill_seconds(0, n, other_rows=1) for n in (15, 31, 47)}
    assert at[47] - at[31] >= at[31] - at[15] > 0.015
    assert at[15] == pytest.approx(15 * 1.5e-3, rel=0.1)          # what was measured still holds
    assert cost.tokens_within(0.04, 0, other_rows=1) == 23     # three vectors with the decode's row, not six


def test_prices_out_of_order_are_pooled_by_their_data_until_none_falls():
    from pdchat.engine.step_cost import _non_decreasing
    assert _non_decreasing([1.0, 2.0, 3.0], [1.0, 1.0, 1.0]) == [1.0, 2.0, 3.0]
    assert _non_decreasing([2.0, 1.0], [3.0, 1.0]) == [pytest.approx(1.75)] * 2      # weighted by its data
    # A pool that falls below the price before it takes that one in too.
    assert _non_decreasing([2.0, 3.0, 0.5], [1.0, 1.0, 1.0]) == [pytest.approx(5.5 / 3)] * 3
    assert _non_decreasing([1.0, 0.2, 4.0], [1.0, 0.0, 1.0]) == [1.0, 1.0, 4.0]      # one never measured


def test_a_whole_prompt_is_charged_by_its_tokens_whatever_the_vectors():
    cost = StepCost(pair_ratio=1e-4, fast_rows=FastRows(48, 16))   # (BLAS takes it, not the vector kernels)
    for n in (17, 100, 250, 1000, 33):
        pairs = attention_pairs(0, n)
        cost.record_prefill(n, pairs, False, 1e-3 * n + 1e-7 * pairs)
    alone = cost.coefficients(decoded=False)
    assert (alone.token, alone.pair) == (pytest.approx(1e-3, rel=0.01), pytest.approx(1e-7, rel=0.05))
    assert cost.prefill_seconds(0, 17, decoded=False) == pytest.approx(0.017 + 1e-7 * attention_pairs(0, 17), rel=0.01)


def test_the_fit_recovers_a_machines_costs_from_its_steps():
    per_token, per_pair, decode = 1.2e-3, 4e-7, 0.025
    cost = StepCost(pair_ratio=1e-3)            # a prior ratio off by 3x: the data must win
    for _ in range(3):
        cost.record_decode(decode)
    for start, n in ((0, 40), (40, 17), (57, 33), (90, 64), (154, 16), (170, 90), (260, 25), (285, 48)):
        pairs = attention_pairs(start, n)
        cost.record_prefill(n, pairs, True, decode + per_token * n + per_pair * pairs)
    got_token, got_pair = cost.coefficients().token, cost.coefficients().pair
    assert got_token == pytest.approx(per_token, rel=0.05)
    assert got_pair == pytest.approx(per_pair, rel=0.1)
    n = cost.tokens_within(2 * decode, 1000)
    assert cost.prefill_seconds(1000, n) <= 2 * decode < cost.prefill_seconds(1000, n + 1)


def test_recent_steps_outweigh_old_ones_when_the_machine_slows_down():
    cost = StepCost(pair_ratio=1e-4)
    cost.record_decode(0.02)
    for speed in (1.0, 3.0):
        for start, n in ((0, 32), (32, 64), (96, 16), (112, 48)) * 8:
            cost.record_prefill(n, attention_pairs(start, n), True, 0.02 + speed * 1e-3 * n)
    assert cost.coefficients().token == pytest.approx(3e-3, rel=0.1)


def test_before_any_prefill_a_slice_of_sixteen_tokens_costs_about_a_decode_step():
    cost = StepCost(pair_ratio=0.0)
    cost.record_decode(0.032)
    assert cost.prefill_seconds(0, 16) == pytest.approx(0.032)
    assert cost.tokens_within(0.032, 0) == 16


def test_the_prior_pair_cost_is_the_models_flop_ratio():
    cfg = ModelConfig(model_type="llama", vocab_size=100, hidden_size=64, intermediate_size=128, num_layers=2,
                      num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5, rope_theta=1e4,
                      max_position=128, tie_embeddings=True)
    linear = 64 * (4 + 2 * 2) * 16 + 4 * 16 * 64 + 3 * 64 * 128     # q, k, v, o, gate, up, down
    assert pair_flops_ratio(cfg) == pytest.approx(2 * 4 * 16 / linear)


def test_slices_that_are_all_alike_do_not_shrink_the_next_ones():
    # The budget picks 16-token slices for a while (late in a prompt, say); what they teach must
    # still let a larger slice fit a larger allowance early in the next prompt.
    per_token, per_pair, decode = 0.9e-3, 1e-6, 0.026
    cost = StepCost(pair_ratio=3e-4)
    cost.record_decode(decode)
    for start in range(1000, 1700, 16):
        pairs = attention_pairs(start, 16)
        cost.record_prefill(16, pairs, True, decode + per_token * 16 + per_pair * pairs)
    fits = cost.tokens_within(2 * decode, 0)
    truth = max(n for n in range(1, 200) if per_token * n + per_pair * attention_pairs(0, n) <= 2 * decode)
    assert fits == pytest.approx(truth, rel=0.15)


def test_a_long_lone_prompt_does_not_teach_the_slices_beside_streams():
    # A whole prompt alone runs at about half the per-token cost of a slice beside a stream
    # (BLAS and flash attention against one C call): the slices keep their own fit.
    cost = StepCost(pair_ratio=3e-4)
    cost.record_decode(0.026)
    for start, n in ((0, 24), (24, 30), (54, 20), (74, 28)):
        cost.record_prefill(n, attention_pairs(start, n), True, 0.026 + 1e-3 * n)
    beside = cost.coefficients()
    cost.record_prefill(1800, attention_pairs(0, 1800), False, 0.026 + 0.4e-3 * 1800)
    assert cost.coefficients() == beside
    assert cost.coefficients(decoded=False).token < beside.token / 2
    assert cost.prefill_seconds(0, 1800, decoded=False) == pytest.approx(0.4e-3 * 1800, rel=0.05)


def test_a_known_fixed_cost_is_taken_out_of_the_fit_and_out_of_the_budget():
    # A GPU: decodes replay a graph in 1.25 ms, a step with prompt tokens pays 10 ms of launches
    # first, then 8 us a token.
    cost = StepCost(pair_ratio=0.0)
    cost.fixed = lambda: 0.010
    cost.record_decode(0.00125)
    for n in (128, 300, 700, 64):
        cost.record_prefill(n, 0, True, 0.00125 + 0.010 + 8e-6 * n)
    assert cost.coefficients().token == pytest.approx(8e-6, rel=0.02)
    # the budget (2.5 decode steps) cannot hold the fixed cost: a slice may cost that much again
    assert cost.prompt_seconds(2.5) == pytest.approx(0.010)
    assert cost.tokens_within(cost.prompt_seconds(2.5), 0) == pytest.approx(1250, abs=2)
    assert cost.step_seconds(0.004) == pytest.approx(0.00125 + 0.010 + 0.004)


def test_without_a_fixed_cost_the_budget_is_its_share_past_the_decode_step():
    cost = StepCost(pair_ratio=0.0)
    cost.record_decode(0.02)
    assert cost.prompt_seconds(2.5) == pytest.approx(0.03)
    cost.fixed = lambda: 0.005                   # a small one comes out of the share
    assert cost.prompt_seconds(2.5) == pytest.approx(0.025)


def test_the_decode_step_is_a_running_average_that_follows_the_machine():
    cost = StepCost(pair_ratio=1e-3)
    cost.record_decode(0.020)
    assert cost.decode_s == 0.020                             # the first step as it is
    cost.record_decode(0.040)
    assert cost.decode_s == pytest.approx(0.9 * 0.020 + 0.1 * 0.040)     # then weighed in, not taken


def test_before_any_decode_step_a_step_is_predicted_as_its_prompt_work_alone():
    cost = StepCost(pair_ratio=1e-3)
    assert cost.decode_s is None
    assert cost.step_seconds(0.25) == 0.25


def test_a_slice_step_widens_the_cap_by_its_rows_and_only_a_step_with_prompt_tokens_counts():
    cost = StepCost(pair_ratio=1e-3, fast_rows=FastRows(48, 16))
    assert [cost.slice_rows_cap(rows) for rows in (0, 1, 30)] == [32, 32, 46]    # nothing measured yet
    cost.record_prefill(0, 0, True, 0.02, other_rows=1)       # no prompt tokens: nothing learned
    assert cost.slice_rows_cap(1) == 32 and cost.coefficients() == StepCost(1e-3, FastRows(48, 16)).coefficients()
    cost.record_prefill(1, attention_pairs(40, 1), True, 0.03, other_rows=20)    # one token beside 20 decodes
    assert cost.slice_rows_cap(1) == 37                        # a vector past the 21 rows of that step
    cost.record_prefill(39, attention_pairs(0, 39), True, 0.08, other_rows=1)
    assert cost.slice_rows_cap(1) == 64                        # half as wide again as 40 rows, in whole vectors


def test_a_fixed_chunks_steps_are_learned_from_but_do_not_widen_the_cap():
    # All alike, a fixed chunk's steps do not tell a step's vectors apart: the budget's slices
    # grow from what it measured itself, and after ten chunks from two vectors again.
    cost = StepCost(pair_ratio=1e-3, fast_rows=FastRows(48, 16))
    cost.record_decode(0.025)
    cost.record_prefill(39, attention_pairs(0, 39), True, 0.09, other_rows=1)          # a budgeted slice
    learned = cost.coefficients()
    assert cost.slice_rows_cap(1) == 64
    cost.record_prefill(47, attention_pairs(100, 47), True, 0.11, other_rows=1, timed=False)
    assert cost.coefficients() != learned                      # measured...
    assert cost.slice_rows_cap(1) == 64                        # ...but not 72 for its 48 rows
    for start in range(200, 2000, 200):
        cost.record_prefill(47, attention_pairs(start, 47), True, 0.11, other_rows=1, timed=False)
    assert cost.slice_rows_cap(1) == 32 and cost.slice_rows_cap(20) == 36     # two vectors, or one past the decodes


def test_no_time_or_less_than_the_first_vector_costs_fits_no_tokens():
    cost = _vector_machine(1e-3, 0.0, 0.025)               # 15 tokens beside a decode: ~15 ms
    assert cost.tokens_within(0.0, 0, other_rows=1) == 0
    assert cost.tokens_within(0.010, 0, other_rows=1) == 0
    assert cost.tokens_within(0.016, 0, other_rows=1) == 15
    rows_by_any = StepCost(pair_ratio=1e-3)
    rows_by_any.record_decode(0.025)
    assert rows_by_any.tokens_within(0.0, 0) == 0 and rows_by_any.tokens_within(-1.0, 0) == 0


def test_attention_pairs_are_an_exact_integer_count():
    """A step's pairs are summed into its plan's prompt_pairs (an int) and fed to the fit: a count,
    exact however long the context, not a float that rounds past 2**53."""
    assert isinstance(attention_pairs(7, 5), int) and attention_pairs(7, 5) == 5 * 7 + 15


def test_a_split_has_a_count_for_every_vector_whatever_the_granule():
    """vector_split gives one count per vector: where rows go by any count all in the first (the
    others zero, not missing); with vectors of two rows as with 16, the decodes' vector first; and
    rows past the last vector counted as the last's, not as another's."""
    assert vector_split(20, 3, 1, 3) == (20, 0, 0)
    # a decode and 3 tokens: 4 rows, two vectors; the decode's holds one token, the next two
    assert vector_split(3, 1, 2, 3) == (1, 2, 0)
    # 60 tokens beside a decode: 61 rows, charged as 64, the last 16 past the third vector
    assert vector_split(60, 1, 16, 3) == (15, 16, 16 + 16)


def test_a_whole_prompt_is_charged_in_the_first_vector_with_a_count_for_each_other():
    """A prompt run whole (not beside decodes) is charged by its tokens, all in the first vector,
    and zero in each of the others: the fit lines the counts up with its columns, the pairs last."""
    assert StepCost(pair_ratio=1e-3, fast_rows=FastRows(48, 16)).charged(100, 0, decoded=False) == (100, 0, 0)
    assert StepCost(pair_ratio=1e-3).charged(100, 0, decoded=False) == (100,)


def test_before_any_decode_step_the_budget_share_is_the_fixed_cost_alone():
    """With no decode step measured, the budget (a multiple of it) leaves prompt work nothing past
    the fixed cost, which may be paid again as ever."""
    cost = StepCost(pair_ratio=1e-3)
    assert cost.prompt_seconds(2.5) == 0.0
    cost.fixed = lambda: 0.010
    assert cost.prompt_seconds(2.5) == pytest.approx(0.010)


def test_where_rows_go_by_any_count_a_budget_fits_the_most_tokens_it_can():
    """Without vectors, tokens_within is the most tokens whose predicted cost (prefill_seconds) is
    within the budget: early and late in a prompt, a few tokens and thousands (where each one's
    pairs cost more than its own price), and none where not one fits. Each budget lies halfway
    between n tokens' cost and n + 1's."""
    cost = StepCost(pair_ratio=2e-3)
    cost.record_decode(0.02)
    for start, n in ((0, 64), (64, 200), (264, 30), (294, 500)):
        pairs = attention_pairs(start, n)
        cost.record_prefill(n, pairs, True, 0.02 + 1e-3 * n + 2e-6 * pairs)
    for start in (0, 40, 3000):
        for n in (0, 1, 2, 7, 120, 900, 2500):
            budget = (cost.prefill_seconds(start, n) + cost.prefill_seconds(start, n + 1)) / 2
            assert cost.tokens_within(budget, start) == n, (start, n)


def test_a_budget_of_a_slices_predicted_cost_fits_that_slice():
    """What tokens_within plans and what prefill_seconds predicts agree: a budget of n tokens'
    predicted cost (and half a pair, against rounding) fits those n, from one token late in a long
    prompt to three vectors early. (A step whose other work is long: the fullest slice that fits
    is also the fastest.)"""
    cost = _vector_machine(1e-3, 1e-6, 0.025)
    half_pair = cost.coefficients().pair / 2
    for start in (0, 300, 1500, 10000):
        for n in (1, 5, 15, 20, 31, 40, 47):
            budget = cost.prefill_seconds(start, n, other_rows=1) + half_pair
            assert cost.tokens_within(budget, start, other_rows=1, floor_s=10.0) == n, (start, n)
    # Attention free: a budget of exactly k whole vectors' cost fits them (no room left is room enough).
    free = _vector_machine(1e-3, 0.0, 0.025)
    for n in (15, 31, 47):
        assert free.tokens_within(free.prefill_seconds(0, n, other_rows=1), 0, other_rows=1) == n


def test_slices_do_not_depend_on_the_unit_of_time():
    """A machine a thousand times slower (a large model on a small CPU: a second a token, fewer
    than one prompt token a second of the whole step) given a thousand times the budget plans the
    same slices as the default one: whole vectors early in a prompt, a part-full one at 300, one
    vector at 1,500, and at 10,000 (a token's pairs 10 ms) the two tokens whose pairs fit what the
    first vector leaves of 40 ms."""
    fast, slow = _vector_machine(1e-3, 1e-6, 0.025), _vector_machine(1.0, 1e-3, 25.0)
    for start, seconds, n in ((0, 0.052, 47), (300, 0.040, 28), (1500, 0.060, 15), (10000, 0.040, 2)):
        assert fast.tokens_within(seconds, start, other_rows=1) == n
        assert slow.tokens_within(1000 * seconds, start, other_rows=1) == n


def test_the_fit_is_solved_once_per_measurement_and_again_for_a_new_prior():
    """The scheduler asks for predictions many times a step: the coefficients are solved when a
    measurement or the prior (a decode step's sixteenth) changes, not on each question."""
    cost = StepCost(pair_ratio=1e-3, fast_rows=FastRows(48, 16))
    cost.record_decode(0.016)
    first = cost.coefficients()
    assert first.token == pytest.approx(0.001)              # nothing measured: the prior
    assert cost.coefficients() is first
    for _ in range(10):
        cost.record_decode(0.032)
    assert cost.coefficients().token == pytest.approx(cost.decode_s / 16)
    again = cost.coefficients()
    cost.record_prefill(15, attention_pairs(0, 15), True, cost.decode_s + 0.02, 1)
    assert cost.coefficients() is not again
    assert cost.coefficients().token == pytest.approx(0.02 / 15, rel=0.01)     # the measurement, not the prior


def test_a_timed_attention_prices_the_pairs_from_the_first_pair():
    """Where the kernels time the attention, the pair's price is that time over the pairs from the
    first timed step on, even a one-token slice at the start of a prompt (a single pair), whatever
    the step took besides."""
    cost = StepCost(pair_ratio=1e-3, fast_rows=FastRows(48, 16))
    cost.record_decode(0.02)
    cost.record_prefill(1, attention_pairs(0, 1), True, 0.02 + 0.004, 1, attention_s=3e-6)
    assert cost.coefficients().pair == pytest.approx(3e-6)


def test_nothing_fits_a_budget_below_a_tokens_pairs_even_in_a_step_that_costs_nothing_else():
    """With the first vector fitted free and nothing else in the step (floor 0), a budget below
    one token's pairs plans no tokens: 0 tokens a second, not 0 / 0."""
    per_pair = 1e-6
    cost = _first_vector_free(per_pair)
    assert cost.coefficients().token == 0.0
    assert cost.tokens_within(per_pair * 1000, 1500, other_rows=1, floor_s=0.0) == 0
    assert cost.tokens_within(per_pair * 1600, 1500, other_rows=1, floor_s=0.0) == 1


def _priced(vectors, pair: float, decode: float, fast_rows: FastRows = FastRows(48, 16)) -> StepCost:
    """A cost model whose decode step measured `decode` and whose prices are given, not fitted
    (as a fit may hold some at zero): what tokens_within makes of them."""
    cost = StepCost(pair_ratio=1e-3, fast_rows=fast_rows)
    cost.record_decode(decode)
    prices = Coefficients(tuple(vectors), pair)
    cost.coefficients = lambda decoded=True: prices
    return cost


U = 2.0 ** -10        # about a millisecond, exact in binary: ties below are exact


def test_of_two_widths_that_prefill_alike_the_shorter_is_planned():
    """A decode step of 15u and vectors of u, 2u and 4u a token make 15 tokens beside a decode
    (30u) and 31 (62u) equally fast: 2u a token of the whole step, and the third vector past the
    budget. Without attention costs, a tie: the shorter slice, its step ends sooner; with them,
    the 31's later tokens see more keys, and the 15 is faster."""
    for pair in (0.0, 1e-6):
        cost = _priced((U, 2 * U, 4 * U), pair, 15 * U)
        assert cost.tokens_within(0.070, 0, other_rows=1) == 15
        assert cost.prefill_seconds(0, 31, other_rows=1) <= 0.070 < cost.prefill_seconds(0, 32, other_rows=1)


def test_no_time_fits_no_tokens_even_where_the_tokens_are_priced_at_nothing():
    """A budget of 0 plans nothing, even where the vectors past the decodes' and the attention
    are priced at nothing (16 decodes fill the first vector), so that any budget at all fits both."""
    cost = _priced((U, 0.0, 0.0), 0.0, 15 * U)
    assert cost.tokens_within(0.0, 0, other_rows=16) == 0
    assert cost.tokens_within(1e-9, 0, other_rows=16) == 32


def test_with_vectors_of_two_rows_a_slice_still_ends_where_a_vector_ends():
    """Vectors of 2 rows (a decode and 3 tokens: 2 vectors; 4 tokens: 5 rows, 3 vectors, 5 tokens
    charged): a budget of 4.5 tokens' price plans 3, not the 4 that the price per token alone allows."""
    cost = _priced((U,) * 4, 0.0, 15 * U, FastRows(8, 2))
    assert cost.tokens_within(4.5 * U, 0, other_rows=1) == 3
    assert cost.prefill_seconds(0, 3, other_rows=1) <= 4.5 * U < cost.prefill_seconds(0, 4, other_rows=1)


def test_the_fits_linear_solve_solves_and_says_when_it_cannot():
    assert _linear_solve([[2.0, 1.0], [1.0, 3.0]], [4.0, 7.0]) == pytest.approx([1.0, 2.0])
    assert _linear_solve([[1.0, 2.0], [2.0, 4.0]], [1.0, 2.0]) is None       # singular
