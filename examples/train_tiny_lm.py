"""Train a tiny character-level decoder-only transformer (Flax linen) with flash_attention.

The model is trained twice from the same initial parameters on the same batches: once with
``flash_attention`` as the ``attention_fn`` of linen's ``MultiHeadDotProductAttention`` and once
with Flax's default attention. Sequences are packed: several documents (paragraphs of
``data/tiny_corpus.txt``) share a row, told apart by segment ids. flash_attention receives
them as ``q_segment_ids``/``kv_segment_ids`` with ``is_causal=True`` (no [L, L] mask exists);
the default attention receives the equivalent dense mask (causal AND same segment).

Both loss curves are printed side by side, written to ``<out>/tiny_lm_losses.json`` and
plotted to ``<out>/tiny_lm_losses.png``. The script exits with status 1 when the curves
disagree beyond float32 tolerance in the first steps or end at different losses.

    python examples/train_tiny_lm.py                      # -> ./flash_attention_results/train_tiny_lm/
    python examples/train_tiny_lm.py --update-reference   # rewrites examples/results/ (committed)
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import platform
import sys
import time
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import linen as nn
from tqdm.auto import tqdm

HERE = Path(__file__).resolve().parent
if str(HERE.parent) not in sys.path:  # run as a script from a checkout without installing
    sys.path.insert(0, str(HERE.parent))

from jax_impl.flash_attention import flash_attention  # noqa: E402

CORPUS = HERE / "data" / "tiny_corpus.txt"
PAD, BOS = 0, 1  # token ids; characters start at 2

# How the two curves are held to each other (float32 training, same init, same batches):
EARLY_STEPS = 10        # the first steps must agree to float32 rounding, amplified a little
EARLY_RTOL = 1e-5       # |flash - default| <= EARLY_RTOL * |default| for each of them
FINAL_WINDOW = 20       # mean loss over the last FINAL_WINDOW steps ...
FINAL_RTOL = 0.02       # ... must agree to 2%: fp32 rounding differences grow chaotically


@dataclasses.dataclass(frozen=True)
class Config:
    seq_len: int = 128
    batch_size: int = 16
    d_model: int = 64
    num_heads: int = 4
    num_layers: int = 2
    mlp_ratio: int = 4
    learning_rate: float = 3e-3
    warmup_steps: int = 20
    seed: int = 0


# --- data --------------------------------------------------------------------------------

def load_documents(path: Path = CORPUS) -> list[str]:
    """Paragraphs separated by blank lines are the documents."""
    text = path.read_text(encoding="utf-8")
    return [" ".join(p.split()) for p in text.split("\n\n") if p.strip()]


def build_vocab(documents: list[str]) -> list[str]:
    """Index -> character; ids 0 and 1 are PAD and BOS."""
    return ["<pad>", "<bos>"] + sorted(set("".join(documents)))


def encode(documents: list[str], vocab: list[str]) -> list[np.ndarray]:
    index = {c: i for i, c in enumerate(vocab)}
    return [np.array([BOS] + [index[c] for c in doc], np.int32) for doc in documents]


def pack_batches(encoded: list[np.ndarray], cfg: Config, steps: int) -> dict[str, np.ndarray]:
    """Packed rows [steps, B, L], as if cut from a stream of documents: each row starts with the
    tail of a random document (a random length shorter than the row), then whole documents from
    their start, the last one cut at the row end; segment ids 1, 2, ... per document in the row
    (0 on PAD, which only a row left with under 8 free positions gets). ``weights`` marks the
    positions whose target is the next character of the same document. Seeded."""
    rng = np.random.default_rng(cfg.seed)
    rows = steps * cfg.batch_size
    length = cfg.seq_len + 1  # inputs and shifted targets
    tokens = np.full((rows, length), PAD, np.int32)
    segments = np.zeros((rows, length), np.int32)
    for r in range(rows):
        pos, seg = 0, 1
        while pos < length - 8:  # leave a short tail as padding rather than a 1-char document
            doc = encoded[rng.integers(len(encoded))]
            start = 0 if seg > 1 else max(0, len(doc) - int(rng.integers(8, length - 8)))
            piece = doc[start:start + length - pos]
            tokens[r, pos:pos + len(piece)] = piece
            segments[r, pos:pos + len(piece)] = seg
            pos, seg = pos + len(piece), seg + 1
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    in_seg, out_seg = segments[:, :-1], segments[:, 1:]
    weights = ((in_seg == out_seg) & (in_seg > 0)).astype(np.float32)
    shape = (steps, cfg.batch_size, cfg.seq_len)
    return {"inputs": inputs.reshape(shape), "targets": targets.reshape(shape),
            "segment_ids": in_seg.reshape(shape), "weights": weights.reshape(shape)}


# --- model -------------------------------------------------------------------------------

def flash_attention_fn(segment_ids, implementation: str | None = None) -> Callable:
    """flash_attention as a linen attention_fn: causal, attending within a segment only.

    A functools.partial keeps flash_attention's signature, so linen passes it every Flax
    keyword (dropout_rate, deterministic, ...) and flash_attention checks them."""
    return functools.partial(flash_attention, is_causal=True, q_segment_ids=segment_ids,
                             kv_segment_ids=segment_ids, implementation=implementation)


def default_mask(segment_ids):
    """The dense mask for Flax's default attention: causal AND same segment; [B, 1, L, L]."""
    return nn.combine_masks(nn.make_causal_mask(segment_ids),
                            nn.make_attention_mask(segment_ids, segment_ids, jnp.equal))


class Block(nn.Module):
    cfg: Config
    attention_fn: Callable

    @nn.compact
    def __call__(self, x, mask):
        h = nn.LayerNorm(name="ln_attn")(x)
        h = nn.MultiHeadDotProductAttention(num_heads=self.cfg.num_heads, qkv_features=self.cfg.d_model,
                                            attention_fn=self.attention_fn, name="attn")(h, mask=mask)
        x = x + h
        h = nn.LayerNorm(name="ln_mlp")(x)
        h = nn.Dense(self.cfg.mlp_ratio * self.cfg.d_model, name="mlp_in")(h)
        h = nn.Dense(self.cfg.d_model, name="mlp_out")(nn.gelu(h))
        return x + h


class TinyLM(nn.Module):
    """Decoder-only transformer; ``attention`` is "flash" or "default"."""
    cfg: Config
    vocab_size: int
    attention: str = "flash"
    implementation: str | None = None

    @nn.compact
    def __call__(self, tokens, segment_ids):  # [B, L] each -> logits [B, L, vocab]
        if self.attention == "flash":
            attention_fn, mask = flash_attention_fn(segment_ids, self.implementation), None
        elif self.attention == "default":
            attention_fn, mask = nn.dot_product_attention, default_mask(segment_ids)
        else:
            raise ValueError(f"attention={self.attention!r} must be 'flash' or 'default'")
        embed = nn.Embed(self.vocab_size, self.cfg.d_model, name="embed")
        positions = self.param("positions", nn.initializers.normal(0.02),
                               (self.cfg.seq_len, self.cfg.d_model))
        x = embed(tokens) + positions[:tokens.shape[-1]]
        for i in range(self.cfg.num_layers):
            x = Block(self.cfg, attention_fn, name=f"block_{i}")(x, mask)
        return embed.attend(nn.LayerNorm(name="ln_final")(x))


# --- training ----------------------------------------------------------------------------

def make_optimizer(cfg: Config, steps: int):
    schedule = optax.warmup_cosine_decay_schedule(0.0, cfg.learning_rate, min(cfg.warmup_steps, steps),
                                                  max(steps, cfg.warmup_steps + 1))
    return optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, weight_decay=0.01))


def init_params(cfg: Config, vocab_size: int):
    model = TinyLM(cfg, vocab_size, attention="default")
    dummy = jnp.ones((1, cfg.seq_len), jnp.int32)
    return jax.jit(model.init)(jax.random.PRNGKey(cfg.seed), dummy, dummy)["params"]


def make_train_step(model: TinyLM, optimizer, on_trace: Callable[[], None] = lambda: None):
    """The jitted step; ``on_trace`` runs each time JAX traces it (so: compiles it)."""

    def loss_fn(params, batch):
        logits = model.apply({"params": params}, batch["inputs"], batch["segment_ids"])
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
        return jnp.sum(ce * batch["weights"]) / jnp.sum(batch["weights"])

    @jax.jit
    def train_step(params, opt_state, batch):
        on_trace()
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return train_step


def train(cfg: Config, vocab_size: int, params, batches: dict[str, np.ndarray], attention: str,
          implementation: str | None = None, progress: bool = True) -> dict[str, Any]:
    """Train from ``params`` on ``batches`` (one per step). Returns losses, seconds (after the
    first, compiling, step), traces (times the step was traced) and the jit cache size."""
    steps = batches["inputs"].shape[0]
    model = TinyLM(cfg, vocab_size, attention=attention, implementation=implementation)
    optimizer = make_optimizer(cfg, steps)
    traces = [0]
    train_step = make_train_step(model, optimizer, on_trace=lambda: traces.__setitem__(0, traces[0] + 1))
    opt_state = optimizer.init(params)
    losses = []
    start = None
    bar = tqdm(range(steps), desc=f"{attention:>7} attention", disable=not progress, leave=True)
    for step in bar:
        batch = {name: jnp.asarray(array[step]) for name, array in batches.items()}
        params, opt_state, loss = train_step(params, opt_state, batch)
        losses.append(float(loss))
        if step == 0:
            start = time.perf_counter()
        bar.set_postfix(loss=f"{losses[-1]:.4f}")
    seconds = time.perf_counter() - start
    cache_size = train_step._cache_size() if hasattr(train_step, "_cache_size") else None
    return {"losses": losses, "seconds_after_first_step": seconds, "traces": traces[0],
            "jit_cache_size": cache_size, "params": params}


def compare_curves(flash: list[float], default: list[float]) -> tuple[bool, list[str]]:
    """Early steps agree to float tolerance; the ends (mean of the last window) agree to 2%."""
    flash, default = np.asarray(flash), np.asarray(default)
    problems = []
    k = min(EARLY_STEPS, len(flash))
    early = np.abs(flash[:k] - default[:k]) / np.abs(default[:k])
    if not np.all(early <= EARLY_RTOL):
        bad = int(np.argmax(early > EARLY_RTOL))
        problems.append(f"step {bad}: relative difference {early[bad]:.2e} > {EARLY_RTOL:g} "
                        f"(flash {flash[bad]:.6f}, default {default[bad]:.6f})")
    w = min(FINAL_WINDOW, len(flash))
    end_f, end_d = flash[-w:].mean(), default[-w:].mean()
    if not abs(end_f - end_d) <= FINAL_RTOL * abs(end_d):
        problems.append(f"final losses (mean of last {w}) differ: flash {end_f:.4f}, "
                        f"default {end_d:.4f} (> {FINAL_RTOL:.0%})")
    if not np.all(np.isfinite(flash)) or not np.all(np.isfinite(default)):
        problems.append("a loss is not finite")
    return not problems, problems


def loss_table(flash: list[float], default: list[float], every: int) -> str:
    lines = [f"{'step':>6} {'flash':>10} {'default':>10} {'|diff|':>10}"]
    steps = sorted(set(range(0, len(flash), every)) | {len(flash) - 1})
    for s in steps:
        lines.append(f"{s:>6} {flash[s]:>10.5f} {default[s]:>10.5f} {abs(flash[s] - default[s]):>10.2e}")
    return "\n".join(lines)


def plot(flash: list[float], default: list[float], path: Path, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = np.arange(len(flash))
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6), sharex=True,
                                      gridspec_kw={"height_ratios": [3, 1]})
    top.plot(steps, default, label="Flax default attention", lw=2.5, alpha=0.6)
    top.plot(steps, flash, label="flash_attention", lw=1.0, ls="--")
    top.set_ylabel("training loss (nats/char)")
    top.set_title(title)
    top.legend()
    top.grid(alpha=0.3)
    diff = np.abs(np.asarray(flash) - np.asarray(default))
    floor = 1e-9
    bottom.semilogy(steps, np.maximum(diff, floor), ".", color="k", ms=3,
                    label=f"|flash - default| (identical: plotted at {floor:g})")
    bottom.semilogy(steps, np.finfo(np.float32).eps * np.abs(default), color="C3", lw=0.8,
                    label="float32 eps x loss")
    bottom.set_ylim(floor / 3, max(1e-5, diff.max() * 3))
    bottom.set_ylabel("|difference|")
    bottom.legend(fontsize=8, loc="upper left")
    bottom.set_xlabel("step")
    bottom.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


DEFAULT_OUT = Path("flash_attention_results") / "train_tiny_lm"  # under the current directory
REFERENCE_OUT = HERE / "results"                                   # the committed curves


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=300,
                        help="training steps for each of the two models (default and reference curves: 300)")
    parser.add_argument("--out", type=Path, default=None,
                        help=f"folder for tiny_lm_losses.json and .png (default ./{DEFAULT_OUT})")
    parser.add_argument("--update-reference", action="store_true",
                        help="write to examples/results/, the committed reference curves, instead of --out")
    parser.add_argument("--implementation", choices=["xla", "pallas_triton", "reference"], default=None,
                        help="flash_attention implementation (default: the automatic choice)")
    parser.add_argument("--print-every", type=int, default=25, help="print the two losses every N steps")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    args = parser.parse_args(argv)
    if args.update_reference and args.out is not None:
        parser.error("--update-reference writes examples/results/: it takes no --out")
    if args.steps < 1:
        parser.error(f"--steps {args.steps} must be at least 1")
    args.out = REFERENCE_OUT if args.update_reference else (args.out or DEFAULT_OUT)
    try:  # before training, not after it
        args.out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        parser.error(f"--out {str(args.out)!r} is not a writable folder: {e.strerror or type(e).__name__}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    cfg = Config()
    documents = load_documents()
    vocab = build_vocab(documents)
    batches = pack_batches(encode(documents, vocab), cfg, args.steps)
    params0 = init_params(cfg, len(vocab))
    n_params = sum(x.size for x in jax.tree.leaves(params0))
    print(f"{len(documents)} documents, {sum(map(len, documents))} characters, vocab {len(vocab)}, "
          f"{n_params} parameters, {args.steps} steps of {cfg.batch_size}x{cfg.seq_len} packed tokens "
          f"on {jax.default_backend()}")

    wall = time.perf_counter()
    runs = {name: train(cfg, len(vocab), params0, batches, name, args.implementation,
                        progress=not args.no_progress)
            for name in ("flash", "default")}
    wall = time.perf_counter() - wall
    flash, default = runs["flash"]["losses"], runs["default"]["losses"]
    ok, problems = compare_curves(flash, default)

    print(loss_table(flash, default, args.print_every))
    w = min(FINAL_WINDOW, len(flash))
    print(f"final loss (mean of last {w} steps): flash {np.mean(flash[-w:]):.4f}, "
          f"default {np.mean(default[-w:]):.4f}; max |diff| over the first {EARLY_STEPS} steps "
          f"{np.max(np.abs(np.subtract(flash, default)[:EARLY_STEPS])):.2e}")
    for name, run in runs.items():
        print(f"{name:>7}: {run['seconds_after_first_step']:.1f} s for steps 1..{args.steps - 1}, "
              f"traced {run['traces']}x")
    print(f"total {wall:.1f} s")

    record = {
        "model": "Flax linen decoder-only transformer, character level, packed sequences",
        "config": dataclasses.asdict(cfg), "steps": args.steps, "implementation": args.implementation,
        "vocab_size": len(vocab), "parameters": int(n_params),
        "versions": {"jax": jax.__version__, "python": platform.python_version()},
        "backend": jax.default_backend(),
        "tolerance": {"early_steps": EARLY_STEPS, "early_rtol": EARLY_RTOL,
                      "final_window": FINAL_WINDOW, "final_rtol": FINAL_RTOL},
        "agree": ok, "problems": problems,
        "final_loss": {"flash": float(np.mean(flash[-w:])), "default": float(np.mean(default[-w:]))},
        "seconds": {name: run["seconds_after_first_step"] for name, run in runs.items()} | {"total": wall},
        "losses": {"flash": flash, "default": default},
    }
    (args.out / "tiny_lm_losses.json").write_text(json.dumps(record, indent=1))
    plot(flash, default, args.out / "tiny_lm_losses.png",
         f"Tiny char LM (linen, packed, causal): flash_attention vs Flax default, {args.steps} steps")
    print(f"wrote {args.out / 'tiny_lm_losses.json'} and {args.out / 'tiny_lm_losses.png'}")
    if not ok:
        print("MISMATCH:\n  " + "\n  ".join(problems), file=sys.stderr)
        return 1
    print("flash_attention and Flax's default attention trained the same model to the same loss")
    return 0


if __name__ == "__main__":
    sys.exit(main())
