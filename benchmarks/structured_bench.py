#!/usr/bin/env python
"""Constrained decoding, plain vs speculative, on the same runner in the same run (greedy).

For each prompt of the workload (default benchmarks/workloads/json.jsonl: extraction prompts with a JSON schema,
tool-call prompts with tools and tool_choice "required"), the constraint is built as the server builds it
(response_format json_schema strict / the tool format's grammar; tools through the chat template), then the
prompt is generated with plain constrained decoding and with the artifact's drafter, alternating, --repeats
times. Printed: per prompt and overall, tokens/s of each (generated tokens after the first over the time
after prefill, summed over the prompts), tokens per target pass, the speedup ratio, whether the outputs are
token-identical and valid; and the grammar mask's cost per token (the allowed-token mask of every state an
output passes through, replayed and timed) against a one-token plain pass (plain decoding's verify time per
pass). With --server, the same requests go through one `speccompile serve` (started here, --threads as given)
with the real `openai` client instead, plain ones asking `"drafter": "none"` (the server's extension), speeds
from each response's `speculative` statistics. Results are printed, never asserted; `uptime` is printed beside
them. Example:

  python benchmarks/structured_bench.py /tmp/smol --threads 2 [--server]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from speccompile.runtime import Runner  # noqa: E402
from speccompile.runtime.constraints import ConstraintSpec  # noqa: E402
from speccompile.serve.tool_parsers import parse_whole  # noqa: E402
from speccompile.serve.tools import detect_format, with_tools_prompt  # noqa: E402

WORKLOAD = Path(__file__).resolve().parent / "workloads" / "json.jsonl"


def prompt_and_spec(runner: Runner, line: dict) -> tuple[list[int], ConstraintSpec]:
    """The prompt's ids and its constraint, as `serve` builds them for the same request."""
    tokenizer = runner.artifact.tokenizer
    messages = [{"role": "user", "content": line["prompt"]}]
    tools = line.get("tools")
    if tools:
        fmt = detect_format(tokenizer.chat_template)
        if not tokenizer.template_takes_tools:
            messages, tools = with_tools_prompt(messages, tools, fmt), None
        spec = fmt.constraint([t["function"] for t in line["tools"]], parallel=False)
    else:
        spec = ConstraintSpec.json_schema(line["schema"], strict=True)
    text = tokenizer.render_messages(messages, tools)
    return tokenizer.encode(text, add_special_tokens=False), spec


def valid(runner: Runner, line: dict, text: str) -> bool:
    try:
        if line.get("tools"):
            calls = parse_whole(detect_format(runner.artifact.tokenizer.chat_template).parser(), text).tool_calls
            return bool(calls) and all(isinstance(json.loads(c.arguments), dict) for c in calls)
        return isinstance(json.loads(text), dict)
    except json.JSONDecodeError:
        return False


def mask_seconds(compiled, tokens: list[int]) -> tuple[float, int]:
    """Seconds of computing the mask at every state `tokens` pass through (and the number of masks)."""
    state = compiled.new_state()
    total = 0.0
    for token in tokens:
        t0 = time.perf_counter()
        state.allowed_tokens()
        total += time.perf_counter() - t0
        state.advance([token])
    return total, len(tokens)


def request_body(line: dict, max_tokens: int) -> dict:
    """The chat request `serve` gets for a workload line (response_format json_schema strict, or forced tools)."""
    body = {"messages": [{"role": "user", "content": line["prompt"]}], "temperature": 0, "max_tokens": max_tokens}
    if line.get("tools"):
        return {**body, "tools": line["tools"], "tool_choice": line.get("tool_choice", "required"), "parallel_tool_calls": False}
    schema = {"name": line["id"].replace("-", "_")[:64], "schema": line["schema"], "strict": True}
    return {**body, "response_format": {"type": "json_schema", "json_schema": schema}}


def server_phase(args, lines: list[dict]) -> None:
    """Plain and speculative requests alternating on one server: decode tok/s and tokens per pass of each."""
    import openai
    from server_process import ServerProcess

    totals = {"plain": [0, 0.0, 0, 0], "spec": [0, 0.0, 0, 0]}
    identical = True
    with ServerProcess(args.artifact, "--threads", str(args.threads), "--served-model-name", "m") as server:
        client = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=600)
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "warm up"}], max_tokens=8)
        for line in lines:
            body = request_body(line, args.max_tokens)
            answers = {}
            for _ in range(args.repeats):
                for mode in ("plain", "spec"):
                    extra = {"extra_body": {"drafter": "none"}} if mode == "plain" else {}
                    answer = client.chat.completions.create(model="m", **body, **extra)
                    stats = answer.model_extra["speculative"]
                    total = totals[mode]
                    total[0] += max(stats["generated_tokens"] - 1, 0)
                    total[1] += stats["time_total_s"] - stats["time_prefill_s"]
                    total[2] += stats["generated_tokens"] + stats["end_tokens"]
                    total[3] += stats["target_passes"]
                    answers[mode] = answer.choices[0].message.model_dump_json(exclude={"tool_calls": {"__all__": {"id"}}})
            identical &= answers["plain"] == answers["spec"]
    plain, spec = (totals[m][0] / totals[m][1] for m in ("plain", "spec"))
    print(f"server: plain {plain:.1f} tok/s, speculative {spec:.1f} tok/s = {spec / plain:.2f}x; tokens per pass: plain "
          f"{totals['plain'][2] / totals['plain'][3]:.2f}, speculative {totals['spec'][2] / totals['spec'][3]:.2f}; "
          f"identical={identical}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("artifact", type=Path)
    parser.add_argument("--workload", type=Path, default=WORKLOAD)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--drafter", default="auto")
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--limit", type=int, default=None)
    parser.add_argument("--server", action="store_true", help="through `speccompile serve` and the openai client")
    args = parser.parse_args()
    if args.server:
        lines = [json.loads(x) for x in args.workload.read_text().splitlines() if x.strip()][: args.limit]
        print(f"uptime: {subprocess.run(['uptime'], capture_output=True, text=True).stdout.strip()}")
        server_phase(args, lines)
        print(f"uptime: {subprocess.run(['uptime'], capture_output=True, text=True).stdout.strip()}")
        return
    runner = Runner(args.artifact, threads=args.threads, drafter=args.drafter)
    lines = [json.loads(x) for x in args.workload.read_text().splitlines() if x.strip()][: args.limit]
    totals = {"plain": [0, 0.0, 0, 0], "spec": [0, 0.0, 0, 0]}  # decode tokens, seconds, produced tokens, passes
    mask_total, masks, identical, all_valid = 0.0, 0, True, True
    print(f"uptime: {subprocess.run(['uptime'], capture_output=True, text=True).stdout.strip()}")
    runner.generate_ids(runner.artifact.tokenizer.encode("warm up"), 8)  # untimed
    for line in lines:
        ids, spec = prompt_and_spec(runner, line)
        compiled = runner.compile_constraint(spec)
        row = {}
        for _ in range(args.repeats):
            for mode in ("plain", "spec"):
                result = runner.generate_ids(ids, args.max_tokens, drafter="none" if mode == "plain" else None, constraint=compiled)
                s = result.stats
                total = totals[mode]
                total[0] += max(s.generated_tokens - 1, 0)
                total[1] += s.decode_time
                total[2] += s.produced_tokens
                total[3] += s.target_passes
                row[mode] = result
        identical &= row["plain"].tokens == row["spec"].tokens
        ok = valid(runner, line, row["spec"].text)
        all_valid &= ok
        seconds, count = mask_seconds(compiled, row["plain"].tokens)
        mask_total, masks = mask_total + seconds, masks + count
        p, q = row["plain"].stats, row["spec"].stats
        print(f"{line['id']:<22} plain {p.tokens_per_second:6.1f} tok/s  spec {q.tokens_per_second:6.1f} tok/s "
              f"({q.tokens_per_second / max(p.tokens_per_second, 1e-9):.2f}x, {q.mean_accepted_length:.2f} tokens/pass)  "
              f"{q.generated_tokens} tokens  identical={row['plain'].tokens == row['spec'].tokens}  valid={ok}")
    plain_tps = totals["plain"][0] / totals["plain"][1]
    spec_tps = totals["spec"][0] / totals["spec"][1]
    one_pass = totals["plain"][1] / max(totals["plain"][3] - len(lines) * args.repeats, 1)  # decode passes only
    mask = mask_total / max(masks, 1)
    print(f"overall: plain {plain_tps:.1f} tok/s, speculative ({runner.drafter_name}) {spec_tps:.1f} tok/s = "
          f"{spec_tps / plain_tps:.2f}x; tokens per pass: plain {totals['plain'][2] / totals['plain'][3]:.2f}, "
          f"speculative {totals['spec'][2] / totals['spec'][3]:.2f}; identical={identical} valid={all_valid}")
    print(f"grammar mask: {mask * 1e6:.1f} us per token = {100 * mask / one_pass:.2f} % of a one-token plain step "
          f"({one_pass * 1e3:.2f} ms, decode time per pass)")
    print(f"uptime: {subprocess.run(['uptime'], capture_output=True, text=True).stdout.strip()}")


if __name__ == "__main__":
    main()
