"""The agentic workload through the server, in order: suffix decoding vs n-gram lookup vs plain decoding.

One server per drafter (`speccompile serve --drafter D`); the workload's requests are sent one after another in
file order (agent sessions as a server sees them), each greedy, first plain (`"speculative_config": {"method":
"none"}`: the same server, no drafting, nothing learnt) then with the server's drafter, so both see the same
machine load (no prefix cache: neither reuses the other's prompt). Reported per drafter, for its requests and
the plain ones: decode tokens/s (tokens after the first over the generation's time after its prefill, as the
server reports them) and end-to-end tokens/s (completion tokens over wall-clock seconds, prefill and HTTP
included), the ratios, decoded tokens per target pass, and how many answers equal plain decoding's.

    python benchmarks/agentic_serve.py exported/smollm2-int4 --threads 2 --max-tokens 96
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import httpx

from server_process import ServerProcess

WORKLOAD = Path(__file__).with_name("workloads") / "agentic.jsonl"


def complete(client: httpx.Client, url: str, item: dict, max_tokens: int, method: str) -> tuple[str, dict, float]:
    """(text, the response's generation statistics, seconds) of one greedy chat request."""
    body = {"model": "m", "messages": [{"role": "user", "content": item["prompt"]}], "max_tokens": max_tokens,
            "temperature": 0, "speculative_config": {"method": method}, "user": item.get("user", "agent")}
    t0 = time.perf_counter()
    response = client.post(url + "/chat/completions", json=body, timeout=600)
    seconds = time.perf_counter() - t0
    response.raise_for_status()
    data = response.json()
    return data["choices"][0]["message"]["content"] or "", data["speculative"], seconds


def run_drafter(artifact: Path, drafter: str, items: list[dict], args) -> dict:
    server = ServerProcess(artifact, "--drafter", drafter, "--threads", str(args.threads), "--served-model-name", "m",
                           "--max-concurrency", "1", "--no-prefix-caching", *args.server_args)
    totals = {key: {"tokens": 0, "wall_s": 0.0, "decode_tokens": 0, "decode_s": 0.0, "passes": 0} for key in ("plain", drafter)}
    identical = 0
    try:
        with httpx.Client() as client:
            complete(client, server.url, {"prompt": "Hello"}, 8, "none")  # warm-up (plain: nothing learnt)
            for item in items:
                texts = {}
                for method in ("none", drafter):
                    text, stats, seconds = complete(client, server.url, item, args.max_tokens, method)
                    total = totals["plain" if method == "none" else drafter]
                    total["tokens"] += stats["generated_tokens"]
                    total["wall_s"] += seconds
                    total["decode_tokens"] += max(stats["generated_tokens"] - 1, 0)  # the first token comes with the prefill
                    total["decode_s"] += stats["time_total_s"] - stats["time_prefill_s"]
                    total["passes"] += stats["target_passes"] - stats["prefill_passes"]
                    texts["plain" if method == "none" else drafter] = text
                identical += texts["plain"] == texts[drafter]
        metrics = httpx.get(server.base + "/metrics").text
    finally:
        server.stop()
    wall = {key: round(t["tokens"] / max(t["wall_s"], 1e-9), 2) for key, t in totals.items()}
    decode = {key: round(t["decode_tokens"] / max(t["decode_s"], 1e-9), 2) for key, t in totals.items()}
    return {"decode_tok_s": decode, "decode_speedup": round(decode[drafter] / max(decode["plain"], 1e-9), 3),
            "end_to_end_tok_s": wall, "end_to_end_speedup": round(wall[drafter] / max(wall["plain"], 1e-9), 3),
            "tokens_per_pass": round(totals[drafter]["decode_tokens"] / max(totals[drafter]["passes"], 1), 3), "identical": identical,
            "requests": len(items), "suffix_metrics": [line for line in metrics.splitlines() if line.startswith("speccompile_suffix")]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("artifact", type=Path)
    parser.add_argument("--workload", type=Path, default=WORKLOAD)
    parser.add_argument("--drafters", default="suffix,ngram")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--limit", type=int, default=None)
    parser.add_argument("--server-args", nargs=argparse.REMAINDER, default=[], help="more `serve` options (last)")
    args = parser.parse_args()
    items = [json.loads(line) for line in args.workload.read_text().splitlines() if line.strip()][: args.limit]
    report = {"artifact": str(args.artifact), "threads": args.threads, "max_tokens": args.max_tokens, "requests": len(items)}
    for drafter in args.drafters.split(","):
        report[drafter] = run_drafter(args.artifact, drafter, items, args)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
