"""Decode steps from CUDA graphs (engine/cuda_graphs.py): the ladder, padding, static buffers,
recapture and the fallback to eager decoding.

Without a GPU the graphs are a CPU double (tests/doubles/eager_graph.py: a replay re-runs the
captured function over the static buffers, as a real replay re-runs its kernels) and the Triton
kernels run in Triton's interpreter; with one, the same tests run the real graphs on it.
"""
from __future__ import annotations

import torch

from pdchat.engine import Engine, SamplingParams
from pdchat.engine.cuda_graphs import DecodeBuffers, ladder, padded_size
from tests.doubles.eager_graph import BOOKKEEPING_KERNELS, EagerGraph, FailingGraph
from tests.greedy import disagreements

GPU = torch.cuda.is_available()
DEVICE = "cuda" if GPU else "cpu"
PROMPTS = ["hello there", "a longer prompt with more words in it", "x"]


def test_ladder_covers_every_batch_up_to_the_limit() -> None:
    assert ladder(64) == [1, 2, 4, 8, 16, 32, 48, 64]
    assert ladder(1) == [1]
    assert ladder(5) == [1, 2, 4, 5]
    assert ladder(20) == [1, 2, 4, 8, 16, 20]
    sizes = ladder(64)
    assert [padded_size(sizes, n) for n in (1, 3, 5, 9, 17, 33, 50, 64)] == [1, 4, 8, 16, 32, 48, 64, 64]
    assert padded_size(sizes, 65) is None


def test_buffers_start_as_padding_and_views_share_addresses() -> None:
    b = DecodeBuffers.allocate(8, 3, torch.device("cpu"))
    assert b.slot_mapping.tolist() == [-1] * 8 and b.context_lens.tolist() == [0] * 8
    assert b.query_start_loc.tolist() == list(range(9))
    v = b.first(4)
    assert v.input_ids.data_ptr() == b.input_ids.data_ptr() and v.input_ids.shape == (4,)
    assert v.query_start_loc.tolist() == [0, 1, 2, 3, 4] and v.block_tables.shape == (4, 3)


def _engine(graph=None, kernels: str = "triton", **kw) -> Engine:
    """An engine on `kernels`; its graphs are real on a GPU, else the CPU double (or `graph`,
    anywhere)."""
    # A short context keeps the fixed attention splits few (the interpreter runs every program).
    engine = Engine(model="random:tiny", device=DEVICE, kernels=kernels, dtype="float32", telemetry=False,
                    kv_cache_mb=4, max_num_seqs=4, max_model_len=512, **kw)
    if graph is not None or not GPU:
        engine.runner.use_graphs(engine.settings.notices, new_graph=graph or EagerGraph)
        engine.runner.prepare_graphs()
    return engine


def _greedy(engine: Engine, n: int = 8, prompts: list[str] = PROMPTS) -> list[list[int]]:
    done = engine.generate(prompts, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
    return [c.token_ids for c in done]


def test_graph_decoding_matches_eager_decoding_on_a_padded_batch() -> None:
    # Three requests decode together in the graph of 4 rows. A padding row that stored K/V (slot
    # 0 is the first request's first block) or a row read from a stale buffer would change tokens.
    with _engine() as engine:
        graphs = engine.runner.graphs
        seen, fill = [], graphs._fill
        graphs._fill = lambda rows, size: (seen.append((len(rows.input_ids), size)), fill(rows, size))
        with_graphs = _greedy(engine, n=6)
        stats = engine.stats()
        assert stats.graph_state == "on" and stats.graph_replays == len(seen) >= 5   # 6 tokens: 1 from the prefill
        assert graphs.sizes == [1, 2, 4]
        assert (3, 4) in seen and (stats.graph_rows, stats.graph_size) == seen[-1]
        engine.update(cuda_graphs=False)
        eager = _greedy(engine, n=6)
        assert engine.stats().graph_replays == len(seen) and engine.stats().graph_state == "off"   # off means off
        assert with_graphs == eager          # float32 on both paths: the same tokens


def test_greedy_rows_take_the_token_their_replay_picked_and_sampled_rows_still_sample(monkeypatch) -> None:
    # A replay leaves each row's argmax; an all-greedy step takes it and picks nothing on the host.
    # A stale token (the replay before's) or one picked from the wrong row would change the tokens.
    import pdchat.engine.engine as engine_module
    import pdchat.engine.sampler as sampler
    picked, drawn = [], []              # host-side argmaxes; sample() calls that drew at random
    real_draw = sampler.draw_rows
    monkeypatch.setattr(sampler, "draw_rows", lambda probs, g: drawn.append(probs.shape[0]) or real_draw(probs, g))
    assert engine_module.sample is sampler.sample
    with _engine(kernels=BOOKKEEPING_KERNELS) as engine:
        ops = engine.runner.model.ops         # (the kernels' greedy: what sample() runs on the host)
        real_greedy = ops.greedy
        monkeypatch.setattr(ops, "greedy", lambda logits: picked.append(logits.shape[0]) or real_greedy(logits))
        steps, run_step = [], engine.runner.run_step
        engine.runner.run_step = lambda *a: steps.append(run_step(*a)) or steps[-1]
        with_graphs = _greedy(engine, n=6)
        replays = engine.stats().graph_replays
        assert replays >= 5 and sum(s.greedy is not None for s in steps) == replays
        assert len(picked) == len(steps) - replays          # only the steps with prompt tokens picked on the host
        engine.update(cuda_graphs=False)
        picked.clear()
        assert _greedy(engine, n=6) == with_graphs and len(picked) >= 6
        engine.update(cuda_graphs=True)
        seeded = SamplingParams(max_tokens=4, temperature=0.9, seed=3, ignore_eos=True)
        first = engine.generate(PROMPTS[:1], seeded)[0].token_ids
        assert engine.stats().graph_replays > replays and len(drawn) == 4      # every step drew its token
        engine.update(cuda_graphs=False)
        assert engine.generate(PROMPTS[:1], seeded)[0].token_ids == first


def test_the_op_by_op_steps_extra_cost_is_measured_at_capture() -> None:
    with _engine(kernels=BOOKKEEPING_KERNELS) as engine:
        graphs = engine.runner.graphs
        if GPU:
            assert graphs.eager_extra_s > 0.0                # op by op is slower than a replay
            assert engine.scheduler.cost.fixed == graphs.mixed_step_extra    # the time budget's fixed cost
        else:
            graphs.eager_extra_s = 0.010                     # nothing to measure off a GPU: stand in for it
        assert graphs.mixed_step_extra() == graphs.eager_extra_s
        engine.update(cuda_graphs=False)
        assert graphs.mixed_step_extra() == 0.0      # no graphs: every step runs op by op alike


def test_new_weights_are_captured_again_and_int8_decodes_through_the_graphs() -> None:
    with _engine() as engine:
        graphs = engine.runner.graphs
        engine.update(quant="int8")
        assert engine.config.quant == "int8"                  # the Triton int8 product runs here
        tokens = _greedy(engine, n=4, prompts=PROMPTS[:1])[0]
        assert graphs.replays == 3
        # graphs still holding the float weights' products would stray from the eager int8 forward
        ids = engine.encode(PROMPTS[0])
        assert disagreements(ids, tokens, engine.prompt_logits(ids + tokens), tie=1e-4) == []


def test_batch_limit_growing_captures_a_longer_ladder() -> None:
    with _engine(kernels=BOOKKEEPING_KERNELS) as engine:
        engine.update(max_num_seqs=6)
        _greedy(engine, n=2, prompts=PROMPTS[:1])
        assert engine.runner.graphs.sizes == [1, 2, 4, 6]
        assert engine.stats().graph_replays == 1


def test_a_failed_capture_decodes_eagerly_with_a_notice() -> None:
    with _engine(graph=FailingGraph, kernels=BOOKKEEPING_KERNELS) as engine:
        assert engine.stats().graph_state.startswith("failed: RuntimeError")
        notices = engine.take_notices()
        assert any("CUDA graphs could not be captured" in n and "decoding eagerly" in n for n in notices)
        tokens = _greedy(engine, n=4, prompts=PROMPTS[:2])
        assert [len(t) for t in tokens] == [4, 4]
        assert engine.stats().graph_replays == 0
        engine.update(cuda_graphs=False)
        engine.update(cuda_graphs=True)              # toggling on tries again (and fails again, once)
        _greedy(engine, n=2, prompts=PROMPTS[:1])
        assert sum("could not be captured" in n for n in engine.take_notices()) == 1


def test_graphs_are_not_made_off_the_gpu_by_the_engine_itself() -> None:
    with Engine(model="random:tiny", device="cpu", telemetry=False, kv_cache_mb=4) as engine:
        assert engine.runner.graphs is None
        assert engine.stats().graph_state == "n/a on cpu"
        engine.update(cuda_graphs=False)
        assert engine.stats().graph_state == "off"
