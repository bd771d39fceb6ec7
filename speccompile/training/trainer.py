"""Self-distillation of drafter heads on the CPU: `speccompile train-draft TARGET --method eagle3|eagle|medusa|dflash`.

Labels come from the target itself: its hidden states (inputs) and its next-token distributions
(targets, kept as the top-`label_k` probabilities per position), computed once over the training text
and cached in `OUT/.cache/` so a resumed run does not recompute them. The head is then trained with

* eagle:  L = smoothL1(g_t, f_{t+1}) + w_cls * CE(p_target(x_{t+2}), softmax(lm_head(g_t)))
* eagle3: CE only, over a draft vocabulary of the `draft_vocab` tokens the target predicts most
  often (d2t/t2d written with the head);
* medusa: head i: CE(p_target(x_{t+i+2}), head_i(f_t));
* dflash: the DFlash block drafter over EAGLE-3's taps (training/dflash.py).

EAGLE / EAGLE-3 unroll `unroll` draft steps per position ("training-time test"): step s feeds the
head's own output feature of step s-1, attending the committed rows up to t plus its own chain —
exactly the masks drafting uses, so deeper drafts see at training time what they see at run time.
Checkpoints (published layout + trainer state) are written every `save_every` steps; `resume`
continues from them.
"""

from __future__ import annotations

import json
import math
import shutil
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np

from ..errors import InputError
from . import dflash
from .data import Progress, collect_texts, load_or_compute_features, target_tokenizer, tokenize_chunks
from .options import TrainOptions

TRAINER_STATE = "trainer_state.pt"
STAGING = ".saving"  # OUT/.saving.tmp: a checkpoint's head files before they are moved into place


# ----------------------------------------------------------------------------------------------
# Losses


def _soft_ce(logits, idx, p, valid):
    """-sum_i p_i log softmax(logits)[idx_i] over rows where valid; p renormalised over the kept labels."""
    import torch

    logp = torch.log_softmax(logits.float(), dim=-1).gather(-1, idx)
    p = p.float()
    mass = p.sum(-1, keepdim=True)
    p = torch.where(mass > 0, p / mass.clamp_min(1e-9), p)
    per_row = -(p * logp).sum(-1)
    valid = valid & (mass.squeeze(-1) > 0)
    return (per_row * valid).sum() / valid.sum().clamp_min(1), valid


def _top1_hits(logits, idx, valid):
    hit = (logits.argmax(-1) == idx[..., 0]) & valid
    return int(hit.sum()), int(valid.sum())


def _unroll_mask(t: int, step: int, torch):
    """Mask of unrolled draft step `step` [t, (step+1)*t]: committed rows 0..i, own chain rows, itself."""
    eye = torch.eye(t, dtype=torch.bool)
    blocks = [torch.ones(t, t, dtype=torch.bool).tril()] + [eye] * step
    return torch.cat(blocks, dim=1)


class HeadTrainer:
    """Holds the head, optimizer, features and the step function for one method."""

    def __init__(self, model, options: TrainOptions, feats: dict[str, np.ndarray]):
        import torch

        from ..models.head_writers import new_head

        self.torch = torch
        self.options = options
        self.model = model
        cfg = model.config
        self.feats = feats
        self.method = options.method
        torch.manual_seed(options.seed)
        d2t = None
        if self.method == "eagle3":
            dv = min(options.draft_vocab or 8192, cfg.vocab_size)
            counts = np.bincount(feats["top_idx"][..., 0].reshape(-1), minlength=cfg.vocab_size)
            counts = counts + 1e-3 * np.bincount(feats["tokens"].reshape(-1), minlength=cfg.vocab_size)
            keep = np.sort(np.argsort(-counts, kind="stable")[:dv])
            d2t = keep - np.arange(dv)
            self._index_draft_vocab(keep)
            head = new_head("eagle3", cfg, model.weights, draft_vocab_size=dv, seed=options.seed)
            with torch.no_grad():
                head.d2t.copy_(torch.from_numpy(d2t))
                t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
                t2d[torch.from_numpy(keep)] = True
                head.t2d.copy_(t2d)
                from ..models.heads import target_lm_head, target_tensor

                head.lm_head.weight.copy_(target_lm_head(cfg, model.weights)[torch.from_numpy(keep)])
                head.norm.weight.copy_(target_tensor(model.weights, "model.norm.weight"))
        elif self.method == "eagle":
            head = new_head("eagle", cfg, model.weights, seed=options.seed)
        elif self.method == "dflash":
            head = dflash.new_training_drafter(model, options)
        else:
            head = new_head("medusa", cfg, model.weights, medusa_num_heads=options.medusa_heads, seed=options.seed)
        self.head = head.train()
        frozen = {"embed_tokens.weight", "lm_head.weight"} if self.method in ("eagle", "dflash") else {"embed_tokens.weight"}
        for name, p in head.named_parameters():
            p.requires_grad_(name not in frozen)
        self.params = [p for p in head.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(self.params, lr=options.lr, betas=(0.9, 0.95), weight_decay=0.0)
        self.step = 0
        self.rng = np.random.default_rng(options.seed)

    def _index_draft_vocab(self, keep: np.ndarray) -> None:
        """Map target token ids to draft ids (-1 outside the draft vocabulary `keep`, sorted target ids)."""
        self.t2d_index = np.full(self.model.config.vocab_size, -1, dtype=np.int64)
        self.t2d_index[keep] = np.arange(len(keep))

    def lr_at(self, step: int) -> float:
        o = self.options
        if step < o.warmup:
            return o.lr * (step + 1) / o.warmup
        frac = (step - o.warmup) / max(1, o.steps - o.warmup)
        return o.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, frac))))

    def _batch(self):
        torch = self.torch
        n = self.feats["tokens"].shape[0]
        rows = self.rng.choice(n, size=min(self.options.batch, n), replace=False)
        get = lambda k: torch.from_numpy(np.ascontiguousarray(self.feats[k][rows]))  # noqa: E731
        return get("tokens"), get("hidden").float(), get("top_idx").long(), get("top_p").float()

    def train_step(self) -> dict[str, float]:
        torch = self.torch
        for group in self.opt.param_groups:
            group["lr"] = self.lr_at(self.step)
        tokens, hidden, top_idx, top_p = self._batch()
        if self.method == "medusa":
            loss, stats = self._medusa_loss(tokens, hidden, top_idx, top_p)
        elif self.method == "dflash":
            loss, stats = dflash.dflash_loss(self.head, tokens, hidden, top_idx, top_p, self.rng, _soft_ce, _top1_hits)
        else:
            loss, stats = self._ar_loss(tokens, hidden, top_idx, top_p)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.params, 1.0)
        self.opt.step()
        self.step += 1
        stats["loss"] = float(loss.detach())
        return stats

    def _ar_loss(self, tokens, hidden, top_idx, top_p):
        """Unrolled EAGLE / EAGLE-3 loss over a batch of [b, T] sequences."""
        torch = self.torch
        head = self.head
        b, t = tokens.shape
        m = t - 1  # rows t = 0..T-2 pair (f_t, x_{t+1})
        total = 0.0
        stats: dict[str, float] = {}
        past_k = torch.zeros(b, head.head_config.layer.num_key_value_heads, 0, head.head_config.layer.head_dim)
        past_v = past_k
        h_in = hidden[:, :m]
        for s in range(self.options.unroll):
            rows = m - s  # rows whose input token x_{t+1+s} exists
            if rows <= 1:
                break
            ids = torch.zeros(b, m, dtype=torch.long)
            ids[:, :rows] = tokens[:, 1 + s: 1 + s + rows]
            pos = (torch.arange(m) + s).expand(b, m)
            mask = _unroll_mask(m, s, torch).expand(b, m, (s + 1) * m)
            if self.method == "eagle3":
                aux = h_in if s == 0 else torch.zeros(b, m, hidden.shape[-1])
                hid = torch.zeros(b, m, head.head_config.layer.hidden_size) if s == 0 else h_in
                logits, k_all, v_all, g = head(ids, pos, mask, aux, hid, past_k, past_v)
            else:
                logits, k_all, v_all, g = head(ids, pos, mask, h_in, past_k, past_v)
            # labels: the target's distribution at position t+1+s (predicts x_{t+2+s})
            valid = torch.zeros(b, m, dtype=torch.bool)
            valid[:, :rows] = True
            lab_idx = torch.zeros(b, m, self.options.label_k, dtype=torch.long)
            lab_p = torch.zeros(b, m, self.options.label_k)
            lab_idx[:, :rows] = top_idx[:, 1 + s: 1 + s + rows]
            lab_p[:, :rows] = top_p[:, 1 + s: 1 + s + rows]
            if self.method == "eagle3":
                mapped = torch.from_numpy(self.t2d_index)[lab_idx]
                lab_p = torch.where(mapped >= 0, lab_p, torch.zeros_like(lab_p))
                lab_idx = mapped.clamp_min(0)
            ce, ok = _soft_ce(logits, lab_idx, lab_p, valid)
            weight = 0.8 ** s
            step_loss = self.options.cls_weight * ce
            if self.method == "eagle":
                target_f = torch.zeros_like(g)
                target_f[:, :rows] = hidden[:, 1 + s: 1 + s + rows]
                reg = torch.nn.functional.smooth_l1_loss(g[ok], target_f[ok]) if ok.any() else g.sum() * 0
                step_loss = step_loss + self.options.reg_weight * reg
                stats[f"reg{s}"] = float(reg.detach())
            total = total + weight * step_loss
            hits, count = _top1_hits(logits.detach(), lab_idx, ok & (lab_p[..., 0] > 0))
            stats[f"acc{s}"] = hits / max(count, 1)
            past_k, past_v = k_all, v_all
            h_in = g
        return total, stats

    def _medusa_loss(self, tokens, hidden, top_idx, top_p):
        torch = self.torch
        logits = self.head(hidden)  # [b, T, heads, V]
        b, t = tokens.shape
        total = 0.0
        stats = {}
        for i in range(logits.shape[2]):
            shift = i + 1  # head i on f_t predicts x_{t+i+2}: the target's distribution at t+i+1
            valid = torch.zeros(b, t, dtype=torch.bool)
            valid[:, : t - shift] = True
            idx = torch.zeros(b, t, self.options.label_k, dtype=torch.long)
            p = torch.zeros(b, t, self.options.label_k)
            idx[:, : t - shift] = top_idx[:, shift:]
            p[:, : t - shift] = top_p[:, shift:]
            ce, ok = _soft_ce(logits[:, :, i], idx, p, valid)
            total = total + ce * (0.8 ** i)
            hits, count = _top1_hits(logits[:, :, i].detach(), idx, ok)
            stats[f"acc{i}"] = hits / max(count, 1)
        return total, stats

    # -- checkpoints ----------------------------------------------------------------------------

    def save(self, out: Path, summary: dict) -> None:
        import torch

        from ..models.dflash_io import save_dflash
        from ..models.head_writers import save_head

        self.head.eval()
        staging = out / f"{STAGING}.tmp"  # whole files only: an interrupted save never leaves a truncated head
        if self.method == "dflash":
            save_dflash(self.head, staging, self.model.config.num_hidden_layers, extra_config={"speccompile_training": summary})
        else:
            save_head(self.head, staging, {"speccompile_training": summary})
        for written in staging.iterdir():
            written.replace(out / written.name)
        staging.rmdir()
        state = {"step": self.step, "optimizer": self.opt.state_dict(),
                 "head": {k: v for k, v in self.head.state_dict().items()}}
        tmp = out / "trainer_state.pt.tmp"
        torch.save(state, tmp)
        tmp.replace(out / "trainer_state.pt")
        self.head.train()

    def load(self, out: Path) -> None:
        import torch

        state = torch.load(str(out / "trainer_state.pt"), map_location="cpu", weights_only=True)
        self.head.load_state_dict(state["head"])
        if self.method == "eagle3":  # the checkpoint's draft vocabulary, not the one this run's data would pick
            self._index_draft_vocab(self.head.draft_to_target().numpy())
        self.opt.load_state_dict(state["optimizer"])
        self.step = int(state["step"])
        self.rng = np.random.default_rng([self.options.seed, self.step])


def train_draft(target_name: str, data: list[Path], out: Path, options: TrainOptions, progress: Progress = lambda _: None) -> dict:
    """Train a drafter head for `target_name` and write it to `out` (published layout). Returns a summary."""
    from ..atomic_dir import terminate_as_interrupt
    from ..models.load import resolve_model_path

    options.validate()
    out = Path(out)
    texts = collect_texts(data)  # bad data / out fail before torch and the target load, and create nothing
    check_head_folder(out, options)
    resolve_model_path(target_name)
    import torch

    if options.threads:
        torch.set_num_threads(options.threads)
    with terminate_as_interrupt():
        try:
            return _train(target_name, texts, out, options, progress)
        finally:
            _remove_partial_files(out)


def is_head_folder(path: Path) -> bool:
    """True when `path` holds what train-draft writes: a checkpoint, a head it trained or its feature cache."""
    if (path / TRAINER_STATE).is_file() or any((path / ".cache").glob("features-*.safetensors")):
        return True
    try:
        return "speccompile_training" in json.loads((path / "config.json").read_text())
    except (OSError, ValueError, TypeError):
        return False


def check_head_folder(out: Path, options: TrainOptions) -> None:
    """`out` must be new, empty or a train-draft folder; `force` starts over there, `resume` continues."""
    from ..atomic_dir import check_replaceable, is_empty_dir

    what = "a train-draft head folder"
    if options.resume and options.force:
        raise InputError("resume and force are mutually exclusive (continue the run, or start over)", ("resume", "force"))
    if options.resume:
        if not (out / TRAINER_STATE).is_file():
            raise InputError(f"resume: {out} has no {TRAINER_STATE} to resume from", "resume")
        return
    if out.exists() and out.is_dir() and not options.force:
        if (out / TRAINER_STATE).is_file():
            raise InputError(f"out {out}: holds a training run already (resume continues it, force starts over)",
                             ("out", "resume", "force"))
        if is_empty_dir(out) or is_head_folder(out):
            return  # e.g. only the feature cache of an earlier run: reused
    check_replaceable(out, options.force, is_head_folder, what)
    if options.force and out.is_dir():
        for name in (TRAINER_STATE, "config.json", "model.safetensors"):  # the feature cache is kept (keyed by content)
            (out / name).unlink(missing_ok=True)


def _remove_partial_files(out: Path) -> None:
    """Half-written checkpoint or cache files (`*.tmp`) of an interrupted run."""
    for folder in (out, out / ".cache"):
        if folder.is_dir():
            for partial in folder.glob("*.tmp"):
                if partial.is_dir():
                    shutil.rmtree(partial, ignore_errors=True)
                else:
                    partial.unlink(missing_ok=True)


def _train(target_name: str, texts: list[tuple[str, str]], out: Path, options: TrainOptions, progress: Progress) -> dict:
    from ..atomic_dir import honour_umask
    from ..models.load import load_model

    started = time.time()
    progress(f"loading target {target_name}")
    model = load_model(target_name)
    _check_target(model.config, options)
    tokenizer = target_tokenizer(model)
    chunks = tokenize_chunks(texts, tokenizer, options.seq_len, options.max_tokens, model.config.bos_token_id)
    progress(f"{len(texts)} documents -> {chunks.shape[0]} chunks x {options.seq_len} tokens")
    feats = load_or_compute_features(model, chunks, options, out, progress)
    feature_seconds = time.time() - started
    trainer = HeadTrainer(model, options, feats)
    if options.resume:
        trainer.load(out)
        progress(f"resumed at step {trainer.step}")
    t0 = time.time()
    first_step = trainer.step
    history: list[dict] = []
    ema: dict[str, float] = {}
    while trainer.step < options.steps:
        stats = trainer.train_step()
        for k, v in stats.items():
            ema[k] = v if k not in ema else 0.9 * ema[k] + 0.1 * v
        done = trainer.step - first_step
        rate = done / max(time.time() - t0, 1e-9)
        eta = (options.steps - trainer.step) / max(rate, 1e-9)
        accs = " ".join(f"acc{i}={ema[f'acc{i}']:.2f}" for i in range(8) if f"acc{i}" in ema)
        progress(f"step {trainer.step}/{options.steps} loss={ema['loss']:.3f} {accs} lr={trainer.lr_at(trainer.step - 1):.2e} "
                 f"({rate:.2f} steps/s, eta {eta:.0f}s)")
        if trainer.step % 10 == 0 or trainer.step == options.steps:
            history.append({"step": trainer.step, **{k: round(v, 4) for k, v in ema.items()}})
        if trainer.step % options.save_every == 0 or trainer.step == options.steps:
            trainer.save(out, _summary(target_name, model, options, chunks, feature_seconds, t0, trainer, history))
    summary = _summary(target_name, model, options, chunks, feature_seconds, t0, trainer, history)
    trainer.save(out, summary)
    honour_umask(out)
    progress(f"wrote {options.method} head to {out} in {time.time() - started:.0f}s")
    return summary


def _check_target(config, options: TrainOptions) -> None:
    """Refuse a target the head kind cannot read: EAGLE-3 (and DFlash as trained here) fuses the inputs of layers
    (2, L//2, L-3)."""
    if options.method in ("eagle3", "dflash") and config.num_hidden_layers < 3:
        raise InputError(f"method {options.method}: the target has {config.num_hidden_layers} layers; it reads the inputs of "
                         "layers (2, L//2, L-3) of an L-layer target, which needs at least 3", "method")


def _summary(target_name, model, options, chunks, feature_seconds, t0, trainer, history) -> dict:
    opts = {k: v for k, v in asdict(options).items() if k not in ("extra", "resume", "force", "threads")}
    return {
        "target": target_name,
        "target_sha256": model.source_sha256,
        "method": options.method,
        "options": opts,
        "train_tokens": int(chunks.size),
        "steps": trainer.step,
        "tokens_seen": int(trainer.step * options.batch * options.seq_len),
        "feature_seconds": round(feature_seconds, 1),
        "train_seconds": round(time.time() - t0, 1),
        "last": history[-1] if history else {},
    }
