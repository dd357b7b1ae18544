"""A Gated DeltaNet layer's decode step launches at most 15 kernels with the fused ``gdn-fused``
kernels (norms, projections, convolution, gates, recurrence, gated norm, MoE), counted on the CPU as
a GPU would launch them (``kernels.launches``), in float16 so that the casts count as on a GPU; the
other keys on their fast variants, as the optimized config runs them."""
import logging
import sys
import types

import pytest

import kernels
from engine_helpers import tiny
from engine.config import ConfigError, load_config
from engine.layer_kernels import decode_kernels
from engine.llm_engine import LLMEngine
from engine.model_runner import ModelRunner

FAST = {"rms-norm": "triton", "moe-dispatch": "triton", "gdn-decode": "triton_recurrent"}
FUSED = ["mm", "triton:_conv_kernel", "triton:_gating_kernel", "triton:_recurrent_kernel",
         "triton:_norm_gated_kernel", "mm"]  # in projection, convolution, gates, recurrence, gated norm, out projection


def _count(fused: str) -> dict[str, list[str]]:
    runner = ModelRunner(load_config(tiny(model="tiny-hybrid", dtype="float16", **FAST, **{"gdn-fused": fused})))
    assert {k: runner.kernels.choice[k] for k in (*FAST, "gdn-fused")} == {**FAST, "gdn-fused": fused}
    return decode_kernels(runner, 0, batch=3)


@pytest.fixture(scope="module")
def counts():
    return {fused: _count(fused) for fused in ("torch", "triton")}


def test_a_gdn_layer_decode_step_launches_at_most_15_kernels_fused(counts):
    fused, unfused = counts["triton"], counts["torch"]
    print(f"kernels per Gated DeltaNet layer in a decode step: gdn-fused torch {len(unfused['layer'])} "
          f"(token mixer {len(unfused['mixer'])}), triton {len(fused['layer'])} (token mixer {len(fused['mixer'])})")
    assert fused["mixer"] == FUSED
    assert len(fused["layer"]) <= 15, fused["layer"]
    assert fused["layer"][0] == fused["layer"][7] == "triton:_rms_norm_kernel"  # the norms around the mixer
    # the torch ops fused away: the convolution's roll, the gates' casts and the gated norm's
    assert len(unfused["mixer"]) >= len(fused["mixer"]) + 20, unfused["mixer"]
    for op in ("index_select", "index_copy_", "softplus", "sigmoid", "_to_copy", "rsqrt"):
        assert op in unfused["mixer"] and op not in fused["layer"], op


def test_a_decode_step_reads_nothing_back_to_the_host():
    """Neither fused nor unfused: what lets the step be captured in a CUDA graph."""
    from engine.layer_kernels import decode_step
    from kernels.launches import Launches

    for fused in ("torch", "triton"):
        runner = ModelRunner(load_config(tiny(model="tiny-hybrid", **FAST, **{"gdn-fused": fused})))
        step = decode_step(runner, 0, batch=2)["layer"]
        step()
        with Launches() as launches:
            step()
        assert launches.syncs == 0, fused


def _half_wrong(monkeypatch):
    """A ``gdn-fused`` variant whose convolution and norm are right and whose gates are not."""
    mod = types.ModuleType("fake_gdn_fused")
    mod.conv = kernels.get("causal_conv1d", "torch")
    mod.norm = kernels.get("rms_norm_gated", "torch")

    def gating(*a, **k):
        g, beta = kernels.get("gdn_gating", "torch")(*a, **k)
        return g * 1.01, beta

    mod.gating = gating
    monkeypatch.setitem(sys.modules, "fake_gdn_fused", mod)
    for op, fn in (("causal_conv1d", "conv"), ("gdn_gating", "gating"), ("rms_norm_gated", "norm")):
        monkeypatch.setitem(kernels._REGISTRY[op], "half_wrong", f"fake_gdn_fused:{fn}")


def test_a_gdn_fused_variant_is_used_only_when_each_of_its_ops_passes(monkeypatch, caplog):
    _half_wrong(monkeypatch)
    with caplog.at_level(logging.INFO, logger="engine"):
        engine = LLMEngine(tiny(model="tiny-hybrid", **{"gdn-fused": ["half_wrong", "torch"]}))
    assert engine.kernel_choice["gdn-fused"] == "torch"
    assert "half_wrong failed its self-check: gdn_gating: relative error" in caplog.text
    with pytest.raises(ConfigError, match=r"<dict>: gdn-fused: no variant passed.*half_wrong \(gdn_gating"):
        LLMEngine(tiny(model="tiny-hybrid", **{"gdn-fused": "half_wrong"}))
    monkeypatch.delitem(kernels._REGISTRY["rms_norm_gated"], "half_wrong")
    with pytest.raises(ConfigError, match="gdn-fused: unknown causal_conv1d/gdn_gating/rms_norm_gated variant"):
        load_config(tiny(model="tiny-hybrid", **{"gdn-fused": "half_wrong"}))


def test_a_model_without_gdn_layers_checks_no_gdn_key():
    engine = LLMEngine(tiny(**{"gdn-fused": "reference"}))  # tiny: attention layers only
    assert "gdn-fused" not in engine.kernel_choice and engine.model_runner.kernels.gdn_conv is None
