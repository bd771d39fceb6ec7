#!/usr/bin/env python
"""What a new user meets: every causal-LM model type the installed transformers knows, as a tiny random checkpoint
written by transformers itself (a character tokenizer beside it), given to `speccompile export`. Each type ends in one of:

  exported  the export succeeded (the family tests check such rows against transformers: tests/test_families.py)
  refused   exit 2 with one `error:` line (the reason: models/refused.py, or "unsupported architecture")
  BROKEN    anything else (a traceback, another exit code): a bug
  no-model  transformers could not build the tiny checkpoint from the generic shape (not speccompile's doing)

Each type runs in its own process with a memory limit, so a model whose defaults are huge cannot take the machine.

    python benchmarks/family_sweep.py [--only TYPE ...] [--out sweep.json]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

SHAPE = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=512, bos_token_id=1, eos_token_id=2, pad_token_id=0)
MEMORY_BYTES = 8 << 30


def write_tiny(model_type: str, folder: Path) -> None:
    """A tiny random checkpoint of `model_type` (the generic shape) saved by transformers, with a char tokenizer."""
    import torch
    import transformers

    config = transformers.AutoConfig.for_model(model_type, **SHAPE)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(folder, safe_serialization=True)
    write_char_tokenizer(folder)


def write_char_tokenizer(folder: Path) -> None:
    """A character-level tokenizer.json of SHAPE's vocabulary (<pad>, <s>, </s>, then printable characters)."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers

    special = ["<pad>", "<s>", "</s>"]
    chars = [chr(c) for c in range(32, 32 + SHAPE["vocab_size"] - len(special))]
    tokenizer = Tokenizer(models.WordLevel({t: i for i, t in enumerate(special + chars)}, unk_token="<pad>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tokenizer.add_special_tokens(special)
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))


def _cli() -> str:
    """The `speccompile` command of this interpreter's environment (an unactivated venv's too), else the PATH's."""
    beside = Path(sys.executable).parent / "speccompile"
    return str(beside) if beside.exists() else "speccompile"


def one(model_type: str) -> tuple[str, str]:
    """(outcome, the last stderr line) for `model_type`."""
    with tempfile.TemporaryDirectory() as tmp:
        folder, out = Path(tmp) / "m", Path(tmp) / "art"
        make = subprocess.run([sys.executable, __file__, "--write", model_type, str(folder)], capture_output=True, text=True,
                              preexec_fn=_limit, timeout=600)
        if make.returncode:
            return "no-model", (make.stderr.strip().splitlines() or [""])[-1][:160]
        run = subprocess.run([_cli(), "export", str(folder), "--out", str(out)], capture_output=True, text=True,
                             preexec_fn=_limit, timeout=600)
    err = run.stderr.strip()
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    if run.returncode == 0:
        return "exported", ""
    if run.returncode == 2 and len(errors) == 1 and "Traceback" not in err:
        return "refused", errors[0][:160]
    return "BROKEN", (err.splitlines() or [""])[-1][:160]


def _limit() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_BYTES, MEMORY_BYTES))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", nargs="+", default=None)
    parser.add_argument("--out", default=None)
    parser.add_argument("--write", nargs=2, help=argparse.SUPPRESS)  # the child process: TYPE FOLDER
    args = parser.parse_args()
    if args.write:
        write_tiny(args.write[0], Path(args.write[1]))
        return
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    results = {}
    for model_type in args.only or sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES):
        results[model_type] = one(model_type)
        print(f"{model_type:32s} {results[model_type][0]:9s} {results[model_type][1]}", flush=True)
    counts = {kind: sum(r[0] == kind for r in results.values()) for kind in ("exported", "refused", "BROKEN", "no-model")}
    print(" ".join(f"{kind} {n}" for kind, n in counts.items()))
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
