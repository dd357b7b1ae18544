"""What a serving pass measured: `vllm bench serve`'s fields over a batch or a steady-state window, the server's
own counts where it gave them, the deployment's weighted score and the server's CPU figures."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from orchestrator.probes.client import ProbeError, Outcome

DEFAULT_WEIGHTS = (16.796, 2.799, 0.56)  # output, uncached input, cached input tokens/s


def _stats(name: str, values_s: list[float]) -> dict:
    ms = np.asarray(values_s, dtype=float) * 1000 if values_s else np.zeros(1)
    return {f"mean_{name}_ms": float(ms.mean()), f"median_{name}_ms": float(np.median(ms)),
            f"std_{name}_ms": float(ms.std()), f"p99_{name}_ms": float(np.percentile(ms, 99))}


def summarize(outcomes: list[Outcome], duration: float) -> dict:
    """`vllm bench serve`'s metrics over the completed requests."""
    ok = [o for o in outcomes if o.success]
    total_in = sum(o.prompt_len for o in ok)
    total_out = sum(o.output_tokens for o in ok)
    tpots = [(o.latency - o.ttft) / (o.output_tokens - 1) for o in ok if o.output_tokens > 1]
    errors = sorted({o.error for o in outcomes if not o.success})
    result = {
        "duration": duration, "completed": len(ok), "failed": len(outcomes) - len(ok),
        "total_input_tokens": total_in, "total_output_tokens": total_out,
        "request_throughput": len(ok) / duration, "output_throughput": total_out / duration,
        "total_token_throughput": (total_in + total_out) / duration,
    }
    result.update(_stats("ttft", [o.ttft for o in ok]))
    result.update(_stats("tpot", tpots))
    result.update(_stats("itl", [x for o in ok for x in o.itl]))
    result.update(_stats("e2el", [o.latency for o in ok]))
    result["errors"] = errors[:10]
    return result


def summarize_window(outcomes: list[Outcome], start: float, end: float) -> tuple[dict, float, str]:
    """`vllm bench serve`'s metrics over a steady-state window: the tokens streamed inside it (a chunk counts
    as the request's tokens per chunk), the prompts whose first token came inside it, and the latencies of the
    requests that finished inside it."""
    def inside(t: float | None) -> bool:
        return t is not None and start <= t < end

    duration = end - start
    done = [o for o in outcomes if o.success and o.token_times and inside(o.token_times[-1])]
    failed = [o for o in outcomes if not o.success and o.error and o.error != "cancelled" and
              (not o.token_times or inside(o.token_times[-1]))]
    total_out = 0.0
    for o in outcomes:
        per_chunk = (o.output_tokens / len(o.token_times)) if o.success and o.output_tokens and o.token_times else 1.0
        total_out += per_chunk * sum(1 for t in o.token_times if inside(t))
    prefilled = [o for o in outcomes if inside(o.first_at)]
    total_in = sum(o.prompt_len for o in prefilled)
    streamed_in, streamed_cached = streamed_prompts(outcomes, inside)
    tpots = [(o.latency - o.ttft) / (o.output_tokens - 1) for o in done if o.output_tokens > 1]
    result = {
        "duration": duration, "completed": len(done), "failed": len(failed),
        "total_input_tokens": total_in, "total_output_tokens": round(total_out),
        "request_throughput": len(done) / duration, "output_throughput": total_out / duration,
        "total_token_throughput": (total_in + total_out) / duration, "steady_state": True,
        "requests_sent": len(outcomes), "streamed_input_tokens": streamed_in, "streamed_cached_tokens": streamed_cached,
    }
    result.update(_stats("ttft", [o.ttft for o in done]))
    result.update(_stats("tpot", tpots))
    result.update(_stats("itl", [x for o in done for x in o.itl]))
    result.update(_stats("e2el", [o.latency for o in done]))
    result["errors"] = sorted({o.error for o in failed})[:10]
    cached = [o.cached_tokens for o in prefilled if o.cached_tokens is not None]
    return result, (sum(cached) if cached else 0), ("usage" if cached else "none")


def streamed_prompts(outcomes: list[Outcome], inside) -> tuple[float, float]:
    """(prompt tokens, cached ones) counted over each request's streamed tokens: a request whose window holds a
    third of its output tokens counts a third of its prompt. In a steady state this has the mean of counting each
    prompt whole at its first token (every request brings its prompt and its output, whichever window sees which),
    without moving by a whole prompt as one more first token falls inside the window or outside it."""
    prompt = cached = 0.0
    for o in outcomes:
        total = o.output_tokens if o.success and o.output_tokens else max(o.max_tokens, len(o.token_times))
        if not o.token_times or total <= 0:
            continue
        per_chunk = o.output_tokens / len(o.token_times) if o.success and o.output_tokens else 1.0
        share = min(1.0, per_chunk * sum(1 for t in o.token_times if inside(t)) / total)
        prompt += share * o.prompt_len
        cached += share * (o.cached_tokens or 0)
    return prompt, cached


def window_result(outcomes: list[Outcome], start: float, end: float, counters: dict[str, float],
                  gpus: list | None, host: dict[str, float] | None = None) -> tuple[dict, float, str]:
    """A steady-state window's fields: the client's counts, replaced by the server's own where it gave them
    (`counters`: prompt tokens as their chunks ran, not at their first output; its steps), the GPUs' clocks and
    the machine's CPU load (`host`)."""
    result, cached, source = summarize_window(outcomes, start, end)
    if gpus is not None:  # clocks, temperature, power: a drift within a run is told from the machine's
        result["gpus"] = gpus
    result.update(host or {})
    result["tokens_source"] = "client"
    duration = result["duration"]
    if "prefill" in counters and "generation" in counters:
        if counters.get("step_ended", 0) > 0 and counters.get("steps", 0) > 0:
            # whole steps over the time they took, from one step's end to another's (client.at_step_end)
            duration = result["rate_seconds"] = counters["step_ended"]
        result.update(client_input_tokens=result["total_input_tokens"],
                      client_output_tokens=result["total_output_tokens"],
                      # the server counts the prompt tokens it computed: cached ones are added back for the score
                      total_input_tokens=round(counters["prefill"] + cached),
                      total_output_tokens=round(counters["generation"]),
                      output_throughput=counters["generation"] / duration,
                      total_token_throughput=(counters["prefill"] + cached + counters["generation"]) / duration,
                      tokens_source="server")
        if counters.get("steps"):
            result.update(server_steps=round(counters["steps"]),
                          server_step_ms=1e3 * counters["step_seconds"] / counters["steps"],
                          server_step_busy=counters["step_seconds"] / duration)
    result.update(server_figures(counters, duration))
    return result, cached, source


def server_figures(counters: dict[str, float], duration: float) -> dict[str, float]:
    """vLLM's own view of a window (``client.SERVER_VLLM``): its mean inter-token latency, its iterations (how
    many, their mean length over the window, tokens per iteration), preemptions and mean queueing of the requests
    admitted in it. Beside the client's TPOT, a slow window is told as the server's or the client's."""
    out: dict[str, float] = {}
    if counters.get("itl_count"):
        out["server_itl_ms"] = 1e3 * counters["itl_sum"] / counters["itl_count"]
    if counters.get("iterations"):
        out.update(server_iterations=round(counters["iterations"]),
                   server_iteration_ms=1e3 * duration / counters["iterations"],
                   server_tokens_per_iteration=counters.get("iteration_tokens", 0.0) / counters["iterations"])
    if "preemptions" in counters:
        out["server_preemptions"] = round(counters["preemptions"])
    if counters.get("queue_count"):
        out["server_queue_ms"] = 1e3 * counters["queue_sum"] / counters["queue_count"]
    return out


def with_score(result: dict, cached_tokens: float, weights: tuple[float, float, float]) -> dict:
    """Adds uncached and cached prompt throughput and the weighted score (over ``rate_seconds`` where the server's
    step ends gave the window's span, else its duration); for a steady-state window also ``score_streamed``, the
    same score with the prompts counted over their streamed tokens (``streamed_prompts``)."""
    duration = result.get("rate_seconds") or result["duration"]
    result["total_cached_tokens"] = cached_tokens
    result["input_throughput"] = (result["total_input_tokens"] - cached_tokens) / duration
    result["cached_throughput"] = cached_tokens / duration
    w_out, w_in, w_cached = weights
    result["score_weights"] = {"output": w_out, "input": w_in, "cached": w_cached}
    result["score"] = (w_out * result["output_throughput"] + w_in * result["input_throughput"]
                       + w_cached * result["cached_throughput"])
    if "streamed_input_tokens" in result:  # a steady-state window: the score with prompts counted as they stream
        cached_rate = result["streamed_cached_tokens"] / duration
        result["streamed_input_throughput"] = result["streamed_input_tokens"] / duration - cached_rate
        result["score_streamed"] = (w_out * result["output_throughput"] + w_in * result["streamed_input_throughput"]
                                    + w_cached * cached_rate)
    return result


def with_cpu(result: dict, cpu_seconds: float | None) -> dict:
    """Adds the server's CPU seconds over the measured window and throughput per CPU second:
    ``cpu_score`` is the score's weighted tokens over CPU seconds instead of wall seconds."""
    if cpu_seconds is None or cpu_seconds <= 0:
        return result
    per_cpu = result["duration"] / cpu_seconds
    result["server_cpu_seconds"] = cpu_seconds
    result["cpu_utilization"] = cpu_seconds / result["duration"]
    result["output_tokens_per_cpu_second"] = result["output_throughput"] * per_cpu
    result["cpu_score"] = result["score"] * per_cpu
    return result


REQUIRED_IMPORT_FIELDS = ("duration", "completed", "total_input_tokens", "total_output_tokens",
                          "output_throughput")


def import_result(path: Path, weights: tuple[float, float, float]) -> dict:
    """Scores a `vllm bench serve --save-result` JSON; it records no cached tokens, so all prompt
    tokens count as uncached input."""
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ProbeError(f"{path}: cannot read a JSON result: {exc}") from None
    if not isinstance(data, dict):
        raise ProbeError(f"{path}: expected a JSON object, got {type(data).__name__}")
    for key in REQUIRED_IMPORT_FIELDS:
        if not isinstance(data.get(key), (int, float)) or isinstance(data.get(key), bool):
            raise ProbeError(f"{path}: field {key!r} is missing or not a number")
    if data["duration"] <= 0:
        raise ProbeError(f"{path}: field 'duration' must be positive, got {data['duration']}")
    keep = [k for k in data if isinstance(data[k], (int, float, str)) or data[k] is None]
    result = {k: data[k] for k in keep}
    result["failed"] = int(data.get("failed", 0) or 0)
    result["imported_from"] = str(path)
    return with_score(result, 0, weights)
