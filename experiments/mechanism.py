"""The mechanism test: bias and variance of off-policy GRPO gradients against how off-policy.

    python -m experiments.mechanism            # full size: writes results/mechanism.{jsonl,png,md}
    python -m experiments.mechanism --quick    # a few batches of barely warmed-up models (a test)

One warmed-up receiver (the size pair's `small` node) and a set of peers that form a dose of
off-policyness, every model built, warmed up (with the study's warm-up cache) and sampled by the
driver's own code (`ftis_kernels.grpo`):

  identical  the receiver itself, on the very same batches as on-policy (negative control)
  lora       the receiver plus a LoRA adapter trained by the driver for a few on-policy rounds
  stale      the receiver's recipe stopped early (fewer warm-up steps)
  expertise  the expertise pair's add-expert (a `small` model whose warm-up saw additions only)
  size       the size pair's `tiny` node
  hot        the receiver sampling at twice the study's temperature (positive control)

For each peer, batches of the peer's samples (fixed prompts, one group of G per prompt, the
peer's own group advantages: vertical collaboration) go through the receiver, and the receiver's
gradient of `ftis_loss` is taken for NoIS, F-VIS, TIS and F-TIS with the study's options (the size
config's C, g, eps, temperature). The target is the on-policy gradient on the same prompts: a
large-sample mean over batches of the receiver's own samples; a separate stream of on-policy
batches gives the reference variance.

The gradient is taken at the receiver's current weights with old_logprobs=None (the driver's one
update per batch): the PPO ratio is 1 with gradient d log pi, so the clip never acts
(clip_frac = 0) and IS acts only through w = pi_theta / pi_gen, the correction for sampling from
pi_gen instead of pi_theta. That correction is what the paper's bias/variance argument is about,
and it is what is measured here: the bias of E[g] against the on-policy gradient, and the
variance of a batch gradient.

Bias and variance are estimated from block (batch-means) statistics and the Gram matrix of the
block sums, so no per-batch gradient is kept: cosine and relative error ||E[g] - g*|| / ||g*|| are
the values at the population means with the plug-in's noise bias removed (basic bootstrap over
blocks of the mode, the target and the reference), with basic-bootstrap 95% intervals; the
variance is the trace of the covariance of the batch gradients, relative to on-policy's, with a
percentile interval.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import subprocess
import sys
import time
import warnings
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch

from experiments.stats import basic_bootstrap, bootstrap_interval, percentile_interval
from ftis_kernels import ftis_loss
from ftis_kernels.grpo import provenance
from ftis_kernels.grpo.config import RunConfig, build_config
from ftis_kernels.grpo.exchange import Sample
from ftis_kernels.grpo.models import apply_lora, build_model
from ftis_kernels.grpo.node import Node
from ftis_kernels.grpo.rollout import vertical_advantages
from ftis_kernels.grpo.tokenizer import build_tokenizer
from ftis_kernels.grpo.train import build_batch, completion_logits, grpo_update
from ftis_kernels.options import FTISOptions

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
CONFIGS = HERE / "configs"
log = logging.getLogger("experiments.mechanism")

RECEIVER = ("size", 1)  # (config, node): the size pair's `small`
MODES = ("nois", "f-vis", "tis", "f-tis")
ON_POLICY = "on-policy"
# The fixed prompts live far above any index a study run reaches and below the warm-up's.
PROMPT_BASE = 1 << 36
# Seeds of the sampling streams: the target, the on-policy reference, then one per peer.
TARGET_SEED, REFERENCE_SEED, PEER_SEED = 101, 202, 303
BOOTSTRAP_SEED = 0


@dataclass(frozen=True)
class Peer:
    """A peer that sends the receiver its samples: node `node` of `configs/<config>.yaml`, with
    `sets` (`--set` assignments) applied; LoRA-trained for `lora_rounds` on-policy rounds."""

    name: str
    what: str
    config: str
    node: int
    sets: tuple[str, ...] = ()
    lora_rounds: int = 0


@dataclass(frozen=True)
class Scale:
    batches: int  # batches of each peer's samples (and of the on-policy reference)
    target_batches: int  # batches of the receiver's own samples behind the target g*
    blocks: int  # blocks of consecutive batches (batch means) for the intervals
    prompts: int  # the fixed prompts, cycled through `prompts_per_batch` at a time
    prompts_per_batch: int
    lora_rounds: int
    stale_warmup: int  # warm-up steps of the stale peer (the receiver's recipe has more)
    sets: tuple[str, ...] = ()  # applied to every config (the quick scale's short warm-ups)
    bootstrap: int = 2000


FULL = Scale(
    batches=100,
    target_batches=300,
    blocks=20,
    prompts=16,
    prompts_per_batch=4,
    lora_rounds=30,
    stale_warmup=100,
)
# Warm-ups just long enough for some rewards (and so non-zero gradients), a few batches.
QUICK = Scale(
    batches=4,
    target_batches=8,
    blocks=4,
    prompts=8,
    prompts_per_batch=4,
    lora_rounds=1,
    stale_warmup=20,
    # The receiver (size.yaml's node 1) long enough for a few rewards; the other peers short.
    sets=("nodes.0.warmup_steps=20", "nodes.1.warmup_steps=80"),
    bootstrap=400,
)
HOT_FACTOR = 2.0  # the hot peer samples at this multiple of the study's temperature


def peers(scale: Scale, temperature: float) -> list[Peer]:
    """The dose set, in the order it runs (roughly increasing off-policyness)."""
    return [
        Peer("identical", "the receiver itself, on the on-policy batches", *RECEIVER),
        Peer(
            "lora",
            f"the receiver + a LoRA adapter (r=8) trained {scale.lora_rounds} on-policy rounds",
            *RECEIVER,
            lora_rounds=scale.lora_rounds,
        ),
        Peer(
            "stale",
            f"the receiver's recipe stopped at {scale.stale_warmup} warm-up steps",
            *RECEIVER,
            sets=(f"nodes.{RECEIVER[1]}.warmup_steps={scale.stale_warmup}",),
        ),
        Peer("expertise", "add-expert: a small model warmed up on additions only", "expertise", 0),
        Peer("size", "tiny: the size pair's smaller model", "size", 0),
        Peer(
            "hot",
            f"the receiver sampling at temperature {HOT_FACTOR * temperature:g}",
            *RECEIVER,
            sets=(f"temperature={HOT_FACTOR * temperature!r}",),
        ),
    ]


# -- models, through the driver ----------------------------------------------------------------
def node_config(config: str, scale: Scale, cache: Path, sets: Sequence[str] = ()) -> RunConfig:
    return build_config(
        config_file=str(CONFIGS / f"{config}.yaml"),
        overrides={"warmup_cache": str(cache)},
        sets=tuple(scale.sets) + tuple(sets),
    )


def load_node(cfg: RunConfig, rank: int) -> Node:
    """Node `rank` of `cfg`, built and warmed up (or loaded from the warm-up cache) as the driver
    does, without the swarm's agreement checks (one process holds every model here)."""
    node = Node(cfg, rank, len(cfg.nodes), torch.device("cpu"))
    node.tokenizer = build_tokenizer(node.problems.arith.vocabulary_text())
    node.model = build_model(node.spec.arch, node.tokenizer, cfg.init_seed(rank))
    node.warm_up()
    return node


def train_lora(node: Node, rounds: int, lr: float, seed: int) -> None:
    """Wrap the node's model in a LoRA adapter and train it `rounds` on-policy GRPO rounds with the
    driver's rollout and update (isolated training: the "grpo" options)."""
    spec, cfg = node.spec, node.cfg
    node.model = apply_lora(node.model, spec.lora_r, spec.lora_alpha, seed=seed)
    params = [p for p in node.model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    options = FTISOptions.preset("grpo", temperature=cfg.temperature)
    for round_ in range(rounds):
        grpo_update(
            node.model,
            optimizer,
            node.rollout(round_),
            node.prompt_tokens,
            options,
            micro_batch=cfg.micro_batch,
            pad_id=node.tokenizer.pad_token_id,
            grad_clip=cfg.grad_clip,
            device=node.device,
        )


# -- batches and their gradients -----------------------------------------------------------------
def peer_batch(source: Node, prompts: list[int], group: int) -> list[Sample]:
    """One group of `group` samples per prompt from `source` (its own sampler), with the source's
    rewards and group advantages, as a peer sends them in vertical collaboration."""
    ids = [p for p in prompts for _ in range(group)]
    done = source.generate(ids, greedy=False, max_new_tokens=source.cfg.max_new_tokens)
    rewards = torch.tensor([r for _, _, r in done], dtype=torch.float32).view(len(prompts), group)
    advantages = vertical_advantages(rewards).flatten().tolist()
    return [
        Sample(pid, source.rank, tok, lp, rew, adv)
        for pid, (tok, lp, rew), adv in zip(ids, done, advantages)
    ]


def flat_grad(loss: torch.Tensor, params: list[torch.Tensor], retain: bool) -> torch.Tensor:
    grads = torch.autograd.grad(loss, params, retain_graph=retain, allow_unused=True)
    return torch.cat(
        [(torch.zeros_like(p) if g is None else g).reshape(-1) for p, g in zip(params, grads)]
    )


@dataclass
class BatchGradients:
    """The receiver's gradients of one batch under each mode, with what the batch carried."""

    grads: dict[str, torch.Tensor]  # mode -> (D,) float32
    kl_sample: list[float]  # per sample: sum over its tokens of k3(log pi_gen - log pi_theta)
    tokens: int
    rewards: list[float]
    advantages: list[float]
    filter_changed: dict[str, list[bool]]  # mode -> per sample: filtered and advantage != 0
    metrics: dict[str, dict[str, float]]  # mode -> is_weight_mean, is_truncated_frac, clip_frac


def batch_gradients(
    receiver: Node, params: list[torch.Tensor], samples: list[Sample], modes: dict[str, Any]
) -> BatchGradients:
    """The receiver's gradient of `ftis_loss` on `samples` under every mode (mode -> options),
    from one forward pass (the driver's batch and logits)."""
    receiver.model.train()
    batch = build_batch(samples, receiver.prompt_tokens, receiver.tokenizer.pad_token_id, "cpu")
    logits = completion_logits(receiver.model, batch)
    grads, changed, metrics = {}, {}, {}
    advantages = batch["advantages"]
    for i, (mode, options) in enumerate(modes.items()):
        loss, m = ftis_loss(
            logits,
            batch["tokens"],
            batch["gen_logprobs"],
            advantages,
            batch["mask"],
            **options.as_kwargs(),
        )
        grads[mode] = flat_grad(loss, params, retain=i < len(modes) - 1)
        changed[mode] = (m["filtered"] & (advantages != 0)).tolist()
        metrics[mode] = {
            k: float(m[k]) for k in ("is_weight_mean", "is_truncated_frac", "clip_frac")
        }
        logp = m["logp"]
    d = (batch["gen_logprobs"] - logp).double()
    k3 = ((-d).exp() - 1 + d) * batch["mask"]
    return BatchGradients(
        grads,
        k3.sum(dim=1).tolist(),
        int(batch["mask"].sum()),
        [s.reward for s in samples],
        advantages.tolist(),
        changed,
        metrics,
    )


# -- statistics ---------------------------------------------------------------------------------
class BlockStats:
    """Batch gradients (D,) summed into `blocks` blocks of `per_block` consecutive batches: block
    sums (blocks, D) float32 and each block's sum of squared norms (blocks,) float64."""

    def __init__(self, dim: int, batches: int, blocks: int, source: str):
        if batches % blocks:
            raise ValueError(f"batches: expected a multiple of blocks={blocks}, got {batches}")
        self.per_block, self.blocks, self.source = batches // blocks, blocks, source
        self.sums = torch.zeros(blocks, dim, dtype=torch.float32)
        self.sq = np.zeros(blocks)
        self.count = 0

    def add(self, g: torch.Tensor) -> None:
        k = self.count // self.per_block
        self.sums[k] += g
        self.sq[k] += float(g.double().square().sum())
        self.count += 1

    @property
    def batches(self) -> int:
        return self.per_block * self.blocks

    def mean(self) -> torch.Tensor:
        return self.sums.double().sum(dim=0) / self.batches


def gram(stats: Sequence[BlockStats], chunk: int = 1 << 15) -> np.ndarray:
    """The float64 Gram matrix of every block sum of `stats`, stacked in order."""
    x = torch.cat([s.sums for s in stats])
    out = torch.zeros(x.shape[0], x.shape[0], dtype=torch.float64)
    for start in range(0, x.shape[1], chunk):
        part = x[:, start : start + chunk].double()
        out += part @ part.T
    return out.numpy()


def compare(
    target: BlockStats,
    reference: BlockStats,
    modes: dict[str, BlockStats],
    *,
    n_boot: int,
    seed: int = BOOTSTRAP_SEED,
) -> dict[str, dict[str, Any]]:
    """Bias and variance of each mode's batch gradient against the target g* (the target's mean)
    and the reference's variance.

    Stats that share a `source` were computed from the same batches and are resampled together
    (blocks drawn with the same counts). Per mode: cos and rel_err are the population values
    cos(E[g], E[g*]) and ||E[g] - E[g*]|| / ||E[g*]|| estimated as 2 * plug-in - bootstrap mean
    (the plug-in's noise bias removed), with basic-bootstrap 95% intervals (`*_ci`); `*_raw` are
    the plug-ins; rel_err_noise is the relative error an unbiased estimator with these variances
    shows on average; var is the trace of the batch gradients' covariance, var_ratio var over the
    reference's, with percentile intervals.
    """
    names = ["target", "reference", *modes]
    stats = [target, reference, *modes.values()]
    g = gram(stats)
    index, start = {}, 0
    for name, s in zip(names, stats):
        index[name] = np.arange(start, start + s.blocks)
        start += s.blocks
    rng = np.random.default_rng(seed)
    counts: dict[str, np.ndarray] = {}
    for s in stats:  # one draw of block counts per source, shared by its stats
        if s.source not in counts:
            ones = np.ones((1, s.blocks))
            draws = rng.multinomial(s.blocks, np.full(s.blocks, 1 / s.blocks), size=n_boot)
            counts[s.source] = np.concatenate([ones, draws.astype(float)])

    def dot(a: str, b: str) -> np.ndarray:
        """<mean of a, mean of b> for the full data (row 0) and each bootstrap draw."""
        sa, sb = stats[names.index(a)], stats[names.index(b)]
        ca, cb = counts[sa.source], counts[sb.source]
        block = g[np.ix_(index[a], index[b])]
        return np.einsum("bk,kl,bl->b", ca, block, cb) / (sa.batches * sb.batches)

    def trace(name: str) -> np.ndarray:
        s = stats[names.index(name)]
        n = s.batches
        return (counts[s.source] @ s.sq - n * dot(name, name)) / (n - 1)

    with np.errstate(divide="ignore", invalid="ignore"):  # a zero target: NaN rows
        tt, var_t = dot("target", "target"), trace("target")
        var_r = trace("reference")
        out = {}
        for name in modes:
            mm, mt = dot(name, name), dot(name, "target")
            cos = mt / np.sqrt(np.maximum(mm * tt, 1e-300))
            rel2 = np.maximum(mm - 2 * mt + tt, 0) / tt
            var_m = trace(name)
            ratio = var_m / var_r
            n, nt = modes[name].batches, target.batches
            row = dict(
                cos=basic_bootstrap(cos, upper=1.0),
                rel_err=tuple(math.sqrt(max(v, 0.0)) for v in basic_bootstrap(rel2)),
                cos_raw=float(cos[0]),
                rel_err_raw=math.sqrt(rel2[0]),
                rel_err_noise=math.sqrt((var_m[0] / n + var_t[0] / nt) / tt[0]),
                var=float(var_m[0]),
                var_ratio=(float(ratio[0]), *percentile_interval(ratio[1:])),
                grad_norm=math.sqrt(mm[0]),
            )
            row["cos"], row["cos_ci"] = row["cos"][0], list(row["cos"][1:])
            row["rel_err"], row["rel_err_ci"] = row["rel_err"][0], list(row["rel_err"][1:])
            row["var_ratio"], row["var_ratio_ci"] = row["var_ratio"][0], list(row["var_ratio"][1:])
            out[name] = row
        out["_target"] = dict(
            grad_norm=math.sqrt(tt[0]), var=float(var_t[0]), reference_var=float(var_r[0])
        )
    return out


# -- the run -----------------------------------------------------------------------------------
@dataclass
class Stream:
    """What one stream of batches accumulated: gradients per mode and per-sample records."""

    stats: dict[str, BlockStats]
    kl_batch: list[float] = field(default_factory=list)  # per batch: mean per-sample KL
    kl_token: list[float] = field(default_factory=list)  # per batch: KL per token
    rewards: list[float] = field(default_factory=list)
    zero_advantage: list[float] = field(default_factory=list)
    changed: dict[str, list[float]] = field(default_factory=dict)  # mode -> per batch share
    changed_negative: dict[str, list[int]] = field(default_factory=dict)  # mode -> [changed, neg]
    metrics: dict[str, list[dict[str, float]]] = field(default_factory=dict)
    same_samples_diff: dict[str, float] = field(default_factory=dict)  # mode -> max rel diff

    def record(self, b: BatchGradients) -> None:
        n = len(b.kl_sample)
        self.kl_batch.append(sum(b.kl_sample) / n)
        self.kl_token.append(sum(b.kl_sample) / max(b.tokens, 1))
        self.rewards.append(sum(b.rewards) / n)
        self.zero_advantage.append(sum(a == 0 for a in b.advantages) / n)
        for mode, flags in b.filter_changed.items():
            self.changed.setdefault(mode, []).append(sum(flags) / n)
            neg = self.changed_negative.setdefault(mode, [0, 0])
            neg[0] += sum(flags)
            neg[1] += sum(a < 0 for a in b.advantages)
            self.metrics.setdefault(mode, []).append(b.metrics[mode])


def run_stream(
    source: Node,
    receiver: Node,
    params: list[torch.Tensor],
    prompts: list[int],
    scale: Scale,
    modes: dict[str, Any],
    stats: dict[str, BlockStats],
    seed: int,
    compare_to: Optional[str] = None,
) -> Stream:
    """Batches of `source`'s samples (as many as the stats hold) through the receiver; each mode's
    gradient goes to stats[mode]. With `compare_to`, also the largest relative difference per
    batch between each mode's gradient and that mode's (on the same samples)."""
    source.sampler = torch.Generator().manual_seed(seed)
    stream = Stream(stats)
    k = scale.prompts_per_batch
    n = next(iter(stats.values())).batches
    for b in range(n):
        first = (b * k) % len(prompts)
        samples = peer_batch(source, prompts[first : first + k], source.cfg.group_size)
        out = batch_gradients(receiver, params, samples, modes)
        for mode, g in out.grads.items():
            stats[mode].add(g)
            if compare_to is not None and mode != compare_to:
                ref = out.grads[compare_to]
                diff = float((g - ref).norm() / ref.norm().clamp_min(1e-30))
                stream.same_samples_diff[mode] = max(stream.same_samples_diff.get(mode, 0), diff)
        stream.record(out)
        if (b + 1) % max(1, n // 4) == 0:
            log.info("%s: batch %d", source.spec.name, b + 1)
    return stream


def environment() -> dict[str, Any]:
    """What a result depends on besides the code: the driver's record
    (`provenance.environment`: versions, CPU, threads, commit), and the date."""
    return dict(
        provenance.environment(code=("ftis_kernels", "experiments")),
        date=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    )


def stream_row(stream: Stream, mode: str) -> dict[str, Any]:
    """The per-sample figures of a stream under `mode`."""
    kl_ci = bootstrap_interval(stream.kl_batch, resamples=1000, seed=BOOTSTRAP_SEED)
    kl, kl_lo, kl_hi = kl_ci.mean, kl_ci.lo, kl_ci.hi
    changed, neg = stream.changed[mode], stream.changed_negative[mode]
    metrics = stream.metrics[mode]
    return dict(
        kl_sample=kl,
        kl_sample_ci=[kl_lo, kl_hi],
        kl_token=float(np.mean(stream.kl_token)),
        reward=float(np.mean(stream.rewards)),
        zero_advantage_frac=float(np.mean(stream.zero_advantage)),
        filter_changed_frac=float(np.mean(changed)),
        filter_changed_of_negative=neg[0] / max(neg[1], 1),
        **{k: float(np.mean([m[k] for m in metrics])) for k in metrics[0]},
    )


PARTS = ("target", "reference")  # then one per peer but the identical one (reference's batches)


def part_names(scale: Scale) -> list[str]:
    return [*PARTS, *(p.name for p in peers(scale, 1.0) if p.name != "identical")]


@dataclass
class Setup:
    """The receiver, its parameters, the loss options per mode and the fixed prompts."""

    cfg: RunConfig
    receiver: Node
    params: list[torch.Tensor]
    modes: dict[str, FTISOptions]
    on_policy: dict[str, FTISOptions]
    prompts: list[int]


def setup(scale: Scale, cache: Path) -> Setup:
    rcfg = node_config(RECEIVER[0], scale, cache)
    receiver = load_node(rcfg, RECEIVER[1])
    params = [p for p in receiver.model.parameters() if p.requires_grad]
    # The study's loss options (C, g, eps, temperature...) of the receiver's config, per mode.
    loss = {m: node_config(RECEIVER[0], scale, cache, (f"loss={m}",)) for m in (ON_POLICY, *MODES)}
    return Setup(
        rcfg,
        receiver,
        params,
        {m: loss[m].ftis_options() for m in MODES},
        {ON_POLICY: loss[ON_POLICY].ftis_options()},
        receiver.problems.train_ids(range(PROMPT_BASE, PROMPT_BASE + scale.prompts)),
    )


def run_part(name: str, scale: Scale, cache: Path, work: Path) -> Path:
    """One stream of the test (the target, the on-policy reference with the identical peer's
    modes, or a peer), saved to `work/<name>.pt` with the scale it ran at."""
    t0 = time.process_time()
    s = setup(scale, cache)
    dim = sum(p.numel() for p in s.params)

    def new(names: Sequence[str], batches: int, source: str) -> dict[str, BlockStats]:
        return {n: BlockStats(dim, batches, scale.blocks, source) for n in names}

    if name == "target":
        stats = new([ON_POLICY], scale.target_batches, "target")
        stream = run_stream(
            s.receiver, s.receiver, s.params, s.prompts, scale, s.on_policy, stats, TARGET_SEED
        )
    elif name == "reference":
        stats = new([ON_POLICY, *MODES], scale.batches, "reference")
        stream = run_stream(
            s.receiver,
            s.receiver,
            s.params,
            s.prompts,
            scale,
            {**s.on_policy, **s.modes},
            stats,
            REFERENCE_SEED,
            compare_to=ON_POLICY,
        )
    else:
        order = [p.name for p in peers(scale, s.cfg.temperature)]
        peer = peers(scale, s.cfg.temperature)[order.index(name)]
        cfg = node_config(peer.config, scale, cache, peer.sets)
        source = load_node(cfg, peer.node)
        if peer.lora_rounds:
            lora_lr = node_config("lora", scale, cache).node(1).lr
            train_lora(source, peer.lora_rounds, lora_lr, seed=cfg.init_seed(peer.node))
        stats = new(MODES, scale.batches, peer.name)
        seed = PEER_SEED + order.index(name)
        stream = run_stream(source, s.receiver, s.params, s.prompts, scale, s.modes, stats, seed)
    path = work / f"{name}.pt"
    work.mkdir(parents=True, exist_ok=True)
    state = dict(
        scale=repr(scale),
        cpu_seconds=time.process_time() - t0,
        stats={m: vars(st) for m, st in stats.items()},
        stream={k: v for k, v in vars(stream).items() if k != "stats"},
    )
    torch.save(state, path.with_suffix(".tmp"))
    path.with_suffix(".tmp").replace(path)
    return path


def load_part(path: Path, scale: Scale) -> Optional[tuple[dict[str, BlockStats], Stream, float]]:
    """A saved part of this scale: (stats per mode, the stream, its CPU seconds), else None."""
    if not path.exists():
        return None
    state = torch.load(path, weights_only=False)
    if state["scale"] != repr(scale):
        return None
    stats = {}
    for mode, fields_ in state["stats"].items():
        st = BlockStats.__new__(BlockStats)
        vars(st).update(fields_)
        stats[mode] = st
    return stats, Stream(stats, **state["stream"]), state["cpu_seconds"]


def run(
    scale: Scale,
    cache: Path,
    work: Path,
    jobs: int,
    threads: int,
    flags: Sequence[str] = (),
    partial: bool = False,
) -> list[dict[str, Any]]:
    """Every row of the test: the on-policy reference, then each peer x mode. The parts that
    `work` does not hold yet run first, `jobs` at a time (each its own process, `threads` torch
    threads; in this process when jobs is 1). With `partial`, nothing runs: the rows of the peers
    whose parts are done (the target and the reference must be), the others named in
    `missing_parts`."""
    torch.set_num_threads(threads)
    t_start = time.time()
    todo = [n for n in part_names(scale) if load_part(work / f"{n}.pt", scale) is None]
    missing = todo if partial else []
    if partial and {"target", "reference"} & set(todo):
        raise SystemExit(f"--partial: the target and the reference must be done; missing {todo}")
    todo = [] if partial else todo
    if todo:
        log.info("running %s (%d at a time); done parts are kept in %s", todo, jobs, work)
    if jobs == 1:
        for name in todo:
            run_part(name, scale, cache, work)
    else:
        with ThreadPoolExecutor(jobs) as pool:
            for name in pool.map(lambda n: _run_part_process(n, work, cache, threads, flags), todo):
                log.info("part %s done", name)
    parts = {n: load_part(work / f"{n}.pt", scale) for n in part_names(scale) if n not in missing}
    s = setup(scale, cache)
    target, _, _ = parts["target"]
    reference, ref_stream, _ = parts["reference"]
    env = environment()
    common = dict(
        receiver=f"{RECEIVER[0]}.yaml node {RECEIVER[1]} ({s.receiver.spec.name})",
        prompts=scale.prompts,
        group_size=s.cfg.group_size,
        batch_samples=scale.prompts_per_batch * s.cfg.group_size,
        batches=scale.batches,
        target_batches=scale.target_batches,
        blocks=scale.blocks,
        params=sum(p.numel() for p in s.params),
        cpu_seconds_parts=sum(cpu for _, _, cpu in parts.values()),
        missing_parts=missing,
        env=env,
    )
    result = compare(
        target[ON_POLICY],
        reference[ON_POLICY],
        {ON_POLICY: reference[ON_POLICY]},
        n_boot=scale.bootstrap,
    )
    rows = [
        dict(
            peer=ON_POLICY,
            what="the receiver's own samples (fresh batches): the reference",
            mode=ON_POLICY,
            options=_options_row(s.on_policy[ON_POLICY]),
            **stream_row(ref_stream, ON_POLICY),
            **result[ON_POLICY],
            target=result["_target"],
            **common,
        )
    ]
    for peer in peers(scale, s.cfg.temperature):
        if peer.name in missing:
            continue
        if peer.name == "identical":
            stream, stats = ref_stream, {m: reference[m] for m in MODES}
        else:
            stats, stream, _ = parts[peer.name]
        result = compare(target[ON_POLICY], reference[ON_POLICY], stats, n_boot=scale.bootstrap)
        for mode in MODES:
            row = dict(
                peer=peer.name,
                what=peer.what,
                mode=mode,
                options=_options_row(s.modes[mode]),
                **stream_row(stream, mode),
                **result[mode],
                **common,
            )
            if peer.name == "identical":
                row["same_samples_max_rel_diff"] = ref_stream.same_samples_diff[mode]
            rows.append(row)
    for row in rows:
        row["seconds_total"] = time.time() - t_start
    return rows


def _run_part_process(name: str, work: Path, cache: Path, threads: int, flags) -> str:
    """`run_part` in a fresh process (its log in work/<name>.log); RuntimeError if it fails."""
    work.mkdir(parents=True, exist_ok=True)
    argv = [sys.executable, "-m", "experiments.mechanism", *flags, "--part", name]
    argv += ["--work", str(work), "--cache", str(cache), "--threads", str(threads)]
    with open(work / f"{name}.log", "w") as out:
        rc = subprocess.run(argv, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT).returncode
    if rc != 0:
        raise RuntimeError(f"part {name} failed (exit {rc}); see {work / f'{name}.log'}")
    return name


OPTION_KEYS = ("is_mode", "filter", "is_cap", "kl_threshold", "kl_estimator", "kl_reduction")
OPTION_KEYS += ("epsilon", "loss_type", "temperature")


def _options_row(options: FTISOptions) -> dict[str, Any]:
    return {k: getattr(options, k) for k in OPTION_KEYS}


# -- outputs ------------------------------------------------------------------------------------
MODE_STYLE = {  # label, colour, marker, line style: every curve tells itself apart in grey too
    "nois": ("NoIS", "#d62728", "o", "-"),
    "f-vis": ("F-VIS", "#9467bd", "s", "--"),
    "tis": ("TIS", "#1f77b4", "^", "-."),
    "f-tis": ("F-TIS", "#2ca02c", "D", ":"),
}


def write_jsonl(rows: list[dict[str, Any]], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in rows))


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    """Bias (cosine, relative error) and variance against received KL, one marker per mode, 95%
    intervals as error bars; the on-policy reference as a band."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ref = next(r for r in rows if r["peer"] == ON_POLICY)
    peer_rows = [r for r in rows if r["peer"] != ON_POLICY]
    kls = sorted({r["kl_sample"] for r in peer_rows})
    span = math.log10(max(kls[-1], 1.0) + 1)
    panels = (
        ("cos", "cos_ci", "cosine to the on-policy gradient", "on-policy (fresh batches)"),
        ("rel_err", "rel_err_ci", "relative error ||E[g] - g*|| / ||g*||", "on-policy (fresh)"),
        ("var_ratio", "var_ratio_ci", "variance of a batch gradient / on-policy's", None),
    )
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.6))
    for ax, (key, ci, ylabel, ref_label) in zip(axes, panels):
        for j, (mode, (label, colour, marker, style)) in enumerate(MODE_STYLE.items()):
            sel = sorted((r for r in peer_rows if r["mode"] == mode), key=lambda r: r["kl_sample"])
            # log1p(KL) spreads the doses; each mode is nudged sideways so bars do not overlap.
            x = [math.log10(r["kl_sample"] + 1) + (j - 1.5) * 0.012 * span for r in sel]
            y = [r[key] for r in sel]
            err = [[r[key] - r[ci][0] for r in sel], [r[ci][1] - r[key] for r in sel]]
            ax.errorbar(
                x,
                y,
                yerr=np.maximum(err, 0),
                label=label,
                color=colour,
                marker=marker,
                linestyle=style,
                capsize=3,
                markersize=6,
                linewidth=1.3,
            )
        if key == "var_ratio":
            ax.axhline(1.0, color="0.4", linewidth=1, label="on-policy")
            ax.set_yscale("log")
        else:
            lo, hi = ref[ci]
            ax.axhspan(lo, hi, color="0.85", label=f"{ref_label}, 95% interval")
            ax.axhline(ref[key], color="0.4", linewidth=1)
        values = [v for v in (0, 1, 3, 10, 30, 100, 300, 1000) if v <= 2 * kls[-1] + 1]
        ax.set_xticks([math.log10(v + 1) for v in values])
        ax.set_xticklabels([f"{v:g}" for v in values])
        for peer, kl in {(r["peer"], r["kl_sample"]) for r in peer_rows}:
            ax.annotate(
                peer,
                (math.log10(kl + 1), 0.01),
                xycoords=("data", "axes fraction"),
                rotation=90,
                fontsize=8,
                color="0.3",
                va="bottom",
                ha="right",
            )
        ax.set_xlabel("received KL per sample (k3, summed over the completion)")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
    handles, labels = axes[1].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(labels), fontsize=9)
    n = ref["batches"]
    fig.suptitle(
        f"Receiver's gradient on peers' samples against the on-policy gradient g* "
        f"({n} batches of {ref['batch_samples']} samples per peer, g* from "
        f"{ref['target_batches']}; 95% intervals)",
        fontsize=10,
    )
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _ci(value: float, ci: Sequence[float], digits: int = 3) -> str:
    return f"{value:.{digits}f} [{ci[0]:.{digits}f}, {ci[1]:.{digits}f}]"


def markdown(rows: list[dict[str, Any]], command: str) -> str:
    """The README's section on the mechanism test: what was measured, the table, what it shows."""
    ref = next(r for r in rows if r["peer"] == ON_POLICY)
    opts = ref["options"]
    f_tis = next(r for r in rows if r["mode"] == "f-tis")["options"]
    env = ref["env"]
    lines = [
        "### The mechanism: bias and variance of the off-policy gradient",
        "",
        f"`{command}`: {ref['cpu_seconds_parts'] / 60:.1f} CPU-minutes over its parts, one "
        f"torch thread each ({env['cpu']}; torch {env['torch']}, triton {env['triton']}, numpy "
        f"{env['numpy']}; commit {env['commit'][:10]}). Rows: `results/mechanism.jsonl`; "
        "figure: `results/mechanism.png`.",
        "",
        f"The receiver is {ref['receiver']}, warmed up as in the study. Each peer sends "
        f"{ref['batches']} batches of {ref['batch_samples']} samples ({ref['batch_samples'] // ref['group_size']} "  # noqa: E501
        f"of {ref['prompts']} fixed prompts x G = {ref['group_size']}, the peer's own rewards and "
        "group advantages); the receiver takes its gradient of `ftis_loss` on each batch under "
        f"NoIS, F-VIS, TIS and F-TIS with the study's options (C = {f_tis['is_cap']:g}, "
        f"g = {f_tis['kl_threshold']:g} ({f_tis['kl_estimator']}, {f_tis['kl_reduction']}), "
        f"eps = {opts['epsilon']:g}, temperature {opts['temperature']:g}, `{opts['loss_type']}`). "
        f"The target g* is the on-policy gradient on the same prompts, the mean over "
        f"{ref['target_batches']} batches of the receiver's own samples; another "
        f"{ref['batches']} on-policy batches give the reference row and the reference variance.",
        "",
        "With one update per batch (the driver's `old_logprobs=None`) the PPO ratio is 1: the "
        "clip never acts (clip_frac 0 in every row) and IS acts only through w = "
        "pi_theta / pi_gen, the correction for having sampled from the peer. That is the "
        "quantity the paper's argument is about, and what is measured: the bias of the expected "
        "gradient E[g] against g* (cosine, and the relative error ||E[g] - g*|| / ||g*||, both "
        "with the noise of finite batches removed: 0 and 1 mean no bias) and the variance of one "
        "batch's gradient (trace of the covariance) relative to on-policy's. Intervals are 95%, "
        f"bootstrapped over {ref['blocks']} blocks of consecutive batches of each stream "
        "(the peer's, the target's, the reference's). 'Noise' is the relative error an unbiased "
        "gradient with the row's variance would show before the correction. 'Changed' is the "
        "share of samples whose advantage the filter set to 0 (of all samples, and of the "
        "negative-advantage ones).",
        "",
        "| peer | KL / sample [95%] | KL / token | reward | mode | cosine [95%] "
        "| rel. error [95%] | noise | variance / on-policy [95%] | changed (of negative) "
        "| IS weight | truncated |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    previous = None
    for r in rows:
        first = r["peer"] != previous
        previous = r["peer"]
        peer_cols = (
            [
                f"**{r['peer']}**: {r['what']}",
                _ci(r["kl_sample"], r["kl_sample_ci"], 2),
                f"{r['kl_token']:.3f}",
                f"{r['reward']:.2f}",
            ]
            if first
            else ["", "", "", ""]
        )
        label = MODE_STYLE[r["mode"]][0] if r["mode"] in MODE_STYLE else r["mode"]
        cols = peer_cols + [
            label,
            _ci(r["cos"], r["cos_ci"]),
            _ci(r["rel_err"], r["rel_err_ci"]),
            f"{r['rel_err_noise']:.3f}",
            _ci(r["var_ratio"], r["var_ratio_ci"], 2),
            f"{r['filter_changed_frac']:.3f} ({r['filter_changed_of_negative']:.3f})",
            f"{r['is_weight_mean']:.3f}",
            f"{r['is_truncated_frac']:.3f}",
        ]
        lines.append("| " + " | ".join(cols) + " |")
    if ref.get("missing_parts"):
        lines += [
            "",
            f"Not measured in this run (their parts had not finished): "
            f"{', '.join(ref['missing_parts'])}.",
        ]
    lines += ["", "![mechanism](mechanism.png)", "", *findings(rows)]  # beside the .md
    return "\n".join(lines) + "\n"


def findings(rows: list[dict[str, Any]]) -> list[str]:
    """Plain-words statements that follow from the rows by fixed rules: a mode is *biased* when its
    relative error's 95% interval excludes 0 (the rule the text states; the cosine's interval is
    shown in the table, not read here)."""
    out = [
        "What it shows (each statement follows from the table by a fixed rule: a mode is "
        "*biased* when its relative error's 95% interval excludes 0):",
        "",
    ]
    ident = [r for r in rows if r["peer"] == "identical"]
    if ident:
        worst = max(r["same_samples_max_rel_diff"] for r in ident)
        out.append(
            f"- Negative control: on the identical peer's samples every mode's batch gradient "
            f"equals on-policy's (largest relative difference over all batches {worst:.1e}); "
            "its bias and variance are on-policy's by construction."
        )
    for peer in dict.fromkeys(r["peer"] for r in rows if r["peer"] not in (ON_POLICY, "identical")):
        sel = {r["mode"]: r for r in rows if r["peer"] == peer}
        biased = [MODE_STYLE[m][0] for m, r in sel.items() if r["rel_err_ci"][0] > 0]
        unbiased = [MODE_STYLE[m][0] for m, r in sel.items() if r["rel_err_ci"][0] <= 0]
        parts = ", ".join(
            f"{MODE_STYLE[m][0]} {r['rel_err']:.2f} (variance x{r['var_ratio']:.2f})"
            for m, r in sel.items()
        )
        first = next(iter(sel.values()))
        verdict = (f"biased: {', '.join(biased)}" if biased else "no mode's bias is detected") + (
            f"; not detected: {', '.join(unbiased)}" if biased and unbiased else ""
        )
        out.append(
            f"- **{peer}** (KL {first['kl_sample']:.2f} per sample, {first['kl_token']:.3f} per "
            f"token): relative error {parts}; {verdict}."
        )
    return out


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m experiments.mechanism", description=__doc__.split("\n")[0]
    )
    p.add_argument("--quick", action="store_true", help="a few batches, short warm-ups (a test)")
    p.add_argument(
        "--results",
        type=Path,
        default=None,
        help="folder of mechanism.{jsonl,png,md} (default experiments/results; "
        "experiments/results-quick with --quick)",
    )
    p.add_argument(
        "--cache",
        type=Path,
        default=None,
        help="warm-up cache (default experiments/cache, shared with the study; "
        "experiments/cache-quick with --quick)",
    )
    p.add_argument(
        "--work",
        type=Path,
        default=None,
        help="finished parts, kept for a rerun (default experiments/runs/mechanism[-quick])",
    )
    p.add_argument("--jobs", type=int, default=2, help="parts run at once (default 2)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per part (default 1)")
    p.add_argument(
        "--partial",
        action="store_true",
        help="run nothing: write the rows of the parts done so far, naming the missing ones",
    )
    p.add_argument("--part", default=None, help=argparse.SUPPRESS)  # one part, for --jobs > 1
    p.add_argument(
        "--report",
        action="store_true",
        help="only redraw mechanism.png and mechanism.md from the stored mechanism.jsonl",
    )
    args = p.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    # peft asks transformers the deprecated `is_gradient_checkpointing` on every LoRA wrap.
    warnings.filterwarnings(
        "ignore", message=r".*is_gradient_checkpointing.* is deprecated", category=FutureWarning
    )
    scale = QUICK if args.quick else FULL
    results = args.results or HERE / ("results-quick" if args.quick else "results")
    cache = args.cache or HERE / ("cache-quick" if args.quick else "cache")
    work = args.work or HERE / "runs" / ("mechanism-quick" if args.quick else "mechanism")
    if args.part is not None:
        torch.set_num_threads(args.threads)
        run_part(args.part, scale, cache, work)
        return 0
    command = "python -m experiments.mechanism" + (" --quick" if args.quick else "")
    if args.report:
        rows = [json.loads(x) for x in (results / "mechanism.jsonl").read_text().splitlines()]
    else:
        flags = ["--quick"] if args.quick else []
        rows = run(scale, cache, work, args.jobs, args.threads, flags, args.partial)
        write_jsonl(rows, results / "mechanism.jsonl")
    plot(rows, results / "mechanism.png")
    text = markdown(rows, command)
    (results / "mechanism.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
