import json
import logging
import sys
import types

import pytest

import kernels
from engine_helpers import tiny
from engine import LLM
from engine.config import ConfigError
from engine.llm_engine import LLMEngine, StepOutput


@pytest.fixture(scope="module")
def engine():
    return LLMEngine(tiny())


def drain(engine):
    """All step outputs until idle, grouped by request."""
    tokens, finals = {}, {}
    while engine.has_unfinished():
        for out in engine.step():
            assert isinstance(out, StepOutput)
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            finals[out.request_id] = out
    return tokens, finals


def test_step_api_streams_tokens_and_reports_prompt_and_cached_counts(engine):
    llm_tokens = LLM(tiny()).generate([list(range(40)), list(range(40)) + [7]], 5)
    before = dict(engine.stats)
    a = engine.add_request(list(range(40)), 5)
    first = engine.step()  # a's prompt is cached now
    assert [(o.request_id, len(o.new_token_ids), o.finished) for o in first] == [(a, 1, False)]
    b = engine.add_request(list(range(40)) + [7], 5, request_id="mine")
    assert b == "mine" and a != b
    tokens, finals = drain(engine)
    tokens[a] = first[0].new_token_ids + tokens[a]
    assert [tokens[a], tokens[b]] == llm_tokens
    assert finals[a].finished and finals[b].finished
    assert finals[b].num_prompt_tokens == 41 and finals[b].num_cached_tokens == 32
    after = engine.stats
    assert after["prompt_tokens"] - before["prompt_tokens"] == 81
    assert after["generation_tokens"] - before["generation_tokens"] == 10
    assert after["requests_finished"] - before["requests_finished"] == 2
    assert after["prefix_cache_hits"] - before["prefix_cache_hits"] == 32


def test_abort_drops_a_request_and_frees_its_blocks(engine):
    free = engine.scheduler.block_manager.num_free_blocks
    a = engine.add_request([1, 2, 3], 50)
    engine.step()
    engine.abort(a)
    engine.abort("no-such-request")
    assert not engine.has_unfinished()
    assert engine.step() == []
    assert engine.scheduler.block_manager.num_free_blocks == free


@pytest.mark.parametrize("prompt, max_tokens, match", [
    ([], 4, "at least one token"),
    ([1, 512], 4, "outside the vocabulary"),
    ([1, 2], 0, "max_tokens"),
    ([1] * 250, 10, "max-model-len"),
])
def test_bad_requests_are_refused_and_nothing_is_queued(engine, prompt, max_tokens, match):
    with pytest.raises(ValueError, match=match):
        engine.add_request(prompt, max_tokens)
    assert not engine.has_unfinished()


def test_duplicate_request_ids_are_refused(engine):
    engine.add_request([1], 1, request_id="x")
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request([2], 1, request_id="x")
    drain(engine)


def test_generate_queues_nothing_when_any_prompt_is_bad():
    llm = LLM(tiny())
    with pytest.raises(ValueError):
        llm.generate([[1, 2], [600]], 3)
    assert not llm.engine.has_unfinished()


def _fake_variants(monkeypatch):
    """A decode variant that crashes and one that is wrong, registered like real ones."""
    real = kernels.get("paged_decode", "v1")
    mod = types.ModuleType("fake_decode_variants")
    mod.crashes = lambda *a, **k: 1 / 0
    mod.wrong = lambda *a, **k: real(*a, **k) * 1.01
    monkeypatch.setitem(sys.modules, "fake_decode_variants", mod)
    monkeypatch.setitem(kernels._REGISTRY["paged_decode"], "crashes", "fake_decode_variants:crashes")
    monkeypatch.setitem(kernels._REGISTRY["paged_decode"], "wrong", "fake_decode_variants:wrong")


def test_a_fallback_chain_uses_the_first_variant_that_passes_its_self_check(monkeypatch, caplog):
    _fake_variants(monkeypatch)
    with caplog.at_level(logging.INFO, logger="engine"):
        engine = LLMEngine(tiny(**{"attention-decode": ["crashes", "wrong", "v2", "v1"],
                                   "attention-decode-long": "v1"}))
    assert engine.kernel_choice["attention-decode"] == "v2"
    assert engine.kernel_choice["attention-decode-long"] == "v1"
    log = caplog.text
    assert "crashes failed its self-check: ZeroDivisionError" in log
    assert "wrong failed its self-check: relative error" in log
    assert "attention-decode: using v2" in log


def test_a_chain_where_nothing_passes_is_a_config_error(monkeypatch):
    _fake_variants(monkeypatch)
    with pytest.raises(ConfigError, match=r"<dict>: attention-decode: no variant passed.*crashes.*wrong"):
        LLMEngine(tiny(**{"attention-decode": ["crashes", "wrong"]}))


def test_a_cache_smaller_than_one_sequence_is_a_config_error():
    with pytest.raises(ConfigError, match="kv-cache-memory: .*fewer than one sequence of max-model-len 256"):
        LLMEngine(tiny(**{"kv-cache-memory": 255 * 1024}))
    LLMEngine(tiny(**{"kv-cache-memory": 256 * 1024}))  # exactly one sequence fits


def test_tokenizer_round_trips_text():
    from engine import tokenizer

    text = "héllo, wörld ✓"
    assert tokenizer.decode(tokenizer.encode(text)) == text
    assert all(0 <= t < 256 for t in tokenizer.encode(text))
    assert tokenizer.decode([104, 300, 105]) == "hi"


def test_a_hugging_face_config_without_output_gate_or_shared_expert_runs(tmp_path):
    hf = {"vocab_size": 300, "hidden_size": 48, "num_hidden_layers": 1, "num_attention_heads": 4,
          "num_key_value_heads": 1, "head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2,
          "moe_intermediate_size": 24, "max_position_embeddings": 512}
    (tmp_path / "config.json").write_text(json.dumps(hf))
    (tmp_path / "serve.yaml").write_text("model: config.json\ndevice: cpu\nkv-cache-memory: 1048576\n")
    llm = LLM(tmp_path / "serve.yaml")
    model = llm.engine.model_runner.model
    assert not model.config.attn_output_gate and model.config.shared_expert_intermediate_size == 0
    out = llm.generate([[1, 2, 3], [4] * 20], 6)
    assert [len(o) for o in out] == [6, 6] and all(0 <= t < 300 for o in out for t in o)
    assert llm.generate([[4] * 20], 6) == out[1:]  # the same prompt alone: the same tokens
