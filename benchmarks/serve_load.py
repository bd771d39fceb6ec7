#!/usr/bin/env python
"""Load benchmark of `speccompile serve`: replay the workloads through the real `openai` client, on loopback.

Starts `speccompile serve ARTIFACT --port 0` as a child process (extra server flags after `--`), then runs:
  1. `streams-1`: the workload prompts one stream at a time (greedy; --one-stream-passes times over, for a
     steadier baseline); their answers are the reference;
  2. `streams-N` (--streams, default 8): the same prompts (--passes times over) from N concurrent streams
     (all starting together, or with --stagger spread over one one-stream request time);
  3. `churn`: --requests (200) requests from --clients (16) concurrent clients over the same prompts, a
     --disconnect share of them closed after a random number of chunks;
  4. with --request-rate R: `rate-R`, --rate-requests requests sent at random (Poisson) times, R per second
     on average, whatever the server's pace (open loop, as vLLM's benchmark_serving); also prints the most
     requests in flight at once.
Every prompt's greedy answer must equal its `streams-1` answer. Printed per phase: requests, completion
tokens, wall time, aggregate tok/s (completion tokens of the phase / its wall time), TTFT p50/p95 (request
sent -> first text chunk, at the client), mismatches; and TTFT p50 split into the first wave (each client's
first request: they arrive together, so they queue for each other's prefill) and the steady state (the later
requests, which arrive as earlier ones finish). Churn also prints lost / duplicated counts (a request
that ends neither finished nor deliberately disconnected is lost; more than one finish chunk in a stream, or
server-side generation outcomes beyond the requests sent, is duplicated). The server's RSS is sampled after
the warm-up and after each phase, and the CPU time each phase took in the server and in this client (on a
small machine the load generator competes with the server for cores). The goals' ratios are printed as
measured in the same run: streams-N tok/s over streams-1 tok/s, streams-N TTFT p50 over streams-1's.
Results are printed, never asserted. Example:

  python benchmarks/serve_load.py /tmp/smol --workload benchmarks/workloads/copy.jsonl \
      --workload benchmarks/workloads/chat.jsonl --limit 4 --max-tokens 32 --requests 200 -- --threads 2
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import openai
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from server_process import ServerProcess  # noqa: E402


@dataclass
class Outcome:
    prompt: str
    text: str = ""
    ttft: float | None = None
    tokens: int = 0
    finishes: int = 0  # finish chunks seen (1 when the stream completed)
    disconnected: bool = False
    error: str | None = None
    first_wave: bool = False  # the client's first request (all clients start at once)


@dataclass
class Phase:
    name: str
    wall: float
    outcomes: list[Outcome] = field(default_factory=list)
    mismatches: int = 0
    most_in_flight: int | None = None  # open-loop phases: the most requests in flight at once
    client_cpu: float = 0.0  # CPU seconds of this process (the load generator) during the phase
    server_cpu: float = 0.0  # CPU seconds of the server during the phase

    def report(self) -> dict:
        finished = [o for o in self.outcomes if o.finishes]
        ttfts = sorted(o.ttft for o in self.outcomes if o.ttft is not None)
        tokens = sum(o.tokens for o in finished)
        return {
            "phase": self.name, "requests": len(self.outcomes), "finished": len(finished),
            "disconnected": sum(o.disconnected for o in self.outcomes),
            "errors": sum(o.error is not None for o in self.outcomes),
            "completion_tokens": tokens, "wall_s": round(self.wall, 2), "tok_per_s": round(tokens / self.wall, 2),
            "ttft_p50_s": round(_percentile(ttfts, 50), 3) if ttfts else None,
            "ttft_p95_s": round(_percentile(ttfts, 95), 3) if ttfts else None,
            "ttft_p50_first_wave_s": _p50([o.ttft for o in self.outcomes if o.first_wave and o.ttft is not None]),
            "ttft_p50_steady_s": _p50([o.ttft for o in self.outcomes if not o.first_wave and o.ttft is not None]),
            "mismatches": self.mismatches,
            "client_cpu_s": round(self.client_cpu, 2), "server_cpu_s": round(self.server_cpu, 2),
            **({"most_in_flight": self.most_in_flight} if self.most_in_flight is not None else {}),
        }


def _p50(values: list[float]) -> float | None:
    return round(statistics.median(values), 3) if values else None


def _percentile(values: list[float], q: float) -> float:
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1]


async def _one(client: openai.AsyncOpenAI, model: str, prompt: dict, max_tokens: int, cut_after: int | None) -> Outcome:
    """One streamed request; `cut_after` chunks then close the connection (a client disconnect)."""
    outcome = Outcome(prompt["id"])
    sent = time.perf_counter()
    try:
        if prompt.get("chat", True):
            stream = await client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": prompt["prompt"]}], max_tokens=max_tokens,
                temperature=0, stream=True, stream_options={"include_usage": True})
        else:
            stream = await client.completions.create(model=model, prompt=prompt["prompt"], max_tokens=max_tokens,
                                                     temperature=0, stream=True, stream_options={"include_usage": True})
        chunks = 0
        async for chunk in stream:
            chunks += 1
            if chunk.usage is not None:
                outcome.tokens = chunk.usage.completion_tokens
            if not chunk.choices:
                continue
            choice = chunk.choices[0]
            piece = choice.delta.content if hasattr(choice, "delta") else choice.text
            if piece:
                if outcome.ttft is None:
                    outcome.ttft = time.perf_counter() - sent
                outcome.text += piece
            if choice.finish_reason:
                outcome.finishes += 1
            if cut_after is not None and chunks >= cut_after:
                outcome.disconnected = True
                await stream.close()
                break
    except openai.APIError as exc:
        outcome.error = f"{type(exc).__name__}: {exc}"
    return outcome


async def _run_open_loop(name: str, url: str, model: str, prompts: list[dict], rate: float, count: int, max_tokens: int,
                         rng: random.Random) -> Phase:
    """`count` requests at exponential inter-arrival times of mean 1 / `rate` seconds."""
    in_flight, most = 0, 0

    async def one(client: openai.AsyncOpenAI, prompt: dict, delay: float) -> Outcome:
        nonlocal in_flight, most
        await asyncio.sleep(delay)
        in_flight += 1
        most = max(most, in_flight)
        try:
            return await _one(client, model, prompt, max_tokens, None)
        finally:
            in_flight -= 1

    delays, t = [], 0.0
    for _ in range(count):
        t += rng.expovariate(rate)
        delays.append(t)
    started = time.perf_counter()
    async with openai.AsyncOpenAI(base_url=url, api_key="unused", max_retries=0, timeout=3600) as client:
        outcomes = await asyncio.gather(*(one(client, rng.choice(prompts), d) for d in delays))
    phase = Phase(name, time.perf_counter() - started, list(outcomes))
    phase.most_in_flight = most
    return phase


async def _run_phase(name: str, url: str, model: str, jobs: list[tuple[dict, int | None]], concurrency: int,
                     max_tokens: int, stagger: float = 0.0) -> Phase:
    """`concurrency` clients take the jobs in turn; client i starts after i x `stagger` seconds."""
    queue: asyncio.Queue = asyncio.Queue()
    for job in jobs:
        queue.put_nowait(job)
    outcomes: list[Outcome] = []

    async def worker(index: int) -> None:
        await asyncio.sleep(index * stagger)
        async with openai.AsyncOpenAI(base_url=url, api_key="unused", max_retries=0, timeout=3600) as client:
            first = True
            while not queue.empty():
                prompt, cut_after = queue.get_nowait()
                outcome = await _one(client, model, prompt, max_tokens, cut_after)
                outcome.first_wave, first = first, False
                outcomes.append(outcome)

    started = time.perf_counter()
    await asyncio.gather(*(worker(i) for i in range(concurrency)))
    return Phase(name, time.perf_counter() - started, outcomes)


def _measured(server: ServerProcess, phase) -> Phase:
    """Run one phase coroutine, noting the CPU time it took in the server and in this process."""
    client, served = time.process_time(), server.cpu_seconds()
    result = asyncio.run(phase)
    result.client_cpu, result.server_cpu = time.process_time() - client, server.cpu_seconds() - served
    return result


def _ratio(numerator: float | None, denominator: float | None) -> float | None:
    return round(numerator / denominator, 2) if numerator and denominator else None


def _cell(value) -> str:
    return "-" if value is None else str(value)


def _busy(server: ServerProcess) -> bool:
    health = httpx.get(server.base + "/health").json()
    return bool(health["running"] or health["queue_depth"])


def _server_outcomes(server: ServerProcess) -> dict[str, float]:
    counts = {}
    for family in text_string_to_metric_families(httpx.get(server.base + "/metrics").text):
        for sample in family.samples:
            if sample.name == "speccompile_generations_total":
                counts[sample.labels["outcome"]] = sample.value
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("artifact")
    parser.add_argument("--workload", action="append", default=None)
    parser.add_argument("--limit", type=int, default=None, help="First N prompts of each workload.")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--passes", type=int, default=1, help="Times the prompts are sent in the streams-N phase.")
    parser.add_argument("--one-stream-passes", type=int, default=1,
                        help="Times the prompts are sent in the streams-1 phase (every answer must equal the first).")
    parser.add_argument("--stagger", action="store_true",
                        help="Start the streams-N clients spread over one one-stream request time instead of together: "
                             "requests then arrive while others decode (steady state) rather than in waves.")
    parser.add_argument("--warm-all", action="store_true",
                        help="Warm up with every prompt (not just the first): with the server's prefix cache, every "
                             "measured request is then a whole-prompt hit, one stream and N alike.")
    parser.add_argument("--restart", action="store_true",
                        help="Run the streams-N phase and what follows on a freshly started server, warmed up like the "
                             "first: its prefix cache then holds only the warm-up prompt, so the N streams' prompts are "
                             "as new to it as they were to the one stream (not whole-prompt hits).")
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--disconnect", type=float, default=0.25, help="Share of churn requests closed early.")
    parser.add_argument("--rounds", type=int, default=1, help="Churn rounds (RSS is sampled after each).")
    parser.add_argument("--request-rate", type=float, default=None, help="Add an open-loop phase: requests per second (Poisson).")
    parser.add_argument("--rate-requests", type=int, default=64, help="Requests of the --request-rate phase.")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true")
    argv = sys.argv[1:]
    split = argv.index("--") if "--" in argv else len(argv)
    args = parser.parse_args(argv[:split])
    server_args = argv[split + 1:]  # after --: extra `speccompile serve` flags
    workloads = args.workload or ["benchmarks/workloads/copy.jsonl", "benchmarks/workloads/chat.jsonl"]
    prompts = []
    for path in workloads:
        lines = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
        prompts += lines[: args.limit]
    rng = random.Random(args.seed)
    queue = max(args.clients, args.rate_requests if args.request_rate else 0)  # open loop: every request may wait
    limit = ["--max-concurrency", str(max(args.streams, args.clients)), "--max-queue", str(queue)]

    warm = prompts if args.warm_all else prompts[:1]

    def start_server() -> tuple[ServerProcess, str]:
        server = ServerProcess(args.artifact, *limit, *server_args)
        model = httpx.get(server.url + "/models").json()["data"][0]["id"]
        asyncio.run(_run_phase("warmup", server.url, model, [(p, None) for p in warm], 1, 8))
        return server, model

    server, model = start_server()
    try:
        rss = {"after_warmup": server.rss_bytes()}
        phases = [_measured(server, _run_phase("streams-1", server.url, model, [(p, None) for p in prompts * args.one_stream_passes],
                                               1, args.max_tokens))]
        reference = {}
        for outcome in phases[0].outcomes:  # the first answer of each prompt
            reference.setdefault(outcome.prompt, outcome.text)
        rss["after_streams-1"] = server.rss_bytes()
        if args.restart:
            server.stop()
            server, model = start_server()
            rss["after_restart_warmup"] = server.rss_bytes()
    except BaseException:
        server.stop()
        raise
    with server:
        # --stagger: the N clients start one N-th of a one-stream request apart (a steady state, not a burst)
        stagger = phases[0].wall / len(phases[0].outcomes) / args.streams if args.stagger else 0.0
        phases.append(_measured(server, _run_phase(f"streams-{args.streams}", server.url, model, [(p, None) for p in prompts * args.passes],
                                                   args.streams, args.max_tokens, stagger)))
        rss[f"after_streams-{args.streams}"] = server.rss_bytes()
        before = _server_outcomes(server)
        churns = []
        for round_ in range(1, args.rounds + 1):
            jobs = [(rng.choice(prompts), rng.randint(1, 6) if rng.random() < args.disconnect else None)
                    for _ in range(args.requests)]
            name = "churn" if args.rounds == 1 else f"churn-{round_}"
            churns.append(_measured(server, _run_phase(name, server.url, model, jobs, args.clients, args.max_tokens)))
            deadline = time.monotonic() + 60
            while _busy(server) and time.monotonic() < deadline:
                time.sleep(0.2)
            rss[f"after_{name}"] = server.rss_bytes()
        after = _server_outcomes(server)
        phases += churns
        if args.request_rate:
            name = f"rate-{args.request_rate:g}"
            phases.append(_measured(server, _run_open_loop(name, server.url, model, prompts, args.request_rate, args.rate_requests,
                                                           args.max_tokens, rng)))
            rss[f"after_{name}"] = server.rss_bytes()

    for phase in phases:
        phase.mismatches = sum(o.finishes > 0 and o.text != reference[o.prompt] for o in phase.outcomes)
    sent = [o for phase in churns for o in phase.outcomes]
    server_outcomes = sum(after.values()) - sum(before.values())
    reports = [p.report() for p in phases]
    summary = {
        "phases": reports,
        "churn": {
            "sent": len(sent),
            "lost": sum(not o.finishes and not o.disconnected for o in sent),
            "duplicated": sum(o.finishes > 1 for o in sent) + max(0, int(server_outcomes) - len(sent)),
            "server_outcomes": {k: after.get(k, 0) - before.get(k, 0) for k in after},
        },
        "ratios": {
            f"streams-{args.streams}_over_streams-1_tok_per_s": _ratio(reports[1]["tok_per_s"], reports[0]["tok_per_s"]),
            f"streams-{args.streams}_over_streams-1_ttft_p50": _ratio(reports[1]["ttft_p50_s"], reports[0]["ttft_p50_s"]),
        },
        "stagger_s": round(stagger, 4),
        "rss_mb": {k: round(v / 2**20, 1) for k, v in rss.items()},
        "server_exit": server.process.returncode,
    }
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        print_summary(summary)


def print_summary(summary: dict) -> None:
    """The summary as a table and lines (a phase without requests prints "-" for what it could not measure)."""
    print(f"{'phase':<12}{'requests':>9}{'finished':>9}{'cut':>5}{'errors':>7}{'tokens':>8}{'wall s':>8}{'tok/s':>8}"
          f"{'TTFT p50':>10}{'TTFT p95':>10}{'mismatch':>9}{'CPU server':>11}{'CPU client':>11}")
    for r in summary["phases"]:
        print(f"{r['phase']:<12}{r['requests']:>9}{r['finished']:>9}{r['disconnected']:>5}{r['errors']:>7}"
              f"{r['completion_tokens']:>8}{r['wall_s']:>8}{r['tok_per_s']:>8}{_cell(r['ttft_p50_s']):>10}"
              f"{_cell(r['ttft_p95_s']):>10}{r['mismatches']:>9}{r['server_cpu_s']:>11}{r['client_cpu_s']:>11}")
    print("same run, streams-N / streams-1: " + ", ".join(f"{k} {_cell(v)}{'' if v is None else 'x'}" for k, v in summary["ratios"].items()))
    if summary["stagger_s"]:
        print(f"streams-N clients started {summary['stagger_s']} s apart (--stagger)")
    print("TTFT p50 first wave / steady state (s): " + ", ".join(
        f"{r['phase']} {_cell(r['ttft_p50_first_wave_s'])} / {_cell(r['ttft_p50_steady_s'])}" for r in summary["phases"]))
    for r in summary["phases"]:
        if "most_in_flight" in r:
            print(f"{r['phase']}: at most {r['most_in_flight']} requests in flight")
    c = summary["churn"]
    print(f"churn: sent {c['sent']}, lost {c['lost']}, duplicated {c['duplicated']}, server outcomes {c['server_outcomes']}")
    print("server RSS (MB): " + ", ".join(f"{k} {v}" for k, v in summary["rss_mb"].items())
          + f"; exit status {summary['server_exit']}")


if __name__ == "__main__":
    main()
