"""Online serving at a Poisson request rate, simulated iteration by iteration.

A serving benchmark at a request rate (vLLM's `benchmark_serving.py`, SGLang's `bench_serving`)
sends `num_requests` requests with exponential gaps (the first at t = 0) and reports medians
over requests (TTFT, TPOT), over streamed chunks (ITL) and output tokens / duration. Those
medians depend on how the engine's scheduler interleaves prompts with decoding sequences,
which a steady-state formula averages away: a decoding request's median gap is a plain decode
iteration while its mean is stretched by the prefills between them; a new request waits for the
iteration (or the multi-step group) in flight. So the engine is replayed, deterministically
(seeded arrivals and lengths), pricing every iteration with the same `StepModel` as the
steady-state estimate:

- **admission**: FCFS, while the running sequences stay under `max_num_seqs` and the KV cache
  holds every admitted request's whole final length (I + O rounded up to KV blocks: no
  preemption, TRT-LLM's GUARANTEED_NO_EVICT);
- **`mixed`** (vLLM's chunked prefill and V1 scheduler, TRT-LLM's in-flight batching, SGLang
  with `--enable-mixed-chunk`): each iteration carries every decoding sequence and, FCFS,
  prompt chunks up to the token budget `max_num_tokens` less the decode tokens;
- **`prefill-first`** (SGLang's default, `enable_mixed_chunk=False`; vLLM V0 without chunked
  prefill): while a prompt waits, an iteration carries prompt chunks only (up to
  `max_num_tokens`) and the decoding sequences wait for it;
- **`multi_step`** s > 1 (vLLM V0's `--num-scheduler-steps`): decode-only iterations run in
  groups of s steps, scheduled (and streamed) once per group, so a new prompt waits for the
  group in flight and every streamed chunk holds up to s tokens.

A request's first token comes with the iteration that finishes its prompt; each later
iteration that advances it streams one chunk. Only the token counts change between
iterations, and plain decode steps up to the next finish, arrival or full cache are priced as
one run (at the run's middle context: attention and KV reads are linear in it), so a run of a
few thousand requests takes well under a second.
"""

from __future__ import annotations

import heapq
import math
import random
import statistics
from collections import deque
from dataclasses import dataclass

from llmopt.models.config import ModelConfig
from llmopt.plan.hardware import Cluster
from llmopt.plan.serve.capacity import KV_BLOCK_TOKENS
from llmopt.plan.serve.scenario import Scenario, ServeInputError
from llmopt.plan.serve.step import StepModel

MAX_ITERATIONS = 5_000_000  # a guard: a benchmark of 10^4 requests needs ~10^5
FAST_FORWARD_STEPS = 1024  # plain decode steps priced as one run when nothing else can happen
# SGLang's admission estimate (python/sglang/global_config.py, 2024-25: init_new_token_ratio
# 0.7, min_new_token_ratio_factor 0.14, new_token_ratio_decay_steps 600; schedule_policy.py
# PrefillAdder; scheduler retract_decode with RETRACT_DECODE_STEPS 20)
SGLANG_INIT_RATIO = 0.7
SGLANG_MIN_RATIO = 0.7 * 0.14
SGLANG_RATIO_DECAY = (SGLANG_INIT_RATIO - SGLANG_MIN_RATIO) / 600
RETRACT_STEPS = 20
VLLM_WATERMARK = 0.01  # vLLM's block manager keeps 1 % of the blocks free when admitting


@dataclass(frozen=True)
class Simulated:
    """What a benchmark of `requests` requests at `rate` req/s would report (one replica)."""

    rate: float
    requests: int
    duration_s: float  # first arrival to last completion
    output_tokens: int
    median_ttft_s: float
    mean_ttft_s: float
    p99_ttft_s: float
    median_itl_s: float  # over streamed chunks of every request
    mean_itl_s: float
    median_tpot_s: float  # over requests: (last token - first token) / (O - 1)
    mean_batch: float  # decoding sequences, averaged over time
    iterations: int
    prefill_time_share: float  # of the busy time, in iterations that carry prompt tokens
    retractions: int = 0  # decoding requests pushed back to the queue for KV room
    peak_kv_tokens: int = 0  # most KV tokens held (reserved, under `reserve`) at once

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.duration_s

    @property
    def request_rate(self) -> float:
        return self.requests / self.duration_s

    def to_dict(self) -> dict[str, float]:
        out = {k: getattr(self, k) for k in self.__dataclass_fields__}
        out["output_tokens_per_s"] = self.output_tokens_per_s
        return out


def _lengths(rng: random.Random, n: int, lo: int | None, hi: int) -> list[int]:
    return [hi] * n if lo is None else [rng.randint(lo, hi) for _ in range(n)]


def _weighted_median(pairs: list[tuple[float, int]]) -> float:
    pairs.sort()
    half, acc = sum(w for _, w in pairs) / 2, 0
    for value, w in pairs:
        acc += w
        if acc >= half:
            return value
    return pairs[-1][0]


def _p99(values: list[float]) -> float:
    ranked = sorted(values)
    return ranked[min(len(ranked) - 1, math.ceil(0.99 * len(ranked)) - 1)]


def simulate(
    model: ModelConfig,
    cluster: Cluster,
    sc: Scenario,
    kv_tokens: int,
    rate: float,
    num_requests: int | None = None,
) -> Simulated:
    """Replay `num_requests` (default `sc.num_requests`) Poisson arrivals at `rate` req/s on one
    replica whose KV cache holds `kv_tokens` tokens (see the module docstring)."""
    if not (isinstance(rate, (int, float)) and math.isfinite(rate) and rate > 0):
        raise ServeInputError(f"rate={rate!r} must be a positive finite number of req/s")
    n = sc.num_requests if num_requests is None else num_requests
    rng = random.Random(sc.seed)
    inp = _lengths(rng, n, sc.input_len_min, sc.input_len)
    out = _lengths(rng, n, sc.output_len_min, sc.output_len)
    arrive, t = [], 0.0
    for _ in range(n):
        arrive.append(t)
        t += rng.expovariate(rate)
    reserve = [math.ceil((a + b) / KV_BLOCK_TOKENS) * KV_BLOCK_TOKENS for a, b in zip(inp, out)]
    if max(reserve) > kv_tokens:
        raise ServeInputError(
            f"a request of {max(reserve):,} tokens does not fit the {kv_tokens:,}-token KV cache"
        )
    step = StepModel(model, cluster, sc)
    # the engine sees a request after its front end (tokenise, IPC) has handled it
    ready = [a + step.engine.request_s for a in arrive]
    budget, mixed, group = sc.max_num_tokens, sc.scheduler == "mixed", sc.multi_step
    policy = sc.admission
    ratio = SGLANG_INIT_RATIO

    waiting: deque[int] = deque()
    prompts: deque[list[int]] = deque()  # [request, tokens prefilled, tokens to prefill]
    finish_heap: list[tuple[int, int, int]] = []  # (decode step it ends at, version, request)
    version = [0] * n
    decoding: set[int] = set()
    gen = [0] * n  # tokens generated before the current decode stint
    join = [0] * n  # decode step the current stint began at
    ref = [0.0] * n  # when the request last streamed (for its next gap)
    first = [-1.0] * n
    ttft = [0.0] * n
    tpot: list[float] = []
    gaps: list[tuple[float, int]] = []  # (streamed gap, how many requests saw it)
    fresh: list[int] = []  # decoding requests not streamed at `last_emit`
    last_emit = 0.0
    n_dec, ctx_sum, steps_done, rem_sum, out_sum = 0, 0.0, 0, 0, 0
    kv_used, nxt, done, iterations, retractions = 0, 0, 0, 0, 0
    busy = prefill_busy = batch_time = 0.0
    t, peak = 0.0, 0

    def finish(i: int, now: float) -> None:
        nonlocal kv_used, done
        kv_used -= reserve[i] if policy == "reserve" else inp[i] + out[i]
        done += 1
        if out[i] > 1:
            tpot.append((now - first[i]) / (out[i] - 1))

    def emit(now: float, advance: int, chunks: int = 1, each: float = 0.0) -> None:
        """`advance` decode steps end at `now`; every decoding request streams `chunks` chunks,
        the last at `now` and the others `each` seconds apart (a run of plain steps)."""
        nonlocal n_dec, ctx_sum, steps_done, last_emit, rem_sum, out_sum, kv_used
        old = n_dec - len(fresh)
        first_chunk = now - (chunks - 1) * each
        if old:
            gaps.append((first_chunk - last_emit, old))
        gaps.extend((first_chunk - ref[i], 1) for i in fresh)
        if chunks > 1:
            gaps.append((each, n_dec * (chunks - 1)))
        fresh.clear()
        last_emit = now
        steps_done += advance
        ctx_sum += n_dec * advance
        rem_sum -= n_dec * advance
        if policy != "reserve":
            kv_used += n_dec * advance
        while finish_heap and finish_heap[0][0] <= steps_done:
            end, ver, i = heapq.heappop(finish_heap)
            if ver != version[i]:
                continue  # retracted since
            over = steps_done - end  # a multi-step group may run past the last token
            decoding.discard(i)
            n_dec -= 1
            ctx_sum -= inp[i] + out[i] + over
            rem_sum += over
            out_sum -= out[i]
            if policy != "reserve":
                kv_used -= over
            finish(i, now)

    def start_decoding(i: int) -> None:
        """`i` decodes from the next step; its next gap counts from `ref[i]`, its last chunk."""
        nonlocal n_dec, ctx_sum, rem_sum, out_sum
        decoding.add(i)
        n_dec += 1
        ctx_sum += inp[i] + gen[i]
        rem_sum += out[i] - gen[i]
        out_sum += out[i]
        join[i] = steps_done
        heapq.heappush(finish_heap, (steps_done + out[i] - gen[i], version[i], i))
        fresh.append(i)

    def retract() -> None:
        """Free the KV of one decoding request and queue it again (vLLM preempts the newest,
        SGLang the one with the fewest output tokens); it re-prefills prompt and output."""
        nonlocal n_dec, ctx_sum, rem_sum, out_sum, kv_used, retractions
        if policy == "on-demand":
            i = max(decoding, key=lambda r: arrive[r])
        else:
            i = min(decoding, key=lambda r: (gen[r] + steps_done - join[r], -inp[r]))
        g = gen[i] + steps_done - join[i]
        decoding.discard(i)
        version[i] += 1
        n_dec -= 1
        ctx_sum -= inp[i] + g
        rem_sum -= out[i] - g
        out_sum -= out[i]
        kv_used -= inp[i] + g
        gen[i] = g
        if i in fresh:
            fresh.remove(i)
        else:
            ref[i] = last_emit
        waiting.appendleft(i)
        retractions += 1

    def admissible(i: int) -> bool:
        if n_dec + len(prompts) >= sc.max_num_seqs:
            return False
        if policy == "reserve":  # the whole final length, no preemption ever
            return kv_used + reserve[i] <= kv_tokens
        need = inp[i] + gen[i]
        if policy == "on-demand":  # the prompt's blocks now, more as it decodes
            return kv_used + need <= kv_tokens * (1 - VLLM_WATERMARK)
        # SGLang: running requests' remaining output x new_token_ratio, new ones in full
        pending = sum(out[j] - gen[j] for j, _, _ in prompts)
        return kv_used + ratio * rem_sum + pending + need + out[i] - gen[i] <= kv_tokens

    while done < n:
        iterations += 1
        if iterations > MAX_ITERATIONS:
            raise ServeInputError(f"the simulation of {n} requests did not finish")
        while nxt < n and ready[nxt] <= t:
            waiting.append(nxt)
            nxt += 1
        while waiting and admissible(waiting[0]):
            i = waiting.popleft()
            kv_used += reserve[i] if policy == "reserve" else inp[i] + gen[i]
            prompts.append([i, 0, inp[i] + gen[i]])
        if not prompts and not n_dec:
            ratio = SGLANG_INIT_RATIO
            t = max(t, ready[nxt])  # idle until the next request
            continue
        if prompts:  # an iteration with prompt chunks (and, mixed, every decoding sequence)
            decoders = n_dec if mixed else 0
            while policy != "reserve" and decoders and kv_used + decoders > kv_tokens:
                retract()
                decoders = n_dec
            room = max(0, budget - decoders)
            tokens, span_sum, completed = 0, 0.0, []
            for entry in prompts:
                if tokens >= room:
                    break
                i, d, target = entry
                chunk = min(target - d, room - tokens)
                span_sum += chunk * (d + chunk / 2)
                tokens += chunk
                entry[1] = d + chunk
                if entry[1] == target:
                    completed.append(i)
            for _ in completed:
                prompts.popleft()
            peak = max(peak, kv_used + (decoders if policy != "reserve" else 0))
            ctx = ctx_sum / decoders if decoders else 0.0
            dt = step.cost(decoders, ctx, tokens, span_sum / max(tokens, 1), len(completed))
            dt = dt.total_s
            t += dt
            busy += dt
            prefill_busy += dt if tokens else 0.0
            batch_time += decoders * dt
            if decoders:
                emit(t, 1)
            for i in completed:
                if first[i] < 0:  # a re-prefill after a retraction streams nothing new
                    first[i] = ref[i] = t
                    ttft[i] = t - arrive[i]
                    gen[i] = 1
                    if policy != "reserve":
                        kv_used += 1
                    if out[i] == 1:
                        finish(i, t)
                        continue
                start_decoding(i)
            continue
        # decode only: a group of `multi_step` steps, streamed at its end
        s = group
        while policy != "reserve" and n_dec > 1 and kv_used + n_dec * s > kv_tokens:
            retract()
            if policy == "estimate":  # SGLang re-estimates the ratio from what was generated
                ratio = min(1.0, (out_sum - rem_sum + RETRACT_STEPS * n_dec) / (out_sum + 1))
        runs = 1
        if s == 1:  # plain steps until the batch can change: a finish, an arrival, a full cache
            runs = finish_heap[0][0] - steps_done
            each = step.cost(n_dec, ctx_sum / n_dec).total_s
            if nxt < n:
                runs = min(runs, int((ready[nxt] - t) / each))
            if policy != "reserve":
                runs = min(runs, (kv_tokens - kv_used) // n_dec)
            runs = max(1, min(runs, FAST_FORWARD_STEPS))
        # attention and KV reads grow linearly with the context: price the run at its middle
        each = step.cost(n_dec, ctx_sum / n_dec + (s * runs - 1) / 2).total_s * s
        dt = each * runs
        peak = max(peak, kv_used + (n_dec * s * runs if policy != "reserve" else 0))
        t += dt
        busy += dt
        batch_time += n_dec * dt
        emit(t, s * runs, runs, each)
        ratio = max(SGLANG_MIN_RATIO, ratio - SGLANG_RATIO_DECAY * s * runs)

    duration, ttfts = t, ttft
    return Simulated(
        rate=float(rate),
        requests=n,
        duration_s=duration,
        output_tokens=sum(out),
        median_ttft_s=statistics.median(ttfts),
        mean_ttft_s=statistics.fmean(ttfts),
        p99_ttft_s=_p99(ttfts),
        median_itl_s=_weighted_median(gaps) if gaps else 0.0,
        mean_itl_s=(sum(v * w for v, w in gaps) / sum(w for _, w in gaps)) if gaps else 0.0,
        median_tpot_s=statistics.median(tpot) if tpot else 0.0,
        mean_batch=batch_time / duration if duration else 0.0,
        iterations=iterations,
        prefill_time_share=prefill_busy / busy if busy else 0.0,
        retractions=retractions,
        peak_kv_tokens=peak,
    )
