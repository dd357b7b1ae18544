"""async-scheduling: a decode step on the static buffers is queued before the one before it is read back, its inputs
taken from the tokens that step left on the device. The tokens must be those of the synchronous engine, the
outputs one call later, and nothing lost at the end, on an abort, a preemption or a step that runs eagerly."""
import pytest

from engine_helpers import invariance_prompts, tiny
from engine import LLM
from engine.config import load_config
from engine.effective import effective


def _llm(model, async_scheduling, **kw):
    llm = LLM(tiny(model=model, **{"async-scheduling": async_scheduling}, **kw))
    llm.engine.model_runner.use_static_decode(capture=False)  # the graphs' buffers, run eagerly on the CPU
    return llm


@pytest.mark.parametrize("model", ["tiny", "tiny-hybrid"])
def test_the_same_tokens_as_the_synchronous_engine(model):
    prompts = invariance_prompts()
    want = _llm(model, False).generate(prompts, 12)
    llm = _llm(model, True)
    assert llm.generate(prompts, 12) == want
    graphs = llm.engine.model_runner.decode_graphs
    assert graphs.steps > 0 and not llm.engine.has_unfinished()


def test_the_tokens_come_one_call_later_and_every_one_arrives():
    engine = _llm("tiny", True).engine
    sync = _llm("tiny", False).engine
    for e in (engine, sync):
        e.add_request(list(range(5, 25)), 6, request_id="a")
    got = {"async": [], "sync": []}
    calls = {"async": 0, "sync": 0}
    for label, e in (("async", engine), ("sync", sync)):
        while e.has_unfinished():
            calls[label] += 1
            got[label] += [t for out in e.step() for t in out.new_token_ids]
    assert got["async"] == got["sync"] and len(got["sync"]) == 6
    assert calls["async"] == calls["sync"] + 1  # the last step's tokens are read back by a call of their own


def test_an_abort_while_a_step_is_on_its_way_is_honoured():
    engine = _llm("tiny", True).engine
    engine.add_request(list(range(5, 25)), 20, request_id="a")
    engine.add_request(list(range(30, 41)), 20, request_id="b")
    for _ in range(4):
        engine.step()
    assert engine._pending is not None
    engine.abort("a")
    seen = []
    while engine.has_unfinished():
        seen += [o.request_id for o in engine.step()]
    assert "a" not in seen and seen.count("b") > 0


def test_preemption_under_a_small_cache_keeps_the_tokens():
    prompts = invariance_prompts()
    small = {"max-model-len": 128, "kv-cache-memory": 8 * 16 * 1024}  # 8 blocks: one sequence of 128 tokens
    want = _llm("tiny", False, **small).generate(prompts, 30)
    llm = _llm("tiny", True, **small)
    assert llm.engine.model_runner.num_blocks == 8
    assert llm.generate(prompts, 30) == want
    assert llm.engine.stats["preemptions"] > 0


def test_it_is_ignored_where_no_graphs_run():
    eff = effective(load_config(tiny(**{"async-scheduling": True})))
    assert "async-scheduling" in eff["ignored"] and "async-scheduling" not in eff["configuration"]
