"""Replay an EAGLE-3 head over recorded greedy answers: held-out accuracy and modelled tokens per pass.

Compares heads (and the lookup branch) in about a minute, without timing noise: greedy speculative
output equals plain output, so what a head would have had accepted follows from one recorded
generation per prompt (recorded and cached by `ngram_replay.record`). Per answer: the target's features
(torch decoder), the head teacher-forced for two draft steps — top-1 / top-2 accuracy at depth 1, top-1
at depth 2 given the right depth-1 token — then a replay of `tree-2x2` drafting (top-2 first tokens,
each with its top-1 successor) alone and with the n-gram lookup branch (a pass accepts the longer of
the two), as tokens per target pass.

    python benchmarks/head_replay.py --head /work/scratch_heads/smollm2_eagle3_v3 --artifact exported/smollm2 \
        [--workload benchmarks/workloads/chat.jsonl] [--lookup-cap 4]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from ngram_replay import record


def teacher_forced_predictions(head, decoder, seq: np.ndarray):
    """(top-2 at depth 1, top-1 at depth 2) per row j: row j drafts x[j+2] (and x[j+3] given x[j+2])."""
    import torch

    from speccompile.training.data import compute_features
    from speccompile.training.trainer import _unroll_mask

    feats = compute_features(decoder, seq[None], 1, lambda _: None, batch=1)
    m = len(seq) - 1
    tokens = torch.from_numpy(seq)[None]
    hidden = torch.from_numpy(feats["hidden"]).float()
    layer = head.head_config.layer
    empty = torch.zeros(1, layer.num_key_value_heads, 0, layer.head_dim)
    with torch.no_grad():
        logits0, k0, v0, g0 = head(tokens[:, 1:], torch.arange(m)[None], _unroll_mask(m, 0, torch)[None],
                                   hidden[:, :m], torch.zeros(1, m, layer.hidden_size), empty, empty)
        ids1 = torch.zeros(1, m, dtype=torch.long)
        ids1[:, : m - 1] = tokens[:, 2:]
        logits1, *_ = head(ids1, (torch.arange(m) + 1)[None], _unroll_mask(m, 1, torch)[None],
                           torch.zeros(1, m, hidden.shape[-1]), g0, k0, v0)
    d2t = head.d2t.numpy() + np.arange(len(head.d2t))
    return d2t[logits0[0].topk(2, -1).indices.numpy()], d2t[logits1[0].argmax(-1).numpy()]


def replay(prompt_len: int, seq: np.ndarray, top2: np.ndarray, top1_next: np.ndarray, lookup_cap: int) -> dict[str, int]:
    """Target passes for the answer with tree-2x2 alone and with the lookup branch."""
    from speccompile.runtime.drafters.ngram import NgramDrafter

    t = len(seq)

    def head_accepts(n: int) -> int:  # pending token at n: the head drafts x[n+1] (row n-1) and x[n+2]
        if n + 1 >= t or seq[n + 1] not in top2[n - 1]:
            return 0
        return 2 if n + 2 < t and top1_next[n - 1] == seq[n + 2] else 1

    passes = {}
    for mode in ("head", "head+lookup"):
        lookup, n, count = NgramDrafter(), prompt_len, 0
        while n < t - 1:
            accepted = head_accepts(n)
            if mode == "head+lookup":
                chain = lookup.lookup(list(seq[: n + 1]), lookup_cap).tokens
                run = 0
                while run < len(chain) and n + 1 + run < t and chain[run] == seq[n + 1 + run]:
                    run += 1
                accepted = max(accepted, run)
            count += 1
            n += accepted + 1
        passes[mode] = count
    return passes


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--head", required=True, help="EAGLE-3 head folder (speculators layout)")
    ap.add_argument("--artifact", required=True, help="exported SmolLM2 artifact (records the greedy answers)")
    ap.add_argument("--workload", default="benchmarks/workloads/chat.jsonl")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--lookup-cap", type=int, default=4, help="longest lookup chain (the head artifact's k)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--cache", default=None, help="recorded outputs [default: <artifact>/greedy_<workload>.json]")
    args = ap.parse_args()

    import torch

    from speccompile.models.decoder import build_decoder
    from speccompile.models.head_loaders import load_head
    from speccompile.models.load import load_model

    torch.set_num_threads(args.threads)
    workload = Path(args.workload)
    cache = Path(args.cache or Path(args.artifact) / f"greedy_{workload.stem}.json")
    rows = record(Path(args.artifact), [workload], args.max_tokens, args.threads, cache)
    model = load_model("smollm2-135m")
    head = load_head("eagle3", args.head, model.config, model.weights).eval()
    decoder = build_decoder(model.config, model.weights, "eagle3")
    hits = {"depth1_top1": 0, "depth1_top2": 0, "depth2_top1": 0, "positions": 0, "depth1_right": 0}
    passes = {"head": 0, "head+lookup": 0}
    answer_tokens = 0
    for row in rows:
        seq = np.asarray(row["prompt"] + row["output"], dtype=np.int64)
        top2, top1_next = teacher_forced_predictions(head, decoder, seq)
        p = len(row["prompt"])
        for n in range(p, len(seq) - 1):  # pending token n, drafting x[n+1] (row n-1)
            right = seq[n + 1] == top2[n - 1, 0]
            hits["positions"] += 1
            hits["depth1_top1"] += int(right)
            hits["depth1_top2"] += int(seq[n + 1] in top2[n - 1])
            if right and n + 2 < len(seq):
                hits["depth1_right"] += 1
                hits["depth2_top1"] += int(top1_next[n - 1] == seq[n + 2])
        for mode, count in replay(p, seq, top2, top1_next, args.lookup_cap).items():
            passes[mode] += count
        answer_tokens += len(row["output"]) - 1
    report = {
        "head": args.head, "workload": workload.stem, "prompts": len(rows), "positions": hits["positions"],
        "depth1_top1": round(hits["depth1_top1"] / hits["positions"], 3),
        "depth1_top2": round(hits["depth1_top2"] / hits["positions"], 3),
        "depth2_top1_given_depth1": round(hits["depth2_top1"] / max(hits["depth1_right"], 1), 3),
        "tokens_per_pass": {mode: round(answer_tokens / count, 3) for mode, count in passes.items()},
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
