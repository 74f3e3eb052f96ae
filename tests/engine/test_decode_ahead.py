"""Decode ahead (engine/decode_ahead.py): the next decode step replayed before this one's tokens
are read must change nothing but the timing.

With a GPU, real graphs on the Triton kernels; without one, the graphs are the CPU double (a
replay re-runs the captured forward) on torch's kernels (BOOKKEEPING_KERNELS). Each run is
compared with the same engine reading its tokens before any replay ahead (the plain path), so
the kernels are the same and the tokens must be too.
"""
from __future__ import annotations

from types import SimpleNamespace

import torch

from pdchat.engine import Engine, SamplingParams
from pdchat.engine.decode_ahead import DecodeAhead
from pdchat.engine.scheduler import ScheduledSeq
from tests.doubles.eager_graph import BOOKKEEPING_KERNELS, EagerGraph

GPU = torch.cuda.is_available()
PROMPTS = ["hello there", "a longer prompt with more words in it", "x"]


def _engine(rows: int) -> Engine:
    # A context of 256 keeps a graph's decode attention in one part (test_cuda_graphs replays the split).
    engine = Engine(model="random:tiny", device="cuda" if GPU else "cpu", kernels=BOOKKEEPING_KERNELS, dtype="float32",
                    telemetry=False, kv_cache_mb=4, max_num_seqs=rows, max_model_len=256, block_size=16)
    if not GPU:
        engine.runner.use_graphs(engine.settings.notices, new_graph=EagerGraph, reserve=engine.blocks.ensure_capacity)
        engine.runner.prepare_graphs()
    return engine


def _texts_and_tokens(engine: Engine, params: list[SamplingParams]) -> list[tuple[str, list[int]]]:
    # Admitted in one go (generate), decoding side by side: a request that came a step later would
    # drop the step replayed ahead for the others.
    return [(c.text, c.token_ids) for c in engine.generate(PROMPTS, params)]


def _plain(engine: Engine, monkeypatch) -> None:
    """Read every step's tokens before anything else is replayed."""
    monkeypatch.setattr(engine.runner, "tokens_to_host", lambda tokens, goes_on=None: tokens.tolist())


def test_replaying_ahead_gives_the_plain_steps_tokens(monkeypatch) -> None:
    params = [SamplingParams(max_tokens=26, temperature=0, ignore_eos=True),
              SamplingParams(max_tokens=13, temperature=0.8, seed=7, ignore_eos=True),    # drawn, seeded
              SamplingParams(max_tokens=14, temperature=0, ignore_eos=True)]
    with _engine(rows=3) as engine:
        ahead = _texts_and_tokens(engine, params)
        used = engine.runner.ahead.used
        # About 25 decode steps (how many run alone depends on when the loop admits the three
        # requests): each takes the step replayed ahead but the first and those after a row's
        # last token (known: nothing is replayed in vain). 16 without the blocks taken ahead
        # where a row's next token starts a new block.
        assert used >= 19 and engine.runner.ahead.dropped == 0
        _plain(engine, monkeypatch)
        assert _texts_and_tokens(engine, params) == ahead
        assert engine.runner.ahead.used == used


def test_a_row_that_ends_on_eos_drops_the_step_replayed_for_it(monkeypatch) -> None:
    with _engine(rows=1) as engine:
        free = engine.generate(PROMPTS[:1], SamplingParams(max_tokens=14, temperature=0, ignore_eos=True))[0]
        # a token first chosen after a few decode steps, before the last (after which no step is
        # replayed ahead): make it the end of sequence
        end = next(j for j in range(3, 13) if free.token_ids[j] not in free.token_ids[:j])
        monkeypatch.setattr(engine.outputs, "eos_token_ids", frozenset({free.token_ids[end]}))
        dropped = engine.runner.ahead.dropped
        ended = engine.generate(PROMPTS[:1], SamplingParams(max_tokens=14, temperature=0))[0]
        assert ended.finish_reason == "stop" and ended.token_ids == free.token_ids[:end]   # the end token is not output
        # the pool holds what a plain run wrote: the next request decodes as it would have
        again = engine.generate(PROMPTS[:1], SamplingParams(max_tokens=14, temperature=0, ignore_eos=True))[0]
        assert engine.runner.ahead.dropped == dropped + 1    # taken by no step: the row had ended
        assert again.token_ids == free.token_ids


class _Graphs:
    """What DecodeAhead asks of the graphs: the device, the capture count, a replay."""
    device, captures = torch.device("cpu"), 1

    def __init__(self):
        self.runs = []

    def run(self, rows, max_batch, weights, ids=None):
        self.runs.append((rows, ids))
        return torch.full((len(rows.positions), 3), float(len(self.runs)))


def _row(computed: int, table: list[int], outputs: int = 1, max_tokens: int = 100) -> ScheduledSeq:
    seq = SimpleNamespace(num_computed_tokens=computed, num_output_tokens=outputs,
                          params=SimpleNamespace(max_tokens=max_tokens), block_table=table)
    return ScheduledSeq(seq, 1)


def test_the_step_ahead_is_taken_only_by_the_rows_and_positions_it_was_replayed_for() -> None:
    graphs = _Graphs()
    ahead = DecodeAhead(graphs, block_size=4, max_model_len=64)
    items = [_row(5, [7, 3]), _row(2, [9, 8])]
    assert ahead.read(items, torch.tensor([11, 12]), 4, "w") == [11, 12]
    rows, ids = graphs.runs[-1]
    # the tokens sampled now sit at positions 6 and 3: block 3 slot 2, block 9 slot 3
    assert rows.positions == [6, 3] and rows.slots == [3 * 4 + 2, 9 * 4 + 3] and rows.context_lens == [7, 4]
    assert ids.tolist() == [11, 12]
    for item in items:                                 # the host appended the tokens
        item.seq.num_computed_tokens += 1
    assert torch.equal(ahead.take(items, 4, "w"), torch.full((2, 3), 1.0)) and ahead.used == 1
    assert ahead.take(items, 4, "w") is None           # taken once
    ahead.read(items, torch.tensor([1, 2]), 4, "w")
    items[1].seq.num_computed_tokens += 2              # not where the replay put it
    assert ahead.take(items, 4, "w") is None and ahead.dropped == 1
    ahead.read(items, torch.tensor([1, 2]), 4, "w")
    assert ahead.take(items, 4, "int8") is None and ahead.dropped == 2     # other weights
    ahead.read(items, torch.tensor([1, 2]), 4, "w")
    assert ahead.take(items[:1], 4, "w") is None and ahead.dropped == 3   # other rows


def test_no_step_is_replayed_ahead_for_a_row_that_ends_or_has_no_block_for_it() -> None:
    graphs = _Graphs()
    ahead = DecodeAhead(graphs, block_size=4, max_model_len=64)
    assert ahead.read([_row(5, [7, 3], outputs=9, max_tokens=10)], torch.tensor([1]), 4, "w") == [1]
    assert ahead.read([_row(62, list(range(16)))], torch.tensor([1]), 4, "w") == [1]    # at max_model_len
    assert ahead.read([_row(7, [7, 3])], torch.tensor([1]), 4, "w") == [1]   # position 8: a third block
    assert graphs.runs == []
    asked = []
    ahead = DecodeAhead(graphs, block_size=4, max_model_len=64,
                        reserve=lambda seq, n: asked.append(n) or seq.block_table.append(5) or True)
    ahead.read([_row(7, [7, 3])], torch.tensor([1]), 4, "w")
    assert asked == [9] and graphs.runs[-1][0].slots == [5 * 4]


def test_rows_preempted_from_a_full_pool_decode_ahead_as_they_would_plainly(monkeypatch) -> None:
    # 26 blocks of 4 tokens cannot hold the four requests at once: the scheduler preempts and
    # recomputes, and blocks are taken ahead where a row's next token starts one
    engine = Engine(model="random:tiny", device="cuda" if GPU else "cpu", kernels=BOOKKEEPING_KERNELS, dtype="float32",
                    telemetry=False, num_kv_blocks=26, block_size=4, max_num_seqs=4, max_model_len=256)
    with engine:
        if not GPU:
            engine.runner.use_graphs(engine.settings.notices, new_graph=EagerGraph,
                                     reserve=engine.blocks.ensure_capacity)
            engine.runner.prepare_graphs()
        prompts = PROMPTS + ["another one"]

        def run() -> tuple[list[list[int]], int]:
            done = engine.generate(prompts, [SamplingParams(max_tokens=10 + 3 * i, temperature=0, ignore_eos=True)
                                             for i in range(len(prompts))])    # admitted together: the pool runs short
            return [c.token_ids for c in done], sum(c.metrics.preemptions for c in done)
        ahead, preempted = run()
        assert preempted > 0 and engine.runner.ahead.used > 0
        _plain(engine, monkeypatch)
        assert run()[0] == ahead
