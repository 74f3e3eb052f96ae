"""The scheduler's plans under a full pool: what a preempted victim and a refused admission leave behind."""
from __future__ import annotations

import pytest

from pdchat.engine.block_manager import BlockManager
from pdchat.engine.config import SamplingParams
from pdchat.engine.scheduler import FIRST_SLICE, MIN_SLICE, Scheduler
from pdchat.engine.sequence import Sequence, Status
from pdchat.engine.step_cost import StepCost, attention_pairs, charged_tokens, vector_split
from pdchat.kernels import FastRows


def make_scheduler(blocks: BlockManager, cost: StepCost | None = None, *, step_budget: float = 3.0,
                   **kw) -> Scheduler:
    return Scheduler(blocks, cost or StepCost(pair_ratio=1e-3), step_budget=step_budget, **kw)


def seq(rid: str, n: int, start: int = 1) -> Sequence:
    return Sequence(rid, list(range(start, start + n)), SamplingParams())


def run(plan) -> None:
    """What the engine does after a forward: count the computed tokens, and sample one token for
    items that finished their prompt (a fixed id: only the shapes matter here)."""
    for item in plan.items:
        s = item.seq
        samples = item.samples
        s.num_computed_tokens += item.num_tokens
        if samples:
            s.token_ids.append(7)
            s.t_first_token = s.t_first_token or 1.0


def test_a_victim_planned_earlier_in_the_step_is_taken_out_of_the_plan():
    # Decodes are planned before unfinished prefills, and the victim is the latest admitted. Here
    # the latest admitted is a decode, so it is already in the plan when the older prefill finds
    # the pool empty. The state is built by hand: the plan must stay sound whatever order the
    # admission rules leave the running requests in.
    blocks = BlockManager(num_blocks=4, block_size=4, prefix_cache=False)
    sched = make_scheduler(blocks, max_num_seqs=8, chunk_size=8)
    older = seq("older", 16)                  # prefilling: 8 of 16 prompt tokens computed
    newer = seq("newer", 4, 100)              # decoding: 4 prompt tokens + 1 sampled
    newer.token_ids.append(7)
    newer.t_first_token = 1.0
    for s, computed, order in ((older, 8, 0), (newer, 4, 1)):
        assert blocks.ensure_capacity(s, computed + (1 if s is newer else 0))
        s.num_computed_tokens, s.admitted_order, s.status = computed, order, Status.RUNNING
        sched.running.append(s)
    assert blocks.num_free == 0
    plan = sched.schedule()
    assert [(i.seq.request_id, i.num_tokens) for i in plan.items] == [("older", 7)]
    assert newer.status is Status.WAITING and newer.preemptions == 1 and newer.block_table == []
    assert list(sched.waiting) == [newer]
    assert len(older.block_table) * 4 >= 8 + 7


def test_a_refused_admission_keeps_no_blocks():
    # The head of the queue matches cached prefix blocks, then cannot get the rest: it must give
    # the matched blocks back, or the running request that needs them can never finish.
    blocks = BlockManager(num_blocks=4, block_size=4, prefix_cache=True)
    sched = make_scheduler(blocks, max_num_seqs=8, chunk_size=None)
    first = seq("first", 9)
    sched.add(first)
    run(sched.schedule())
    blocks.commit(first, first.num_computed_tokens)
    sched.remove(first)                                      # its two full blocks stay cached
    runner = seq("runner", 6, 300)
    sched.add(runner)
    run(sched.schedule())                                    # holds two blocks, decoding
    newcomer = seq("newcomer", 16)                           # shares the 8 cached tokens
    sched.add(newcomer)
    plan = sched.schedule()
    assert [i.seq for i in plan.items] == [runner]
    assert newcomer.status is Status.WAITING and newcomer.block_table == []
    assert newcomer.num_computed_tokens == 0 and newcomer.t_first_scheduled is None
    assert blocks.num_used == len(runner.block_table)


def test_preemption_resets_the_victim_and_counts_every_time():
    blocks = BlockManager(num_blocks=8, block_size=4, prefix_cache=False)
    sched = make_scheduler(blocks, max_num_seqs=8, chunk_size=None)
    victim = seq("victim", 6)
    sched.add(victim)
    run(sched.schedule())
    victim.draft_computed = 5
    for n in (1, 2):
        sched._preempt(victim)
        assert victim.preemptions == n
        assert victim.num_computed_tokens == 0 and victim.draft_computed == 0
        assert victim.status is Status.WAITING and victim.block_table == [] and blocks.num_used == 0
        assert list(sched.waiting) == [victim] and sched.running == []
        run(sched.schedule())                                 # admitted again
        assert victim.status is Status.RUNNING


# ---- running requests by hand: how one step treats decodes, prefills, the budget and the pool ----
def decoding(rid: str, prompt: int, start: int = 1) -> Sequence:
    """A request past its prompt: one sampled token to compute next."""
    s = seq(rid, prompt, start)
    s.token_ids.append(7)
    s.t_first_token = 1.0
    return s


def place(sched: Scheduler, s: Sequence, computed: int, order: int, capacity: int) -> None:
    """Put s in the running list with `computed` tokens done and blocks for `capacity` tokens."""
    assert sched.blocks.ensure_capacity(s, capacity)
    s.num_computed_tokens, s.admitted_order, s.status = computed, order, Status.RUNNING
    sched.running.append(s)


def planned(plan) -> list[tuple[str, int]]:
    return [(i.seq.request_id, i.num_tokens) for i in plan.items]


def test_decodes_take_the_budget_first_and_prefills_get_what_is_left():
    sched = make_scheduler(BlockManager(32, 4, prefix_cache=False), max_num_seqs=8, chunk_size=2)
    prefill, decode = seq("p", 6), decoding("d", 4, 100)
    place(sched, prefill, 4, 0, 4)                  # 2 prompt tokens to go, listed first
    place(sched, decode, 4, 1, 5)
    plan = sched.schedule()
    assert planned(plan) == [("d", 1), ("p", 1)]    # within the budget of 2, the stream first


def test_a_spent_budget_never_starves_a_decode_and_holds_back_prefills():
    sched = make_scheduler(BlockManager(32, 4, prefix_cache=False), max_num_seqs=8, chunk_size=2)
    for i in range(3):
        place(sched, decoding(f"d{i}", 4, 100 * (i + 1)), 4, i, 5)
    place(sched, seq("p", 6), 4, 3, 4)              # 2 prompt tokens left: still a prefill
    plan = sched.schedule()
    assert planned(plan) == [("d0", 1), ("d1", 1), ("d2", 1)]


def test_a_victim_preempted_mid_loop_is_skipped_and_the_rest_still_planned():
    sched = make_scheduler(BlockManager(4, 4, prefix_cache=False), max_num_seqs=8, chunk_size=None)
    a, victim, prefill = decoding("a", 4), decoding("v", 4, 100), seq("p", 8, 200)
    place(sched, a, 4, 0, 4)                        # its next token needs a second block
    place(sched, victim, 4, 2, 5)                   # the latest admitted: two blocks
    place(sched, prefill, 4, 1, 4)                  # sorts after both decodes
    assert sched.blocks.num_free == 0
    plan = sched.schedule()
    assert planned(plan) == [("a", 1), ("p", 4)]
    assert victim.status is Status.WAITING and list(sched.waiting) == [victim]


def test_without_the_kv_cache_every_step_recomputes_the_whole_sequence():
    sched = make_scheduler(BlockManager(32, 4, prefix_cache=False), max_num_seqs=8, chunk_size=None, kv_cache=False)
    s = decoding("d", 6)
    place(sched, s, 6, 0, 7)
    plan = sched.schedule()
    assert planned(plan) == [("d", 7)] and s.num_computed_tokens == 0 and plan.items[0].samples


def test_a_lone_request_outgrowing_the_pool_fails_at_once_without_a_preemption():
    blocks = BlockManager(2, 4, prefix_cache=False)
    sched = make_scheduler(blocks, max_num_seqs=8, chunk_size=None)
    s = decoding("big", 8)
    place(sched, s, 8, 0, 8)                        # both blocks full; the next token needs a third
    plan = sched.schedule()
    assert plan.items == [] and plan.failed == [s]
    assert s.preemptions == 0 and not sched.running and not sched.waiting and blocks.num_free == 2


def test_an_unplanned_victim_gives_its_tokens_back_to_the_budget():
    sched = make_scheduler(BlockManager(4, 4, prefix_cache=False), max_num_seqs=8, chunk_size=4)
    victim, d, prefill = decoding("v", 4, 100), decoding("d", 4), seq("p", 12, 200)
    place(sched, victim, 4, 3, 5)                   # planned first, then preempted for d
    place(sched, d, 4, 1, 4)                        # needs a second block; none is free
    place(sched, prefill, 4, 2, 4)
    plan = sched.schedule()
    assert planned(plan) == [("d", 1), ("p", 3)]    # budget 4: d's one token, the prefill the rest
    assert victim.status is Status.WAITING


def test_an_unplanned_victim_without_a_budget_leaves_a_sound_plan():
    sched = make_scheduler(BlockManager(4, 4, prefix_cache=False), max_num_seqs=8, chunk_size=None)
    victim, d = decoding("v", 4, 100), decoding("d", 4)
    place(sched, victim, 4, 3, 5)
    place(sched, d, 4, 1, 4)
    place(sched, seq("p", 6, 200), 4, 2, 4)
    plan = sched.schedule()
    assert planned(plan) == [("d", 1), ("p", 2)] and victim.status is Status.WAITING


# ---- admission -------------------------------------------------------------------------------------
def test_admission_stops_at_the_batch_limit():
    sched = make_scheduler(BlockManager(32, 4, prefix_cache=False), max_num_seqs=2, chunk_size=None)
    for i in range(3):
        sched.add(seq(f"s{i}", 5, 10 * i + 1))
    plan = sched.schedule()
    assert planned(plan) == [("s0", 5), ("s1", 5)] and [s.request_id for s in sched.waiting] == ["s2"]


def test_admission_records_the_cached_prefix_and_the_first_scheduling_time_once():
    blocks = BlockManager(8, 4, prefix_cache=True)
    sched = make_scheduler(blocks, max_num_seqs=8, chunk_size=None)
    first = seq("first", 9)
    sched.add(first)
    run(sched.schedule())
    blocks.commit(first, first.num_computed_tokens)
    sched.remove(first)
    again = seq("again", 12)                                   # its first 8 tokens are cached
    sched.add(again)
    plan = sched.schedule()
    assert planned(plan) == [("again", 4)] and again.num_cached_prompt_tokens == 8
    assert (blocks.queried_tokens, blocks.hit_tokens) == (9 + 12, 8)
    t_first = again.t_first_scheduled
    assert t_first is not None and again.admitted_order == 1
    sched._preempt(again)
    run(sched.schedule())                                      # admitted again: no new lookup counted
    assert again.t_first_scheduled == t_first and again.num_cached_prompt_tokens == 8
    assert blocks.queried_tokens == 9 + 12 and again.admitted_order == 2


def test_naive_mode_admits_a_prompt_whole_despite_cached_blocks():
    blocks = BlockManager(8, 4, prefix_cache=True)
    first = seq("first", 9)
    warm = make_scheduler(blocks, max_num_seqs=8, chunk_size=None)
    warm.add(first)
    run(warm.schedule())
    blocks.commit(first, first.num_computed_tokens)
    warm.remove(first)
    naive = make_scheduler(blocks, max_num_seqs=8, chunk_size=None, kv_cache=False)
    again = seq("again", 12)
    naive.add(again)
    assert planned(naive.schedule()) == [("again", 12)] and again.num_cached_prompt_tokens == 0


def test_a_waiting_request_too_big_for_the_empty_pool_fails_and_the_next_is_admitted():
    blocks = BlockManager(2, 4, prefix_cache=False)
    sched = make_scheduler(blocks, max_num_seqs=8, chunk_size=None)
    big = decoding("big", 8)                                   # 9 tokens after a preemption: 3 blocks
    small = seq("small", 3, 100)
    sched.add(big)
    sched.add(small)
    plan = sched.schedule()
    assert plan.failed == [big] and planned(plan) == [("small", 3)]
    assert big.block_table == [] and big.num_computed_tokens == 0 and not sched.waiting


def test_a_request_that_fits_only_alone_waits_for_the_others():
    blocks = BlockManager(3, 4, prefix_cache=False)
    sched = make_scheduler(blocks, max_num_seqs=8, chunk_size=None)
    first, second = seq("first", 8), seq("second", 8, 100)     # two blocks each, three in the pool
    sched.add(first)
    sched.add(second)
    plan = sched.schedule()
    assert planned(plan) == [("first", 8)] and plan.failed == [] and list(sched.waiting) == [second]


def test_a_request_preempting_itself_still_lets_the_older_ones_run():
    sched = make_scheduler(BlockManager(3, 4, prefix_cache=False), max_num_seqs=8, chunk_size=None)
    older, newest = seq("older", 8), decoding("newest", 8, 100)
    place(sched, older, 4, 0, 4)                    # a prefill, 4 of 8 computed: one block
    place(sched, newest, 8, 1, 8)                   # a decode on two full blocks: its next token needs a third
    plan = sched.schedule()
    assert newest.status is Status.WAITING and planned(plan) == [("older", 4)]


def test_nothing_is_admitted_in_a_step_that_preempted():
    sched = make_scheduler(BlockManager(4, 4, prefix_cache=False), max_num_seqs=8, chunk_size=None)
    a, victim = decoding("a", 4), decoding("v", 4, 100)
    place(sched, a, 4, 0, 4)                        # its next token needs a second block
    place(sched, victim, 4, 1, 12)                  # three blocks: the pool is full
    # After the preemption two blocks are free: enough for the victim again, or the newcomer.
    waiting = seq("w", 2, 200)
    sched.add(waiting)
    plan = sched.schedule()
    assert planned(plan) == [("a", 1)] and list(sched.waiting) == [victim, waiting]


def _decoding(sched: Scheduler, rid: str = "stream") -> Sequence:
    """A running stream past its prompt: the next steps decode it."""
    s = seq(rid, 4)
    sched.add(s)
    run(sched.schedule())
    assert s.t_first_token is not None
    return s


CPU_ROWS = FastRows(48, 16)       # a CPU's fast path: one call up to 48 rows, taken 16 at a time


def _learned(per_token: float, per_pair: float, decode: float, fast_rows: FastRows | None = None) -> StepCost:
    """A cost model that has seen steps beside one decode of a machine whose costs are exactly these
    (rows paid by whole vectors where the kernels have them)."""
    cost = StepCost(pair_ratio=per_pair / per_token if per_pair else 1e-3, fast_rows=fast_rows)
    for _ in range(5):
        cost.record_decode(decode)
    for start, n in ((0, 64), (500, 32), (1500, 48), (100, 200), (800, 16), (300, 100)):
        pairs = attention_pairs(start, n)
        charged = charged_tokens(n, 1, cost.granule)
        cost.record_prefill(n, pairs, True, decode + per_token * charged + per_pair * pairs, other_rows=1)
    return cost


def test_a_time_budget_sizes_each_slice_to_fill_the_step_and_late_slices_are_smaller():
    per_token, per_pair, decode = 1e-3, 3e-7, 0.025      # a slice late in the prompt: ~1/2 the first
    cost = _learned(per_token, per_pair, decode)
    sched = make_scheduler(BlockManager(512, 16, prefix_cache=False), cost, step_budget=3.0, max_num_seqs=8,
                           chunk_size="auto")
    stream = _decoding(sched)
    newcomer = seq("new", 3000, start=100)
    sched.add(newcomer)
    sizes, planned = [], []
    while newcomer.num_computed_tokens < newcomer.num_prompt_tokens:
        plan = sched.schedule()
        item = next(i for i in plan.items if i.seq is newcomer)
        assert [i.seq for i in plan.items][0] is stream and plan.items[0].num_tokens == 1   # the stream decodes
        sizes.append(item.num_tokens)
        planned.append(plan.planned_s)
        run(plan)
    # Every full slice is about the largest whose cost fits two decode steps (a 3x budget); the
    # fit is pulled a little towards its prior, hence the 2%.
    for n, start, p in zip(sizes[:-1], [sum(sizes[:i]) for i in range(len(sizes))], planned):
        work = per_token * n + per_pair * attention_pairs(start, n)
        more = per_token * (n + 2) + per_pair * attention_pairs(start, n + 2)
        assert work <= 2 * decode * 1.02 and more > 2 * decode * 0.98
        assert abs(p - (decode + work)) < 0.02 * p
    assert min(sizes[:-1]) > MIN_SLICE
    assert sizes[0] > 1.8 * sizes[-2]        # attention over the longer context shrinks the slices
    assert sum(sizes) == 3000
    after = sched.schedule()                 # decodes only: no slice was sized, nothing was planned
    assert after.decode_only and after.planned_s is None


def test_a_larger_budget_takes_larger_slices():
    cost = _learned(1e-3, 1e-6, 0.025)
    firsts = []
    for budget in (2.0, 3.0, 6.0):
        sched = make_scheduler(BlockManager(512, 16, prefix_cache=False), cost, step_budget=budget,
                               max_num_seqs=8, chunk_size="auto")
        _decoding(sched)
        sched.add(seq("new", 2000, start=100))
        firsts.append(next(i.num_tokens for i in sched.schedule().items if i.seq.request_id == "new"))
    assert firsts[0] < firsts[1] < firsts[2]


def test_a_slice_is_never_below_the_minimum_even_when_the_budget_is_tight():
    cost = _learned(1e-3, 1e-6, 0.001)           # a decode step worth one token: the budget fits ~2
    sched = make_scheduler(BlockManager(512, 16, prefix_cache=False), cost, step_budget=3.0, max_num_seqs=8,
                           chunk_size="auto")
    _decoding(sched)
    sched.add(seq("new", 500, start=100))
    assert next(i.num_tokens for i in sched.schedule().items if i.seq.request_id == "new") == MIN_SLICE


def test_on_vector_kernels_a_tight_budget_takes_the_slice_that_ends_the_decodes_vector():
    # Rows by 8, a decode step worth 5 tokens, budget 3: the prefill's share fits one vector beside
    # the decode (7 tokens, 7 ms) and not two (15 tokens, 15 ms). The step keeps to the budget; a
    # floor of 16 tokens had planned 15 of them, a step of 4 decode steps.
    per_token, decode = 1e-3, 0.005
    cost = _learned(per_token, 0.0, decode, FastRows(48, 8))
    sched = make_scheduler(BlockManager(512, 16, prefix_cache=False), cost, step_budget=3.0, max_num_seqs=8,
                           chunk_size="auto")
    _decoding(sched)
    sched.add(seq("new", 500, start=100))
    plan = sched.schedule()
    assert next(i.num_tokens for i in plan.items if i.seq.request_id == "new") == 7
    assert plan.planned_s <= 3.0 * decode * 1.02


def test_before_a_decode_step_is_measured_a_fixed_first_slice_stands_in():
    sched = make_scheduler(BlockManager(512, 16, prefix_cache=False), StepCost(1e-3), max_num_seqs=8,
                           chunk_size="auto")
    _decoding(sched)
    sched.add(seq("new", 500, start=100))
    plan = sched.schedule()
    # (a token budget counts the step's every token: the stream's decode takes one)
    assert next(i.num_tokens for i in plan.items if i.seq.request_id == "new") == FIRST_SLICE - 1
    assert plan.planned_s is None


def test_with_no_stream_to_protect_a_prompt_goes_whole_under_a_time_budget():
    sched = make_scheduler(BlockManager(512, 16, prefix_cache=False), _learned(1e-3, 1e-6, 0.025),
                           max_num_seqs=8, chunk_size="auto")
    sched.add(seq("alone", 3000))
    plan = sched.schedule()
    assert [i.num_tokens for i in plan.items] == [3000] and plan.planned_s is None
    assert plan.prompt_tokens == 3000 and plan.prompt_pairs == attention_pairs(0, 3000)


def test_a_time_budgeted_slice_stays_within_the_kernels_fast_rows():
    cost = _learned(1e-4, 1e-8, 0.025, CPU_ROWS)      # cheap tokens: the budget alone would take hundreds
    sched = make_scheduler(BlockManager(512, 16, prefix_cache=False), cost, max_num_seqs=8, chunk_size="auto")
    streams = [_decoding(sched, f"s{i}") for i in range(3)]
    sched.add(seq("new", 2000, start=100))
    plan = sched.schedule()
    assert [i.num_tokens for i in plan.items] == [1, 1, 1, 45]     # 48 rows in all
    assert all(i.seq is s for i, s in zip(plan.items, streams))
    unbounded = make_scheduler(BlockManager(512, 16, prefix_cache=False), _learned(1e-4, 1e-8, 0.025),
                               max_num_seqs=8, chunk_size="auto")
    _decoding(unbounded)
    unbounded.add(seq("new", 2000, start=100))
    assert next(i.num_tokens for i in unbounded.schedule().items if i.seq.request_id == "new") > 100


@pytest.mark.parametrize("streams,budget_tokens,slice_tokens", [
    (1, 20, 15),      # 21 rows would cost what 32 do: the slice ends at 16 rows
    (1, 40, 31),
    (1, 47, 47),      # 48 rows: the fast path's limit, three whole vectors
    (1, 90, 47),
    (3, 16, 13),      # 16 tokens + 3 decodes = 19 rows: down to 16
    (10, 16, 6),      # the decodes began a vector: the slice fills it
    (16, 20, 16),
])
def test_a_time_budgeted_slice_ends_where_the_steps_rows_fill_a_vector(streams, budget_tokens, slice_tokens):
    per_token, decode = 1e-3, 0.025
    cost = _learned(per_token, 0.0, decode, CPU_ROWS)
    # A budget whose prefill share is `budget_tokens` tokens at the start of the prompt (+ half a token).
    budget = 1 + (budget_tokens + 0.5) * per_token / decode
    sched = make_scheduler(BlockManager(1024, 16, prefix_cache=False), cost, step_budget=budget,
                           max_num_seqs=32, chunk_size="auto")
    for i in range(streams):
        _decoding(sched, f"s{i}")
    sched.add(seq("new", 500, start=100))
    plan = sched.schedule()
    assert [i.num_tokens for i in plan.items] == [1] * streams + [slice_tokens]


def test_slices_grow_by_half_until_a_step_that_wide_is_measured():
    # A fresh cost model sees one slice of one vector, cheap (its rows share the vector with the
    # decode), and prices a vector of its own at the prior: by that three vectors would fit the
    # budget, but the next slice stops at two, and only once a step of two vectors is measured
    # may one of three follow.
    decode = 0.020
    cost = StepCost(pair_ratio=1e-4, fast_rows=CPU_ROWS)
    for _ in range(5):
        cost.record_decode(decode)
    cost.record_prefill(15, attention_pairs(100, 15), True, decode + 0.008, other_rows=1)
    sched = make_scheduler(BlockManager(512, 16, prefix_cache=False), cost, step_budget=4.0, max_num_seqs=8,
                           chunk_size="auto")
    _decoding(sched)
    newcomer = seq("new", 2000, start=100)
    sched.add(newcomer)
    assert cost.tokens_within(cost.prompt_seconds(4.0), 100, other_rows=1) >= 47     # what the fit alone allows
    plan = sched.schedule()
    assert [i.num_tokens for i in plan.items] == [1, 31]                # 32 rows: two vectors
    sched.record(plan, decode + 0.008 * 31 / 15, drafted=False)         # as cheap a token as the first
    run(plan)
    plan = sched.schedule()
    assert [i.num_tokens for i in plan.items] == [1, 47]                # 48 rows: now three
    sched.record(plan, decode + 0.008 * 47 / 15, drafted=False)
    run(plan)
    # Ten slices of one vector later (late in a prompt, say) the wide steps are forgotten, as the
    # fit forgets them: two vectors at most again, though the fit alone would allow three.
    for _ in range(10):
        cost.record_prefill(15, attention_pairs(100, 15), True, decode + 0.008, other_rows=1)
    assert cost.tokens_within(cost.prompt_seconds(4.0), newcomer.num_computed_tokens, other_rows=1) >= 47
    plan = sched.schedule()
    assert [i.num_tokens for i in plan.items] == [1, 31]


def test_a_prompts_last_slice_is_what_is_left_whatever_the_vectors():
    cost = _learned(1e-3, 0.0, 0.025, CPU_ROWS)
    sched = make_scheduler(BlockManager(1024, 16, prefix_cache=False), cost, step_budget=1 + 40.5 / 25,
                           max_num_seqs=8, chunk_size="auto")
    _decoding(sched)
    sched.add(seq("new", 51, start=100))
    plan = sched.schedule()
    assert [i.num_tokens for i in plan.items] == [1, 31]                # 32 rows
    run(plan)
    plan = sched.schedule()
    assert [i.num_tokens for i in plan.items] == [1, 20]                # 21 rows: the rest of it


def test_steps_past_the_fast_path_do_not_teach_the_slices_fit():
    cost = _learned(1e-3, 1e-7, 0.025, CPU_ROWS)
    sched = make_scheduler(BlockManager(512, 16, prefix_cache=False), cost, max_num_seqs=8, chunk_size=64)
    _decoding(sched)
    sched.add(seq("new", 300, start=100))
    slices = cost.coefficients()
    plan = sched.schedule()
    assert [i.num_tokens for i in plan.items] == [1, 63]              # a fixed chunk: 64 rows, op by op
    start = plan.items[1].start                                       # predicted as it is learned
    assert plan.predicted_s == pytest.approx(cost.step_seconds(cost.prefill_seconds(start, 63, decoded=False)))
    sched.record(plan, 0.5, drafted=False)                             # far dearer per token than a slice
    assert cost.coefficients() == slices
    assert cost.coefficients(decoded=False) != slices
    run(plan)
    sched.chunk_size = 32
    plan = sched.schedule()
    assert [i.num_tokens for i in plan.items] == [1, 31]              # 32 rows: one call, a slice
    assert plan.predicted_s == pytest.approx(cost.step_seconds(cost.prefill_seconds(plan.items[1].start, 31,
                                                                                    other_rows=1)))
    sched.record(plan, 0.5, drafted=False)
    assert cost.coefficients() != slices


def test_the_cost_model_learns_decode_steps_without_drafts_and_every_prefill():
    cost = StepCost(pair_ratio=1e-3)
    sched = make_scheduler(BlockManager(64, 16, prefix_cache=False), cost, max_num_seqs=8, chunk_size="auto")
    stream = seq("s", 4)
    sched.add(stream)
    first = sched.schedule()
    assert first.prompt_tokens == 4
    sched.record(first, 0.050, drafted=False)
    assert cost.decode_s is None and cost.prefill_seconds(0, 4, decoded=False) == pytest.approx(0.050, rel=0.01)
    run(first)
    decode = sched.schedule()
    assert decode.decode_only
    sched.record(decode, 0.020, drafted=True)       # a verify with drafts: not a decode step's time
    assert cost.decode_s is None
    sched.record(decode, 0.020, drafted=False)
    assert cost.decode_s == 0.020


def test_a_slices_timed_attention_reaches_the_cost_model():
    cost = StepCost(pair_ratio=1e-3, fast_rows=CPU_ROWS)
    sched = make_scheduler(BlockManager(512, 16, prefix_cache=False), cost, max_num_seqs=8, chunk_size="auto")
    _decoding(sched)
    sched.record(sched.schedule(), 0.020, drafted=False)          # a decode step
    sched.add(seq("new", 200, start=100))
    plan = sched.schedule()
    assert plan.prompt_tokens and plan.num_decode_tokens == 1
    sched.record(plan, 0.045, drafted=True, tile_seconds=0.008)     # a verify's tiles in it: not the slice's
    before = cost.coefficients().pair
    assert before != pytest.approx(0.008 / plan.prompt_pairs)
    sched.record(plan, 0.045, drafted=False, tile_seconds=0.004)
    assert cost.coefficients().pair == pytest.approx(0.004 / plan.prompt_pairs)


# ---- a time budget's accounting within one step ------------------------------------------------------
def _stream_beside(sched: Scheduler) -> Sequence:
    stream = decoding("stream", 4, 500)
    place(sched, stream, 4, 0, 5)
    return stream


def test_a_second_prompt_gets_the_seconds_the_first_left():
    # 1 ms a token, a decode step of 25 ms, budget 3: 50 ms of prompt work a step. The first prompt's
    # 20 tokens take 20 of them, the second the ~30 left (the fit is pulled slightly to its prior).
    cost = _learned(1e-3, 0.0, 0.025)
    sched = make_scheduler(BlockManager(64, 16, prefix_cache=False), cost, max_num_seqs=8, chunk_size="auto")
    _stream_beside(sched)
    sched.add(seq("short", 20, 100))
    sched.add(seq("long", 400, 200))
    plan = sched.schedule()
    (stream, short, long), left = plan.items, cost.prompt_seconds(3.0) - cost.prefill_seconds(0, 20, other_rows=1)
    assert (stream.num_tokens, short.num_tokens) == (1, 20) and 0.029 < left < 0.031
    assert long.num_tokens == cost.tokens_within(left, 0, other_rows=21) and 28 <= long.num_tokens <= 31
    assert plan.planned_s == pytest.approx(cost.step_seconds(cost.prefill_seconds(0, 20 + long.num_tokens,
                                                                                  other_rows=1)))


def test_a_slice_taken_back_by_a_preemption_gives_its_seconds_to_the_next():
    # p1 (the latest admitted) is planned first, 20 tokens of the 50 ms; p2 then finds the pool
    # short, p1 is preempted, and its 20 ms go back: p3 gets the 20 ms that p2's 30 tokens leave.
    cost = _learned(1e-3, 0.0, 0.025)
    sched = make_scheduler(BlockManager(19, 4, prefix_cache=False), cost, max_num_seqs=8, chunk_size="auto")
    _stream_beside(sched)                                 # 2 blocks
    p1, p2, p3 = seq("p1", 40, 100), seq("p2", 100, 200), seq("p3", 100, 400)
    place(sched, p1, 20, 3, 20)                           # 5 blocks; 20 more tokens need 5 more
    place(sched, p2, 4, 1, 4)                             # 1 block; its ~30 tokens need 8 more
    place(sched, p3, 4, 2, 4)                             # 1 block; 10 free in all
    plan = sched.schedule()
    assert p1.status is Status.WAITING and p1.preemptions == 1
    (stream, a, b) = plan.items
    assert (stream.seq, a.seq, b.seq) == (sched.running[0], p2, p3)
    assert 28 <= a.num_tokens <= 31
    left = cost.prompt_seconds(3.0) - cost.prefill_seconds(4, a.num_tokens, other_rows=1)
    assert b.num_tokens == cost.tokens_within(left, 4, other_rows=1 + a.num_tokens) and 18 <= b.num_tokens <= 21


def test_a_two_token_prompt_beside_a_stream_goes_whole():
    sched = make_scheduler(BlockManager(64, 16, prefix_cache=False), _learned(1e-3, 0.0, 0.025), max_num_seqs=8,
                           chunk_size="auto")
    _stream_beside(sched)
    sched.add(seq("tiny", 2, 100))
    assert planned(sched.schedule()) == [("stream", 1), ("tiny", 2)]


def test_a_step_without_prompt_tokens_predicts_nothing():
    sched = make_scheduler(BlockManager(64, 16, prefix_cache=False), _learned(1e-3, 0.0, 0.025), max_num_seqs=8,
                           chunk_size="auto")
    _stream_beside(sched)
    plan = sched.schedule()
    assert plan.decode_only and plan.predicted_s == 0.0 and plan.planned_s is None


def test_a_slice_is_predicted_as_a_slice_beside_its_decodes():
    cost = _learned(1e-3, 1e-7, 0.025, CPU_ROWS)
    sched = make_scheduler(BlockManager(64, 16, prefix_cache=False), cost, max_num_seqs=8, chunk_size="auto")
    _stream_beside(sched)
    sched.add(seq("new", 300, 100))
    plan = sched.schedule()
    n = plan.prompt_tokens
    assert plan.timed and 0 < n <= 47
    sliced = cost.step_seconds(cost.work_seconds(cost.charged(n, 1, True), plan.prompt_pairs, True))
    whole = cost.step_seconds(cost.work_seconds(cost.charged(n, 1, False), plan.prompt_pairs, True))
    assert plan.predicted_s == pytest.approx(sliced) and sliced != pytest.approx(whole)


@pytest.mark.parametrize("granule, planned_rows, want", [
    (8, 1, 7),            # one decode: the slice ends the first vector
    (16, 15, 1),          # fifteen decodes: one token ends theirs
    (8, 8, 8),            # the decodes fill a vector: the next one whole
    (8, 10, 6),
    (32, 32, 32),
    (1, 3, MIN_SLICE),    # rows by any count: MIN_SLICE tokens
])
def test_the_minimum_slice_ends_the_vector_the_decodes_began(granule, planned_rows, want):
    from pdchat.engine.scheduler import _PlanBuilder
    cost = StepCost(pair_ratio=1e-3, fast_rows=FastRows(96, granule) if granule > 1 else None)
    assert _PlanBuilder(None, 1.0, cost)._min_slice(planned_rows) == want


def test_a_step_counts_as_a_slice_beside_decodes_and_within_the_fast_rows():
    from pdchat.engine.scheduler import _as_slice
    assert _as_slice(47, 1, CPU_ROWS) and not _as_slice(48, 1, CPU_ROWS)
    assert not _as_slice(40, 10, CPU_ROWS)              # 50 rows: past the one-call path
    assert not _as_slice(20, 0, CPU_ROWS) and _as_slice(500, 1, None)


def test_a_prefill_step_is_learned_with_its_decode_rows_and_whether_the_budget_sized_it():
    seen = []
    cost = _learned(1e-3, 0.0, 0.025, CPU_ROWS)
    cost.record_prefill = lambda *a, **kw: seen.append((a, kw))
    sched = make_scheduler(BlockManager(64, 16, prefix_cache=False), cost, max_num_seqs=8, chunk_size="auto")
    for i in range(3):
        place(sched, decoding(f"d{i}", 4, 100 * (i + 1)), 4, i, 5)
    sched.add(seq("new", 300, 1000))
    plan = sched.schedule()
    sched.record(plan, 0.05, drafted=False)
    (args, kw), = seen
    assert args == (plan.prompt_tokens, plan.prompt_pairs, True, 0.05, 3)
    assert kw == {"attention_s": None, "timed": True}
    run(plan)
    sched.chunk_size = 16                               # a fixed chunk: measured, not sized by the budget
    plan = sched.schedule()
    assert plan.prompt_tokens + plan.num_decode_tokens == 16 and not plan.timed
    sched.record(plan, 0.05, drafted=False)
    assert seen[-1][1] == {"attention_s": None, "timed": False}


def test_a_sequence_prefilled_elsewhere_joins_the_running_batch():
    sched = make_scheduler(BlockManager(64, 16, prefix_cache=False), max_num_seqs=8, chunk_size=None)
    first, handed = seq("first", 4), seq("handed", 6, 100)
    sched.add(first)
    run(sched.schedule())
    handed.num_computed_tokens = 5                       # its K/V is in its blocks but for the last token
    assert sched.blocks.ensure_capacity(handed, 6)
    sched.add_running(handed)
    assert handed.status is Status.RUNNING and handed.admitted_order > first.admitted_order
    assert sched.running == [first, handed]
    assert planned(sched.schedule()) == [("first", 1), ("handed", 1)]


@pytest.mark.parametrize("budget, second", [(2.3, 5), (2.45, 21)])
def test_a_slice_is_charged_for_the_rows_it_adds_beside_the_others(budget, second):
    # Rows by vectors of 16: the first prompt's 10 tokens share the stream's vector and are charged
    # the 15 that fill it (not 16 as if alone in a step, nor 11 of a second vector); the second
    # prompt gets what is left: 5 tokens that end that vector, or a whole one more (21).
    cost = _learned(1e-3, 0.0, 0.025, CPU_ROWS)
    sched = make_scheduler(BlockManager(512, 16, prefix_cache=False), cost, step_budget=budget, max_num_seqs=8,
                           chunk_size="auto")
    _stream_beside(sched)
    place(sched, seq("a", 14, 100), 4, 1, 4)
    place(sched, seq("b", 400, 1000), 4, 2, 4)
    assert planned(sched.schedule()) == [("stream", 1), ("a", 10), ("b", second)]


def test_a_late_slice_is_sized_for_the_most_tokens_a_second_of_the_whole_step():
    # b, 500 tokens into its prompt, pays attention over them: per second of a step that already
    # holds the stream's decode and a's slice, 34 tokens prefill the most; weighed against the
    # decode step alone, 26 would.
    cost = _learned(1e-3, 1e-6, 0.025, CPU_ROWS)
    sched = make_scheduler(BlockManager(512, 16, prefix_cache=False), cost, step_budget=4.0, max_num_seqs=8,
                           chunk_size="auto")
    _stream_beside(sched)
    place(sched, seq("a", 9, 100), 4, 1, 4)
    place(sched, seq("b", 800, 1000), 500, 2, 500)
    assert planned(sched.schedule()) == [("stream", 1), ("a", 5), ("b", 34)]
    left = cost.prompt_seconds(4.0) - cost.prefill_seconds(4, 5, other_rows=1)
    assert cost.tokens_within(left, 500, other_rows=6, most=42) == 26


def test_a_preempted_decode_gives_back_no_prompt_seconds():
    # A decode is not charged to the time budget (the step is its to begin with), so when it is
    # preempted the prompts after it get what they would have had anyway.
    cost = _learned(1e-3, 0.0, 0.025)
    sched = make_scheduler(BlockManager(22, 4, prefix_cache=False), cost, max_num_seqs=8, chunk_size="auto")
    _stream_beside(sched)                                 # 2 blocks
    victim = decoding("victim", 36, 100)
    place(sched, victim, 36, 5, 37)                       # 10 blocks, the latest admitted
    p2, p3 = seq("p2", 40, 200), seq("p3", 100, 400)
    place(sched, p2, 20, 1, 20)                           # 5 blocks; its last 20 tokens need 5 more
    place(sched, p3, 4, 2, 4)                             # 1 block; 4 free
    plan = sched.schedule()
    assert victim.status is Status.WAITING
    assert [i.seq for i in plan.items] == [sched.running[0], p2, p3]
    assert plan.items[1].num_tokens == 20 and 28 <= plan.items[2].num_tokens <= 31


def test_beside_48_decodes_the_fast_rows_are_full_and_a_prompt_still_moves_one_token():
    cost = _learned(1e-3, 0.0, 0.025, CPU_ROWS)
    sched = make_scheduler(BlockManager(128, 16, prefix_cache=False), cost, max_num_seqs=64, chunk_size="auto")
    for i in range(48):
        place(sched, decoding(f"d{i}", 4, 10 * i + 1), 4, i, 5)
    sched.add(seq("new", 300, 1000))
    plan = sched.schedule()
    assert [i.num_tokens for i in plan.items] == [1] * 49 and plan.items[-1].seq.request_id == "new"


def test_a_slice_capped_below_the_best_width_takes_the_widest_allowed():
    # The fit remembers three-vector slices, and three prefill the most per second of the step;
    # after ten slices of one the step may grow to two vectors only, and two is what it takes.
    cost = StepCost(pair_ratio=1e-4, fast_rows=CPU_ROWS)
    for _ in range(5):
        cost.record_decode(0.025)
    for n in [15, 31, 47] * 3 + [15] * 10:
        split = vector_split(n, 1, 16, 3)
        price = sum(p * c for p, c in zip((0.5e-3, 0.8e-3, 1.0e-3), split))
        cost.record_prefill(n, attention_pairs(100, n), True, 0.025 + price, other_rows=1)
    sched = make_scheduler(BlockManager(512, 16, prefix_cache=False), cost, step_budget=4.0, max_num_seqs=8,
                           chunk_size="auto")
    _stream_beside(sched)
    sched.add(seq("new", 500, 1000))
    assert cost.slice_rows_cap(1) == 32 and cost.tokens_within(cost.prompt_seconds(4.0), 0, other_rows=1) == 47
    assert planned(sched.schedule()) == [("stream", 1), ("new", 31)]
