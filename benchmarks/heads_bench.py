"""Chain vs static tree vs dynamic tree with a drafter head, against plain decoding (greedy).

    python benchmarks/heads_bench.py --head /work/scratch_heads/smollm2_eagle3 --kind eagle3 \
        [--artifact /work/scratch_heads/smol_eagle3_art] [--workload benchmarks/workloads/chat.jsonl] [--limit N]

Exports SmolLM2-135M fp32 with the head if the artifact is missing. For every prompt: plain decoding,
then each drafting mode (same backend, same session), checking the tokens are identical. Prints
tokens per target pass, acceptance per draft depth, tok/s and speedup over plain.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

def tree_of(mode: str, args) -> str:
    """The --tree value of a mode: chain, static[=PRESET], dynamic or dynamic-pP (a +lookup suffix is not part of it)."""
    base, _, preset = mode.removesuffix("+lookup").partition("=")
    if base == "chain":
        return "chain"
    if base == "static":
        return preset or args.static_tree
    if base.startswith("dynamic"):
        min_prob = float(base[len("dynamic-p"):]) if base.startswith("dynamic-p") else args.dynamic_min_prob
        return f"dynamic-{args.k}-{args.dynamic_top_k}-{args.dynamic_nodes}" + (f"-p{min_prob}" if min_prob else "")
    raise SystemExit(f"--modes: unknown mode {mode!r}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--head", required=True)
    ap.add_argument("--kind", default="eagle3", choices=["eagle", "eagle3", "medusa", "mtp", "dflash"],
                    help="dflash drafts one block per pass: use --modes chain")
    ap.add_argument("--artifact", default=None)
    ap.add_argument("--workload", default="benchmarks/workloads/chat.jsonl")
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--k", type=int, default=5, help="draft depth")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--modes", default="chain,static,dynamic", help="comma list of chain, static, static=PRESET, dynamic, dynamic-pP (confidence-bound); "
                    "a +lookup suffix adds the n-gram lookup branch")
    ap.add_argument("--static-tree", default="eagle-default", help="tree preset of the static mode")
    ap.add_argument("--dynamic-nodes", type=int, default=40, help="nodes kept by the dynamic tree")
    ap.add_argument("--dynamic-top-k", type=int, default=8, help="children expanded per frontier node")
    ap.add_argument("--dynamic-min-prob", type=float, default=0.0,
                    help="confidence-bound dynamic tree: no node below this cumulative draft probability")
    ap.add_argument("--adaptive", action="store_true", help="let the adaptive controller pick k (default: fixed k)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    from speccompile.runtime.bench import load_workload
    from speccompile.runtime.session import Runner

    artifact = Path(args.artifact or f"/work/scratch_heads/smol_{args.kind}_art")
    if not artifact.exists():
        from speccompile.export.pipeline import ExportOptions, export_artifact

        t = time.time()
        export_artifact("smollm2-135m", artifact, ExportOptions(drafter=f"{args.kind}:{args.head}", max_context=2048), print)
        print(f"exported {artifact} in {time.time() - t:.0f}s")
    # one runner per mode: what its tree planner and lookup branch learn carries over from prompt to prompt
    modes = args.modes.split(",")
    runners = {m: Runner(artifact, threads=args.threads, drafter=args.kind, num_draft_tokens=args.k, adaptive=args.adaptive,
                         tree=None if args.kind == "dflash" else tree_of(m, args), lookup_branch=m.endswith("+lookup"))
               for m in modes}
    # plain decoding at its best: its own session, whose threads may spin (no drafter graph alternates with it)
    plain_runner = Runner(artifact, threads=args.threads, drafter="none")
    prompts = load_workload(Path(args.workload), args.limit)
    tok = plain_runner.artifact.tokenizer
    plain_runner.generate_ids(tok.prompt_ids(prompts[0]["prompt"], True), 16)  # warm-up (every session)
    for runner in runners.values():
        runner.generate_ids(tok.prompt_ids(prompts[0]["prompt"], True), 16)
    rows = {m: {"tps": [], "mal": [], "drafted": [], "accepted": [], "speedup": [], "identical": 0,
                "draft_s": 0.0, "verify_s": 0.0, "passes": 0} for m in modes}
    plain_tps = []
    for item in prompts:
        ids = tok.prompt_ids(item["prompt"], item["chat"])
        plain = plain_runner.generate_ids(ids, args.max_tokens)
        plain_tps.append(plain.stats.tokens_per_second)
        for m in modes:
            res = runners[m].generate_ids(ids, args.max_tokens)
            r = rows[m]
            r["identical"] += int(res.tokens == plain.tokens)
            r["tps"].append(res.stats.tokens_per_second)
            r["mal"].append(res.stats.mean_accepted_length)
            r["speedup"].append(res.stats.tokens_per_second / max(plain.stats.tokens_per_second, 1e-9))
            r["draft_s"] += res.stats.time_draft
            r["verify_s"] += res.stats.time_verify
            r["passes"] += res.stats.target_passes
            for key, vals in (("drafted", res.stats.drafted), ("accepted", res.stats.accepted)):
                for i, v in enumerate(vals):
                    while len(r[key]) <= i:
                        r[key].append(0)
                    r[key][i] += v
        print(f"{item['id']}: plain {plain.stats.tokens_per_second:.1f} tok/s | " + " | ".join(
            f"{m} {rows[m]['tps'][-1]:.1f} tok/s {rows[m]['mal'][-1]:.2f} tok/pass" for m in modes), flush=True)
    report = {"artifact": str(artifact), "kind": args.kind, "k": args.k, "prompts": len(prompts), "max_tokens": args.max_tokens,
              "plain_tok_s": round(statistics.mean(plain_tps), 2), "modes": {}}
    for m in modes:
        r = rows[m]
        report["modes"][m] = {
            "tok_s": round(statistics.mean(r["tps"]), 2),
            "speedup_mean": round(statistics.mean(r["speedup"]), 3),
            "speedup_of_means": round(statistics.mean(r["tps"]) / statistics.mean(plain_tps), 3),
            "tokens_per_pass": round(statistics.mean(r["mal"]), 3),
            "acceptance_per_depth": [round(a / d, 3) if d else 0.0 for a, d in zip(r["accepted"], r["drafted"])],
            "draft_ms_per_pass": round(1000 * r["draft_s"] / max(r["passes"], 1), 2),
            "verify_ms_per_pass": round(1000 * r["verify_s"] / max(r["passes"], 1), 2),
            "identical": f"{r['identical']}/{len(prompts)}",
        }
    if args.json:
        print(json.dumps(report, indent=2))
        return
    print(f"\nplain: {report['plain_tok_s']} tok/s ({len(prompts)} prompts, {args.max_tokens} tokens, greedy, {args.threads} threads)")
    print(f"{'mode':8} {'tok/s':>7} {'speedup':>8} {'tok/pass':>9} {'draft ms':>9} {'verify ms':>10}  identical  acceptance per depth")
    for m, v in report["modes"].items():
        print(f"{m:8} {v['tok_s']:7.1f} {v['speedup_of_means']:7.2f}x {v['tokens_per_pass']:9.2f} {v['draft_ms_per_pass']:9.2f} "
              f"{v['verify_ms_per_pass']:10.2f}  {v['identical']:>9}  {v['acceptance_per_depth']}")
    print("(draft / verify ms are per target pass; plain decoding costs "
          f"{1000 / max(report['plain_tok_s'], 1e-9):.1f} ms per token)")


if __name__ == "__main__":
    main()
