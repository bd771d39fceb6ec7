"""benchmarks/serve_load.py end to end on a tiny artifact: every phase runs, nothing is lost or duplicated."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_serve_load_runs_every_phase_and_loses_nothing(tiny_artifact, tmp_path):
    workload = tmp_path / "prompts.jsonl"
    workload.write_text("\n".join(json.dumps({"id": f"p{i}", "prompt": text, "chat": False})
                                  for i, text in enumerate(["abc abc abc", "hello there", "the cat sat"])) + "\n")
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "serve_load.py"), str(tiny_artifact), "--workload", str(workload),
         "--max-tokens", "8", "--streams", "2", "--passes", "2", "--one-stream-passes", "2", "--stagger", "--requests", "8", "--clients", "3",
         "--request-rate", "20", "--rate-requests", "5", "--json", "--", "--threads", "1"],
        capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-2000:]
    summary = json.loads(result.stdout)
    phases = {p["phase"]: p for p in summary["phases"]}
    assert list(phases) == ["streams-1", "streams-2", "churn", "rate-20"]
    assert phases["streams-1"]["requests"] == 6 and phases["streams-2"]["requests"] == 6  # the prompts twice over
    assert all(p["server_cpu_s"] > 0 and p["client_cpu_s"] > 0 for p in phases.values()), phases
    ratios = summary["ratios"]
    assert ratios["streams-2_over_streams-1_tok_per_s"] == round(phases["streams-2"]["tok_per_s"] / phases["streams-1"]["tok_per_s"], 2)
    assert ratios["streams-2_over_streams-1_ttft_p50"] > 0
    assert phases["streams-2"]["ttft_p50_first_wave_s"] is not None and phases["streams-2"]["ttft_p50_steady_s"] is not None
    assert phases["rate-20"]["requests"] == 5 and phases["rate-20"]["most_in_flight"] >= 1
    assert summary["stagger_s"] > 0  # --stagger: the streams-2 clients started one after the other
    assert all(p["mismatches"] == 0 and p["errors"] == 0 for p in phases.values()), phases
    assert summary["churn"]["sent"] == 8 and summary["churn"]["lost"] == 0 and summary["churn"]["duplicated"] == 0
    assert summary["server_exit"] == 0


def test_serve_load_restart_runs_the_n_streams_on_a_fresh_server(tiny_artifact, tmp_path):
    """--restart: the streams-N phase runs on a second server (its cache holds only the warm-up prompt), and
    its answers still equal the first server's."""
    workload = tmp_path / "prompts.jsonl"
    workload.write_text("\n".join(json.dumps({"id": f"p{i}", "prompt": text, "chat": False})
                                  for i, text in enumerate(["abc abc abc", "hello there"])) + "\n")
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "serve_load.py"), str(tiny_artifact), "--workload", str(workload),
         "--max-tokens", "8", "--streams", "2", "--requests", "0", "--restart", "--json", "--", "--threads", "1"],
        capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-2000:]
    summary = json.loads(result.stdout)
    assert "after_restart_warmup" in summary["rss_mb"] and summary["server_exit"] == 0
    assert all(p["mismatches"] == 0 and p["errors"] == 0 for p in summary["phases"])


def test_serve_load_prints_a_phase_without_requests(capsys):
    """The text report of a run whose churn phase sent nothing (`--requests 0`): "-" where nothing was measured."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import serve_load
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    phase = {"phase": "churn", "requests": 0, "finished": 0, "disconnected": 0, "errors": 0, "completion_tokens": 0,
             "wall_s": 0.1, "tok_per_s": 0.0, "ttft_p50_s": None, "ttft_p95_s": None, "ttft_p50_first_wave_s": None,
             "ttft_p50_steady_s": None, "mismatches": 0, "client_cpu_s": 0.0, "server_cpu_s": 0.0}
    serve_load.print_summary({"phases": [phase], "ratios": {"streams-8_over_streams-1_tok_per_s": None},
                              "churn": {"sent": 0, "lost": 0, "duplicated": 0, "server_outcomes": {}}, "stagger_s": 0.0,
                              "rss_mb": {"after_warmup": 1.0}, "server_exit": 0})
    out = capsys.readouterr().out
    assert "churn" in out and "streams-8_over_streams-1_tok_per_s -\n" in out and "churn - / -" in out
