"""One node of the swarm (`Node`): set up, then generate, exchange, train each round.

The node talks to its peers only through a `transport.Transport` (the agreement checks, the
barriers, the checkpoint check, the reward and sample exchanges, the gathers of metrics and
sample-log rows), and never asks which one runs: the process around it is a torchrun worker
(`worker.run_worker`, the lockstep `TorchTransport`) or a peer of a swarm (`peer.run_peer`, a
swarm transport). A node whose optimizer steps keep coming out non-finite (`max_skipped_steps` in
a row) raises `Diverged` on every node; what it checks of its peers' samples is in `claims`.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Optional

import torch

from ftis_kernels.grpo import checkpoint
from ftis_kernels.grpo.audit import (
    SAMPLE_LOG,
    append_sample_log,
    defence_metrics,
    sample_rows,
    start_sample_log,
)
from ftis_kernels.grpo.claims import blame_peers, check_claims
from ftis_kernels.grpo.exchange import Drop, Sample, exchange, make_hostile
from ftis_kernels.grpo.models import (
    apply_lora,
    build_model,
    load_pretrained,
    warm_up_cached,
    warmup_cache_file,
)
from ftis_kernels.grpo.process import EXIT_FAULT_INJECTION, leave
from ftis_kernels.grpo.provenance import describe, environment, record_environment
from ftis_kernels.grpo.report import (
    METRIC_KEYS,
    append_metrics,
    metric_rows,
    read_metrics,
    skipped_in_a_row,
    start_metrics,
    write_outputs,
    write_run_config,
)
from ftis_kernels.grpo.rollout import horizontal_advantages, sample, vertical_advantages
from ftis_kernels.grpo.schema import RESUMABLE, RunConfig, to_dict
from ftis_kernels.grpo.task import Difficulty, Problems, format_prompt, reward
from ftis_kernels.grpo.tokenizer import build_tokenizer, vocab_fingerprint
from ftis_kernels.grpo.train import grpo_update, packing_keeps_sequences_apart, skip_cause
from ftis_kernels.grpo.transport import Transport, source_of

log = logging.getLogger("ftis_kernels.grpo")

# Primes that mix the run seed with the rank (and round) into independent generator seeds.
SAMPLER_SEED_MIX = 7919
HOSTILE_SEED_MIX, HOSTILE_ROUND_MIX = 104729, 31


def sampler_seed(seed: int, rank: int) -> int:
    """Seed of node `rank`'s sampling generator (its completions and evaluations)."""
    return seed * SAMPLER_SEED_MIX + rank


def hostile_seed(seed: int, round_: int, rank: int) -> int:
    """Seed of what a hostile node `rank` forges in round `round_`."""
    return seed * HOSTILE_SEED_MIX + round_ * HOSTILE_ROUND_MIX + rank


def signal_metrics(own: list[Sample]) -> dict[str, float]:
    """How much a node's own samples can teach: sample_acc, the share with the right answer
    (reward 1, whatever `format_credit` pays), and zero_adv_groups, the share of its groups
    (prompts) whose advantages are all 0 (equal rewards: no gradient)."""
    groups: dict[int, list[float]] = {}
    for s in own:
        groups.setdefault(s.prompt_id, []).append(s.advantage)
    return dict(
        sample_acc=sum(s.reward == 1.0 for s in own) / len(own),
        zero_adv_groups=sum(all(a == 0 for a in g) for g in groups.values()) / len(groups),
    )


def staleness_metrics(received: list[Sample]) -> dict[str, float]:
    """How off-policy asynchrony made the received samples trained on: staleness_mean, their
    mean staleness in rounds (NaN without any), and samples_stale, how many are of an earlier
    round than the receiver's (always 0 under torch's lockstep)."""
    return dict(
        staleness_mean=(
            sum(s.staleness for s in received) / len(received) if received else math.nan
        ),
        samples_stale=float(sum(s.staleness > 0 for s in received)),
    )


class Diverged(Exception):
    """A node skipped `max_skipped_steps` optimizer steps in a row; every node raises it."""


class Node:
    """One node's state and its round loop. `rank` picks its spec in `cfg.nodes` and its row in
    the metrics; `world` is how many nodes `transport.gather` returns rows of (1 for a peer that
    runs alone in its process). The node's exchange `source` is `source_of(transport.peer_id)`
    (its rank under torch); it moves its sampling seed, and its prompts in vertical mode are
    those of slot `slot` of `slots` (default: `rank` of `world`)."""

    def __init__(
        self,
        cfg: RunConfig,
        rank: int,
        world: int,
        device: torch.device,
        transport: Optional[Transport] = None,
        *,
        slot: Optional[int] = None,
        slots: Optional[int] = None,
    ):
        self.cfg, self.rank, self.world, self.device = cfg, rank, world, device
        self.transport = transport
        self.source = rank if transport is None else source_of(transport.peer_id)
        self.slot = rank if slot is None else slot
        self.slots = world if slots is None else slots
        self.spec = cfg.node(rank)
        self.out = Path(cfg.out)
        self.ckpt = self.out / "ckpt"
        self.problems = Problems(cfg.seed, cfg.task, cfg.data, cfg.difficulty())
        self.options = cfg.ftis_options(rank)
        self.sampler = torch.Generator().manual_seed(sampler_seed(cfg.seed, self.source))
        self._prompt_cache: dict[int, list[int]] = {}
        self.last_received: list[Sample] = []
        self.start = 0  # the first round this process runs (`run`)
        self.ran_before: Optional[int] = None  # the round this process ran before the current
        self.round_began = math.inf  # when the current round began (time.monotonic())

    # -- set-up -------------------------------------------------------------------------------
    def build(self) -> None:
        spec = self.spec
        if spec.model is not None:
            self.model, self.tokenizer = load_pretrained(spec.model)
        else:  # config.validate made sure the task is the built-in one
            self.tokenizer = build_tokenizer(self.problems.arith.vocabulary_text())
            self.model = build_model(spec.arch, self.tokenizer, self.cfg.init_seed(self.rank))
        self.model.to(self.device)
        self.vocab_size = min(len(self.tokenizer), self.model.get_input_embeddings().num_embeddings)
        self.check_vocabulary()

    def check_vocabulary(self) -> None:
        """All nodes must share one token -> id map, or exchanged token ids mean nothing; and one
        run configuration, which fixes the exchange's buffer sizes."""
        if len(self.tokenizer) > self.model.get_input_embeddings().num_embeddings:
            raise SystemExit(  # a refusal to start, as a vocabulary mismatch between nodes is
                f"node {self.rank}: tokenizer has {len(self.tokenizer)} tokens but the model's "
                f"embedding only {self.model.get_input_embeddings().num_embeddings} (resize it)"
            )
        self.transport.agree("configuration", self.cfg.swarm_fingerprint())
        self.transport.agree("vocabulary", vocab_fingerprint(self.tokenizer))
        log.info(
            "node %d (%s): vocabulary of %d tokens shared by all %d nodes",
            self.rank,
            self.spec.name,
            len(self.tokenizer),
            self.world,
        )

    def prepare(self, join: Optional[Callable[[], int]] = None) -> int:
        """Warm up (fresh run) or restore (--resume); returns the first round to run: a fresh
        run's is `join()` once warmed up (the round a swarm is at), else 0."""
        cfg, spec = self.cfg, self.spec
        start, bar = 0, None
        if cfg.resume:
            start = self.resume_round()
        elif spec.model is None:
            if self.rank == 0 and cfg.progress:
                bar = progress_bar(spec.warmup_steps, f"warm-up of node 0 ({spec.name})", "step")
            self.warm_up(bar)
        if spec.lora:
            self.model = apply_lora(
                self.model, spec.lora_r, spec.lora_alpha, seed=self.cfg.init_seed(self.rank)
            )
        if cfg.pack and not packing_keeps_sequences_apart(self.model, self.vocab_size):
            raise SystemExit(
                f"pack: node {self.rank} ({spec.name})'s model lets packed sequences attend to "
                "each other (its attention ignores restarting position ids); set pack: false"
            )
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(params, lr=spec.lr, weight_decay=0.0)
        n_train = sum(p.numel() for p in params)
        n_all = sum(p.numel() for p in self.model.parameters())
        log.info(
            "node %d (%s): %s, %d of %d parameters trainable",
            self.rank,
            spec.name,
            "LoRA" if spec.lora else "full fine-tune",
            n_train,
            n_all,
        )
        if cfg.resume:
            state = checkpoint.load_node(
                self.ckpt, self.rank, start, self.model, self.optimizer, self.sampler
            )
            if state.get("config") != cfg.fingerprint():
                raise SystemExit(
                    f"--resume: the configuration differs from the checkpointed "
                    f"run's (only {', '.join(RESUMABLE)} may change)"
                )
            log.info("node %d: resumed after round %d", self.rank, start)
        if bar is not None:
            bar.set_description_str("warm-up: waiting for the other nodes' warm-up")
        # Warm-ups and loads take different times on different nodes: wait for the slowest here,
        # under the set-up timeout, so that no later collective's timeout has to cover them.
        self.transport.barrier("the set-up barrier (waiting for every node's warm-up)", setup=True)
        if not cfg.resume:
            start = join() if join is not None else 0
            self.save(start)
        if bar is not None:
            bar.close()
        return start

    def resume_round(self) -> int:
        """The newest checkpointed round whose files match their checksums on every node; a
        damaged newer one is passed over with a warning."""
        latest = checkpoint.latest_round(self.ckpt)
        if latest is None:
            raise SystemExit(f"--resume: no complete checkpoint under {self.ckpt}")
        good = []
        for round_ in checkpoint.node_rounds(self.ckpt, self.rank):
            if round_ > latest:  # written, but not by every node
                continue
            problem = checkpoint.verify_node(self.ckpt, self.rank, round_)
            if problem is None:
                good.append(round_)
            else:
                log.warning(
                    "node %d: checkpoint of round %d is damaged, not used: %s",
                    self.rank,
                    round_,
                    problem,
                )
        start = self.transport.common_round(good)
        if start is None:
            everyone = self.transport.gather(good)
            detail = "; ".join(f"node {i}: {rounds or 'none'}" for i, rounds in enumerate(everyone))
            raise SystemExit(
                f"--resume: no checkpoint under {self.ckpt} is good on every node "
                f"(good rounds up to {latest}: {detail}); see the warnings above"
            )
        if start != latest and self.rank == 0:
            log.warning(
                "falling back to the checkpoint of round %d, the newest good on every "
                "node (round %d, the latest, is damaged on some node)",
                start,
                latest,
            )
        return start

    def warm_up(self, bar=None) -> None:
        """The preset model's supervised warm-up, or its weights from `warmup_cache`; a tqdm `bar`
        follows its steps."""
        cfg, spec, t0 = self.cfg, self.spec, time.time()
        recipe = dict(
            steps=spec.warmup_steps,
            lr=spec.warmup_lr,
            batch_size=cfg.warmup_batch,
            seed=cfg.init_seed(self.rank),
            operations=list(spec.warmup_ops),
            gsm8k_format=spec.warmup_format,
        )
        cached = None
        if cfg.warmup_cache:
            # The warm-up draws train problems: a harder task is another recipe. The default
            # difficulty keeps the key earlier versions wrote, so their caches stay valid.
            train = self.problems.arith.difficulty.of("train")
            harder = {} if train == Difficulty().of("train") else {"difficulty": list(train)}
            if self.problems.arith.difficulty.disjoint_splits:  # train draws 7 chains in 8
                harder["disjoint_splits"] = True
            cached = warmup_cache_file(
                cfg.warmup_cache,
                spec.arch,
                task_seed=cfg.seed,
                vocabulary=vocab_fingerprint(self.tokenizer),
                **harder,
                **recipe,
            )
        on_step = None
        if bar is not None:

            def on_step(step: int, loss: float) -> None:
                bar.set_postfix_str(f"loss {loss:.3f}", refresh=False)
                bar.update(1)

        loss = warm_up_cached(
            self.model, self.tokenizer, self.problems.arith, cached, on_step=on_step, **recipe
        )
        if loss is None:
            if bar is not None:
                bar.set_postfix_str("loaded from the warm-up cache", refresh=False)
                bar.update(bar.total - bar.n)
            log.info("node %d (%s): warmed-up weights loaded from %s", self.rank, spec.name, cached)
        else:
            log.info(
                "node %d (%s): warm-up of %d steps in %.1fs, final loss %.3f",
                self.rank,
                spec.name,
                spec.warmup_steps,
                time.time() - t0,
                loss,
            )

    def save(self, completed: int) -> None:
        checkpoint.save_node(
            self.ckpt,
            self.rank,
            completed,
            self.model,
            self.optimizer,
            self.sampler,
            {"config": self.cfg.fingerprint(), "name": self.spec.name},
        )
        self.transport.barrier("the checkpoint barrier")
        if self.rank == 0:
            checkpoint.mark_latest(self.ckpt, completed)

    # -- one round ----------------------------------------------------------------------------
    def prompt_tokens(self, prompt_id: int) -> list[int]:
        if prompt_id not in self._prompt_cache:
            question = self.problems.problem(prompt_id).question
            self._prompt_cache[prompt_id] = self.tokenizer(format_prompt(question))["input_ids"]
        return self._prompt_cache[prompt_id]

    def generate(self, prompt_ids: list[int], *, greedy: bool, max_new_tokens: int):
        """Completions of `prompt_ids`: [(tokens (L,) int32, logprobs (L,) float32, reward)]."""
        out = []
        step = self.cfg.micro_batch
        for start in range(0, len(prompt_ids), step):
            ids = prompt_ids[start : start + step]
            tokens, logprobs, lengths = sample(
                self.model,
                [self.prompt_tokens(p) for p in ids],
                max_new_tokens=max_new_tokens,
                temperature=self.cfg.temperature,
                eos_id=self.tokenizer.eos_token_id,
                pad_id=self.tokenizer.pad_token_id,
                generator=self.sampler,
                greedy=greedy,
            )
            for i, pid in enumerate(ids):
                n = int(lengths[i])
                completion = tokens[i, :n].to(torch.int32)
                out.append((completion, logprobs[i, :n].clone(), self.score(pid, completion)))
        return out

    def score(self, prompt_id: int, completion: torch.Tensor) -> float:
        """The task's reward of `completion` (token ids) for the prompt; the one scoring rule of
        the node's own samples and of `verify`'s rescoring of its peers'."""
        text = self.tokenizer.decode(completion.tolist(), skip_special_tokens=True)
        return reward(text, self.problems.problem(prompt_id), self.cfg.format_credit)

    def accuracy(self, split: str) -> float:
        ids = self.problems.eval_ids(split, self.cfg.eval_size)
        done = self.generate(ids, greedy=True, max_new_tokens=self.cfg.eval_max_new_tokens)
        return sum(r == 1.0 for _, _, r in done) / max(len(done), 1)

    def rollout(self, round_: int) -> list[Sample]:
        """This node's samples of the round, with rewards and group advantages."""
        cfg, P, G, N = self.cfg, self.cfg.prompts_per_node, self.cfg.group_size, self.world
        horizontal = cfg.collab == "horizontal" and cfg.loss != "on-policy"
        if horizontal:
            prompts = self.problems.train_ids(range(round_ * P, (round_ + 1) * P))
            per_prompt = G // N
        else:
            first = (round_ * self.slots + self.slot) * P
            prompts = self.problems.train_ids(range(first, first + P))
            per_prompt = G
        ids = [p for p in prompts for _ in range(per_prompt)]
        done = self.generate(ids, greedy=False, max_new_tokens=cfg.max_new_tokens)
        rewards = torch.tensor([r for _, _, r in done], dtype=torch.float32).view(P, per_prompt)
        if horizontal:
            swarm = self.transport.gather(rewards.flatten().tolist())
            # What a receiver checks each peer's samples against (`check_advantages`).
            self.swarm_rewards = torch.tensor(swarm, dtype=torch.float32).view(N, P, per_prompt)
            self.shared_prompts = {pid: p for p, pid in enumerate(prompts)}
            advantages = horizontal_advantages(self.swarm_rewards)[self.rank]
        else:
            advantages = vertical_advantages(rewards)
        return [
            Sample(pid, self.source, tok, lp, rew, float(adv))
            for pid, (tok, lp, rew), adv in zip(ids, done, advantages.flatten().tolist())
        ]

    def evaluates(self, round_: int) -> bool:
        """Whether round `round_` starts with an evaluation: every `eval_every` rounds (round 0
        only with `eval_start`) and the last round. After rounds skipped to catch up with a
        swarm (`run`'s `advance`), the round run next evaluates in place of a multiple of
        `eval_every` skipped."""
        cfg, every = self.cfg, self.cfg.eval_every
        if round_ == cfg.rounds - 1:
            return True
        since = round_ if self.ran_before is None else self.ran_before + 1
        due = -(-since // every) * every  # the first multiple of eval_every from `since` on
        if due == 0 and not cfg.eval_start:
            due = every
        return due <= round_

    def max_staleness(self, round_: int) -> int:
        """How old the peers' samples this round trains on may be: `max_staleness`, but after a
        --resume none of the rounds before it (their samples may have been used before the
        stop; a transport's memory of what it gave starts afresh)."""
        if self.cfg.resume:
            return min(self.cfg.max_staleness, round_ - self.start)
        return self.cfg.max_staleness

    def run_round(self, round_: int) -> dict[str, float]:
        cfg, t0 = self.cfg, time.time()
        if self.spec.fail_at_round == round_:
            why = f"node {self.rank}: fault injection (fail_at_round={round_}): exiting now"
            log.error("%s", why)
            leave(EXIT_FAULT_INJECTION, self.rank, why)
        evaluate = self.evaluates(round_)
        acc_id = self.accuracy("test") if evaluate else math.nan
        acc_ood = self.accuracy("ood") if evaluate else math.nan
        own = self.rollout(round_)
        received, drops, sent, tokens_sent = [], [], 0, 0
        if cfg.loss != "on-policy":
            hostile_gen = torch.Generator().manual_seed(hostile_seed(cfg.seed, round_, self.source))
            outgoing = make_hostile(
                own, self.spec.hostile, self.vocab_size, hostile_gen, self.last_received
            )
            received, drops, sent = exchange(
                outgoing,
                vocab_size=self.vocab_size,
                max_tokens=cfg.max_new_tokens,
                max_samples=len(own),
                prompt_ok=self.problems.is_train,
                transport=self.transport,
                round_=round_,
                max_staleness=self.max_staleness(round_),
                timeout_s=cfg.collect_timeout_s,
            )
            self.last_received = received  # what a "replay" node sends next round
            tokens_sent = sum(s.n_tokens for s in outgoing)  # a hostile node's, not its own
        if received:
            received, refused = self.check_advantages(received)
            drops += refused
        per_sample: dict[str, list[float]] = {}
        stats = self.update(own + received, per_sample)
        if stats["skipped"] and received and cfg.blame_peers:
            stats, received, per_sample, blamed = blame_peers(
                self.update,
                own,
                received,
                stats,
                per_sample,
                who=f"node {self.rank} ({self.spec.name}) round {round_}",
            )
            drops += blamed
        if cfg.sample_log:
            self.sample_rows = sample_rows(round_, self.rank, own, received, per_sample, drops)
        if stats["skipped"]:
            log.warning(
                "node %d (%s) round %d: optimizer step skipped, %s; parameters and "
                "optimizer state unchanged",
                self.rank,
                self.spec.name,
                round_,
                skip_cause(stats),
            )
        return dict(
            reward_mean=sum(s.reward for s in own) / len(own),
            **signal_metrics(own),
            acc_id=acc_id,
            acc_ood=acc_ood,
            tokens_sent=tokens_sent,
            bytes_sent=sent,
            bytes_per_token=sent / tokens_sent if tokens_sent else math.nan,
            samples_trained=len(own) + len(received),
            samples_received=len(received),
            dropped=len(drops),
            seconds=time.time() - t0,
            **stats,
            **defence_metrics(own, received, per_sample, drops),
            **staleness_metrics(received),
        )

    def update(self, samples: list[Sample], per_sample: dict[str, list[float]]) -> dict[str, float]:
        """One optimizer step on `samples` (`grpo_update`: skipped when non-finite)."""
        cfg = self.cfg
        return grpo_update(
            self.model,
            self.optimizer,
            samples,
            self.prompt_tokens,
            self.options,
            micro_batch=cfg.micro_batch,
            pad_id=self.tokenizer.pad_token_id,
            grad_clip=cfg.grad_clip,
            device=self.device,
            pack_row_tokens=cfg.pack_row_tokens if cfg.pack else None,
            per_sample=per_sample,
        )

    def check_advantages(self, received: list[Sample]) -> tuple[list[Sample], list[Drop]]:
        """Check each received sample's claims (`claims.check_claims`); returns (the samples to
        train on, with the advantages this node computed, and one `Drop` per refused sample)."""
        swarm = {}
        if self.cfg.collab == "horizontal":
            swarm = dict(swarm_rewards=self.swarm_rewards, shared_prompts=self.shared_prompts)
        score = self.score if self.cfg.verify_rewards else None
        return check_claims(received, self.cfg.group_size, score=score, **swarm)

    # -- bookkeeping --------------------------------------------------------------------------
    def gather_rows(self, round_: int, metrics: dict[str, float]) -> list[dict]:
        everyone = self.transport.gather([float(metrics[k]) for k in METRIC_KEYS])
        names = [self.cfg.node(i).name for i in range(len(everyone))]
        peers = [str(i) for i in range(len(everyone))]
        if self.transport.kind != "torch":
            peers = [self.transport.peer_id]  # a swarm peer's rows: its own
        return metric_rows(round_, everyone, names, self.cfg.loss, self.cfg.collab, peers)

    def log_samples(self) -> None:
        """Node 0 appends every node's `received.jsonl` lines of the round (`sample_log`)."""
        everyone = self.transport.gather(self.sample_rows)
        if self.rank == 0:
            append_sample_log(self.out / SAMPLE_LOG, [r for rows in everyone for r in rows])

    def check_skips(self, rows: list[dict], in_row: list[int]) -> None:
        """Count each node's skipped steps in a row (`in_row`, updated in place); Diverged on
        every node once one reaches `max_skipped_steps`."""
        for row in rows:
            in_row[row["node"]] = in_row[row["node"]] + 1 if row["skipped"] else 0
        worst = max(range(self.world), key=lambda i: in_row[i])
        n, last = in_row[worst], rows[0]["round"]
        if n < self.cfg.max_skipped_steps:
            return
        hint = (
            f" (--loss {self.cfg.loss} leaves the IS weight untruncated; tis and f-tis cap it)"
            if self.options.is_mode == "vis"
            else ""
        )
        # Under torch.distributed every node stops; a swarm peer (a world of its own) leaves.
        stopping = "stopping the swarm" if self.world > 1 else "stopping"
        raise Diverged(
            f"node {worst} ({self.cfg.node(worst).name}) skipped its optimizer step "
            f"{n} rounds in a row (the last in round {last}: non-finite loss or "
            f"gradient, see its warnings); {stopping}, the training diverges"
            f"{hint}. The limit is max_skipped_steps={self.cfg.max_skipped_steps}"
        )

    def skips_before(self, previous: list[dict], start: int) -> list[int]:
        """Every node's skipped steps in a row before round `start` (from rank 0's `previous`
        rows): a --resume counts them towards `max_skipped_steps`, as an uninterrupted run."""
        in_row = skipped_in_a_row([r for r in previous if r["round"] < start])
        counts = [float(in_row.get(i, 0)) if self.rank == 0 else 0.0 for i in range(self.world)]
        return [int(n) for n in self.transport.gather(counts)[0]]

    def run(
        self,
        join: Optional[Callable[[], int]] = None,
        advance: Optional[Callable[[int], int]] = None,
    ) -> None:
        """The run to `cfg.rounds`, from the checkpoint (--resume), the round `join()` gives once
        warmed up (a peer joining a running swarm), or 0; node 0 writes the outputs. After each
        round, and before the first after a --resume, `advance(next)` may move the next round
        forward (a swarm peer that fell behind its peers catching up: the rounds between are
        skipped, their checkpoints and evaluations due taken at the next round run)."""
        cfg = self.cfg
        metrics_path = self.out / "metrics.jsonl"
        previous = []
        if self.rank == 0 and cfg.resume and metrics_path.exists():
            try:
                previous = read_metrics(metrics_path)
            except ValueError as exc:
                raise SystemExit(f"--resume: {exc}") from None
        self.build()
        start = self.start = self.prepare(join)
        round_ = start
        if advance is not None and cfg.resume and start < cfg.rounds:
            # A resumed peer's checkpoint may be far behind its swarm: catch up before the first
            # round, not after a round nobody takes.
            round_ = min(max(start, advance(start)), cfg.rounds - 1)
            if round_ > start:
                self.ran_before = start - 1  # rounds from `start` on skipped (`evaluates`)
        bar = None
        if self.rank == 0:
            kept = [r for r in previous if r["round"] < start]
            write_run_config(self.out, to_dict(cfg))
            self.environment = environment(self.world)
            record_environment(self.out, self.environment, round_, resumed_at=start)
            start_metrics(metrics_path, kept)
            if cfg.sample_log:
                start_sample_log(self.out / SAMPLE_LOG, start if cfg.resume else None)
            if cfg.progress:
                bar = progress_bar(cfg.rounds, f"GRPO {cfg.loss}", "round", initial=round_)
        skips_in_row = self.skips_before(previous, start) if cfg.resume else [0] * self.world
        saved = start
        while round_ < cfg.rounds:
            self.round_began = time.monotonic()
            self.transport.barrier(f"the start barrier of round {round_}")
            metrics = self.run_round(round_)
            rows = self.gather_rows(round_, metrics)
            if cfg.sample_log:
                self.log_samples()
            if self.rank == 0:
                append_metrics(metrics_path, rows)
                msg = " ".join(f"{r['name']}={r['reward_mean']:.2f}" for r in rows)
                log.debug("round %d reward %s", round_, msg)
                if bar is not None:
                    bar.set_postfix_str(f"reward {msg}", refresh=False)
                    bar.update(1)
            try:
                self.check_skips(rows, skips_in_row)
            except Diverged as exc:
                if bar is not None:
                    bar.close()
                if self.rank == 0:
                    log.error("%s", exc)
                    notes = [describe(self.environment)]
                    write_outputs(self.out, self.tokenizer, metrics_path, notes)
                # None leaves before rank 0 has written: torchrun stops the rest at the first exit.
                self.transport.barrier("the stop barrier")
                raise
            completed = round_ + 1
            # Every ckpt_every rounds, or at the first round run past a multiple skipped.
            if completed // cfg.ckpt_every > saved // cfg.ckpt_every or completed == cfg.rounds:
                self.save(completed)
                saved = completed
            self.ran_before, round_ = round_, completed
            if advance is not None and completed < cfg.rounds:
                round_ = min(max(completed, advance(completed)), cfg.rounds - 1)
                if bar is not None and round_ > completed:
                    bar.update(round_ - completed)
        if bar is not None:
            bar.close()
        if self.rank == 0:
            summary = write_outputs(
                self.out, self.tokenizer, metrics_path, [describe(self.environment)]
            )
            if summary is not None:
                print(f"\n{summary}", flush=True)


def progress_bar(total: int, desc: str, unit: str, initial: int = 0):
    """A tqdm bar on stderr: rank 0's warm-up steps, then the rounds."""
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, desc=desc, unit=unit)
