"""The confirmatory study: the claims study's second round, pre-registered before its data.

    python -m experiments.confirm estimate               # the cost of what is left, per chunk
    python -m experiments.confirm run --chunk 1          # one chunk (a set of seeds), resumable
    python -m experiments.confirm run                    # every chunk
    python -m experiments.confirm list                   # every cell id and its ftis-grpo command
    python -m experiments.confirm report                 # claims and tables from finished cells
    python -m experiments.confirm run --scale pilot      # the pilot that chooses the task
    python -m experiments.confirm probe --probe 2 3 9 300 0.8   # what a warm-up alone gives
    python -m experiments.confirm curve --lr 2e-4 5e-5           # one node alone, against lr 0
    python -m experiments.confirm recheck --only 'pairs/size/f-tis/s10'  # rerun, compare

What differs from the first round (`experiments/study.py`, kept as it ran, as the exploratory
round), each for a reason its data gave:

- **A task on which on-policy training learns and the stale peer harms** (`configs/confirm/`),
  frozen by the pilot (`--scale pilot`, `probe`, `curve`, recorded in the README): one step
  with operands to `OPERAND_MAX`, test and ood chains never trained on (`disjoint_splits`),
  warm-ups 80% in GSM8K's format, and learning rates 3-10 times below the first round's (at
  which greedy accuracy fell on every candidate); on the harder candidates the stale peer did no
  harm at the lower rates, so the gate could not pass. The out-of-domain split is the same
  arithmetic in words no training problem uses (`ood_surface`), evaluated on `EVAL_SIZE`
  problems.
- **Paired baselines.** The receiver (`small`) is rank 0 and its peer rank 1 in every pair, so a
  node's prompts (`first = (round * N + rank) * P`), sampling seed (`sampler_seed(seed, rank)`),
  initial weights and warm-up are the same in every mode of its pair: each pair's on-policy
  baseline is the pair's own config with `--loss on-policy`. Without an exchange the receiver's
  on-policy run does not depend on its peer, so its three on-policy runs (size, expertise, lora)
  are one run three times; `report` checks that they agree. The twin's NoIS run (the receiver
  with an identical peer: twice the on-policy data) is the second, equal-data baseline.
- **Arms that separate the mechanisms**: NoIS, TIS (the cap without the filter), F-TIS, F-VIS
  (the filter without the cap) and on-policy in each heterogeneous pair; NoIS and F-TIS with the
  stale peer, the positive control.
- **A small family**: the gate P, then C3, C1 (non-inferiority) and C5 under Holm (`CLAIMS`,
  `FAMILY`); the other comparisons are reported as estimates without a verdict (`ESTIMATES`).
  `SEEDS` come from the first round's measured spreads (`power_table`).
- **Cost**: the evaluation before the first round runs in the on-policy cells only (it is the
  same in every mode of a seed; `eval_start: false` elsewhere), the final one on `SMALL_EVAL`
  problems where no comparison reads it, and warm-ups are cached per seed (`warmup_cache`).
- **Chunks**: `--chunk K` runs the seeds `chunks()[K - 1]`; finished cells are skipped, so a
  chunk stopped early continues where it stopped. `run` refuses them until `FROZEN`.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import shlex
import shutil
import statistics
import sys
from pathlib import Path
from typing import Optional

from experiments import stats, study
from experiments.study import Cell, ClaimSpec, _finished, _out, _units

HERE = Path(__file__).resolve().parent
# Fresh seeds: 0-9 ran the first round, 100-102 the pilot.
SEEDS = tuple(range(10, 26))
CHUNK_SEEDS = 4  # a chunk: this many seeds, about 73 min on 2 idle cores (`estimate`)
PILOT_SEEDS = (100, 101, 102)
RECEIVER = "small"
HETERO = ("size", "expertise", "lora")
PEER = study.PEER  # the peers' names, as in the first round
ARMS = ("on-policy", "nois", "tis", "f-tis", "f-vis")
# The pairs and the modes each runs: every arm in the heterogeneous pairs, the positive control's
# two, and the twin's NoIS (the equal-data baseline).
PAIR_MODES = {
    "identical": ("nois",),
    "size": ARMS,
    "expertise": ARMS,
    "lora": ARMS,
    "stale": ("nois", "f-tis"),
}
# The task the pilot froze (`configs/confirm/*.yaml` state it, a test checks both agree): one
# step, operands to 9, at learning rates 3-10 times below the first round's.
TASK_STEPS = (1, 1)
OPERAND_MAX = 9
# Whether the pilot has frozen the task: until then `run` refuses the confirmatory cells.
FROZEN = True
EVAL_SIZE = 512
SMALL_EVAL = 128
ROUNDS = 30
MARGIN = 0.05  # C1: "not worse than on-policy training by more than 5 points of sample accuracy"
FLOOR = 0.15  # an out-of-domain baseline below this is at its floor (the pilot's bar)
# The first round's per-seed standard deviations and effects (`experiments/results/claims.jsonl`,
# seeds 0-9) the seeds are planned from; C1's true difference is taken as 0 (the first round
# measured +0.01 to +0.07: planning at 0 is conservative). C1's SD is that of the first round's
# three C1 pairs pooled per seed (6 nodes, as C3's); the plan as run had 0.055, no first-round
# spread, which put C1 at 16 seeds for 0.05 / 3: at 0.062, 16 seeds give it 70% power there.
PLAN = {
    "C3": dict(sd=0.027, effect=0.029),
    "C1": dict(sd=0.062, effect=0.0),
    "C5": dict(sd=0.032, effect=0.037),
    "C4": dict(sd=0.109, effect=0.043),
}


def _confirm_units(pairs, mode: str, base_mode: str, nodes: str = "both"):
    """(pair, node, mode, baseline pair, baseline mode): within each pair, same node and seed."""
    return _units(pairs, (mode, None, base_mode), nodes)


# The gate, then the family (Holm over these three), fixed before any confirmatory data.
GATE = ClaimSpec(
    "P",
    "positive control (gate): NoIS with the stale peer trains the receiver worse than its paired "
    "on-policy run",
    stats.Claim("P", "direction", "acc_late", sign=-1),
    (("stale", RECEIVER, "nois", "size", "on-policy"),),
)
FAMILY = (
    ClaimSpec(
        "C3",
        "F-TIS trains better than NoIS (pooled over the 6 nodes of the heterogeneous pairs)",
        stats.Claim("C3", "direction", "acc_late", sign=+1),
        _confirm_units(HETERO, "f-tis", "nois"),
    ),
    ClaimSpec(
        "C1",
        "F-TIS trains no worse than on-policy training, by at most the margin (pooled over the 6 "
        "nodes of the heterogeneous pairs, each against its paired on-policy run)",
        stats.Claim("C1", "noninferiority", "acc_late", margin=MARGIN),
        _confirm_units(HETERO, "f-tis", "on-policy"),
    ),
    ClaimSpec(
        "C5",
        "F-VIS (the filter, IS weights uncapped) falls below F-TIS late in training (pooled over "
        "the 6 nodes of the heterogeneous pairs)",
        stats.Claim("C5", "direction", "acc_last", sign=-1),
        _confirm_units(HETERO, "f-vis", "f-tis"),
    ),
)
CLAIMS = (GATE, *FAMILY)
# Reported with their 95% intervals, no verdict: what the family leaves out, and why.
ESTIMATES = (
    (
        ClaimSpec(
            "TIS-NoIS",
            "the cap alone: TIS above NoIS (6 heterogeneous nodes)",
            stats.Claim("TIS-NoIS", "direction", "acc_late", sign=+1),
            _confirm_units(HETERO, "tis", "nois"),
        ),
        "a mechanism question the first round could not ask (no TIS arm): no spread to plan on",
    ),
    (
        ClaimSpec(
            "F-TIS-TIS",
            "the filter on top of the cap: F-TIS above TIS (6 heterogeneous nodes)",
            stats.Claim("F-TIS-TIS", "direction", "acc_late", sign=+1),
            _confirm_units(HETERO, "f-tis", "tis"),
        ),
        "no spread to plan on; the mechanism test saw no gradient benefit of the filter",
    ),
    (
        ClaimSpec(
            "C2",
            "NoIS trains worse than on-policy training (6 heterogeneous nodes)",
            stats.Claim("C2", "direction", "acc_late", sign=-1),
            _confirm_units(HETERO, "nois", "on-policy"),
        ),
        "the first round measured +0.012 (SD 0.076): no seed count within reach could resolve it",
    ),
    (
        ClaimSpec(
            "C4",
            "F-TIS removes the stale peer's harm: F-TIS above NoIS with the stale peer (receiver)",
            stats.Claim("C4", "direction", "acc_late", sign=+1),
            (("stale", RECEIVER, "f-tis", "stale", "nois"),),
        ),
        "needs about 70 seeds at the first round's spread (`power_table`)",
    ),
    (
        ClaimSpec(
            "C6",
            "F-TIS collaboration raises out-of-domain accuracy over on-policy training "
            "(6 heterogeneous nodes; greedy, unseen words)",
            stats.Claim("C6", "direction", "acc_ood", sign=+1),
            _confirm_units(HETERO, "f-tis", "on-policy"),
        ),
        "a new split: no spread to plan on; a fourth Holm member would cost the others power",
    ),
    (
        ClaimSpec(
            "twin",
            "F-TIS with a heterogeneous peer against the equal-data baseline: the receiver's F-TIS "
            "run minus its NoIS run with an identical twin (3 pairs)",
            stats.Claim("twin", "direction", "acc_late", sign=+1),
            tuple((p, RECEIVER, "f-tis", "identical", "nois") for p in HETERO),
        ),
        "the second baseline (twice the on-policy data), reported beside C1",
    ),
)


# -- cells -----------------------------------------------------------------------------------------
def eval_flags(pair: str, mode: str) -> list[str]:
    """What a cell evaluates beyond the configs' final EVAL_SIZE problems per split: the
    on-policy cells also the start (the same in every mode of a seed); the cells whose greedy
    accuracy no comparison reads (all but on-policy and F-TIS in the heterogeneous pairs: C6 and
    the pilot's bar) only `SMALL_EVAL` problems, as the first round did."""
    if mode == "on-policy":
        return ["--set", "eval_start=true"]
    if pair in HETERO and mode == "f-tis":
        return []
    return ["--set", f"eval_size={SMALL_EVAL}"]


def _pair_cell(pair: str, mode: str, seed: int, flags: tuple[str, ...] = ()) -> Cell:
    evals = eval_flags(pair, mode)
    return Cell("pairs", pair, mode, seed, f"confirm/{pair}", ["--loss", mode, *evals, *flags])


def chunks() -> list[tuple[int, ...]]:
    """The seeds of each chunk, in order: `CHUNK_SEEDS` seeds each."""
    return [SEEDS[i : i + CHUNK_SEEDS] for i in range(0, len(SEEDS), CHUNK_SEEDS)]


# The pilot: the size pair's on-policy run (small and tiny, isolated) at each candidate on some of
# PILOT_SEEDS, and the first candidate's F-TIS run on the first pilot seed (what the filter does
# with the longer completions, and what a cell without the start evaluation costs). A candidate is
# --set flags over the configs; (name, flags, seeds, modes[, pair]), in the order they ran. Its
# first entries ran before the configs split the chains (`disjoint_splits`): their flags say so,
# and they pin the first candidate's task and learning rates, as the configs had them then.
TASK_2_3 = ("task_steps=[2,3]", "ood_steps=[2,3]")
CANDIDATE_2_3 = (*TASK_2_3, "nodes.0.lr=2.0e-4", "nodes.1.lr=3.0e-4")
PILOT = (
    (
        "2-3x9",
        ("task_operand_max=9", "ood_operand_max=9", "disjoint_splits=false", *CANDIDATE_2_3),
        PILOT_SEEDS,
        ("on-policy",),
    ),
    (
        "2-3x9",
        ("task_operand_max=9", "ood_operand_max=9", "disjoint_splits=false", *CANDIDATE_2_3),
        PILOT_SEEDS[:1],
        ("f-tis",),
    ),
    # the learning rates halved and quartered (the first candidate's accuracy fell)
    (
        "lr-half",
        (
            "nodes.0.lr=1.0e-4",
            "nodes.1.lr=1.5e-4",
            "eval_start=false",
            "disjoint_splits=false",
            *TASK_2_3,
        ),
        (100,),
        ("on-policy",),
    ),
    (
        "lr-quarter",
        (
            "nodes.0.lr=5.0e-5",
            "nodes.1.lr=7.5e-5",
            "eval_start=false",
            "disjoint_splits=false",
            *TASK_2_3,
        ),
        (100,),
        ("on-policy",),
    ),
    # greedy accuracy still fell at lr / 4: the binary reward (no credit for a well-formed wrong
    # answer), at lr / 4
    (
        "binary-lr-quarter",
        (
            "nodes.0.lr=5.0e-5",
            "nodes.1.lr=7.5e-5",
            "eval_start=false",
            "format_credit=0.0",
            "disjoint_splits=false",
            *TASK_2_3,
        ),
        (100,),
        ("on-policy",),
    ),
    # it fell with the binary reward too: twice the samples per update (is it the noise?)
    (
        "prompts8",
        ("prompts_per_node=8", "eval_start=false", "disjoint_splits=false", *CANDIDATE_2_3),
        (100,),
        ("on-policy",),
    ),
    # it fell with 64 samples per update too: the control, learning rates of 1e-12 (no update)
    (
        "lr-zero",
        ("nodes.0.lr=1.0e-12", "nodes.1.lr=1.0e-12", "disjoint_splits=false", *TASK_2_3),
        (100,),
        ("on-policy",),
    ),
    # the fall is the step size (`curve`, README): at the rates where an on-policy run does not
    # lose greedy accuracy, does the stale peer still harm NoIS (the gate)? One step, operands to 9
    # (small at 5e-5, tiny 3e-5), and two steps (small at 2e-5): the receiver's on-policy run and
    # its NoIS run with the stale peer, seeds 100-101.
    *(
        (name, (*task, f"nodes.0.lr={lr}", *peer), PILOT_SEEDS[:2], (mode,), pair)
        for name, task, lr in (
            ("1x9-lr", ("task_steps=[1,1]", "ood_steps=[1,1]"), "5.0e-5"),
            ("2x9-lr", ("task_steps=[2,2]", "ood_steps=[2,2]"), "2.0e-5"),
            (
                "1x19-lr",
                (
                    "task_steps=[1,1]",
                    "ood_steps=[1,1]",
                    "task_operand_max=19",
                    "ood_operand_max=19",
                ),
                "5.0e-5",
            ),
        )
        for pair, mode, peer in (
            ("size", "on-policy", ("nodes.1.lr=3.0e-5",)),
            ("stale", "nois", ()),
        )
    ),
)


def _pilot_pair(entry: tuple) -> str:
    """The pair a `PILOT` entry runs: its fifth item, else the size pair."""
    return entry[4] if len(entry) > 4 else "size"


CANDIDATES = tuple(dict.fromkeys((entry[0], _pilot_pair(entry)) for entry in PILOT))


def _pilot_cells() -> list[Cell]:
    out = []
    for entry in PILOT:
        name, sets, seeds, modes, pair = *entry[:4], _pilot_pair(entry)
        flags = tuple(x for s in sets for x in ("--set", s))
        for seed in seeds:
            for mode in modes:
                cell = _pair_cell(pair, mode, seed, flags)
                out.append(Cell("pilot", f"{pair}-{name}", mode, seed, cell.config, cell.flags))
    return out


def cells(scale: str = "full", seeds: Optional[tuple[int, ...]] = None) -> list[Cell]:
    """Every cell, seed by seed (the on-policy baselines first in each seed)."""
    if scale == "pilot":
        return _pilot_cells()
    out = []
    for seed in seeds if seeds is not None else SEEDS:
        out += [_pair_cell(p, "on-policy", seed) for p in HETERO]
        for pair, modes in PAIR_MODES.items():
            out += [_pair_cell(pair, m, seed) for m in modes if m != "on-policy"]
    return out


# -- the warm-up probe (the pilot's first step) ---------------------------------------------------
def probe(
    steps: tuple[int, int],
    operand_max: int,
    warmup_steps: int,
    gsm8k_format: float,
    seed: int = PILOT_SEEDS[0],
    n: int = 256,
) -> dict:
    """What the warm-up alone gives `small` on a task: its final loss, the share of right answers
    among samples at temperature 0.8 (train problems), and greedy accuracy on the test split and
    on the ood split in unseen words (`ood_surface`); the CPU seconds it took. The node's own
    warm-up (`models.warm_up`, the configs' lr and batch) and sampler, one thread."""
    import time

    import torch

    from ftis_kernels.grpo.config import build_config
    from ftis_kernels.grpo.models import build_model, warm_up
    from ftis_kernels.grpo.rollout import sample
    from ftis_kernels.grpo.task import (
        ArithmeticTask,
        Difficulty,
        format_prompt,
        make_prompt_id,
        reward,
    )
    from ftis_kernels.grpo.tokenizer import build_tokenizer

    torch.set_num_threads(1)
    t0 = time.process_time()
    cfg = build_config(config_file=str(HERE / "configs" / "confirm" / "size.yaml"))
    spec = next(node for node in cfg.nodes if node.name == RECEIVER)
    cfg.seed = seed
    task = ArithmeticTask(seed, Difficulty(*steps, operand_max, *steps, operand_max, True))
    tok = build_tokenizer(task.vocabulary_text())
    init = cfg.init_seed(cfg.nodes.index(spec))
    model = build_model(spec.arch, tok, init)
    loss = warm_up(
        model,
        tok,
        task,
        steps=warmup_steps,
        lr=spec.warmup_lr,
        batch_size=cfg.warmup_batch,
        seed=init,
        operations=list(spec.warmup_ops),
        gsm8k_format=gsm8k_format,
    )

    def accuracy(split: str, greedy: bool) -> float:
        ids = [make_prompt_id(split, i) for i in range(n)]
        gen, right = torch.Generator().manual_seed(seed), 0
        for k in range(0, n, cfg.micro_batch):
            batch = ids[k : k + cfg.micro_batch]
            prompts = [tok(format_prompt(task.problem(i).question))["input_ids"] for i in batch]
            tokens, _, lengths = sample(
                model,
                prompts,
                max_new_tokens=cfg.eval_max_new_tokens,
                temperature=cfg.temperature,
                eos_id=tok.eos_token_id,
                pad_id=tok.pad_token_id,
                generator=gen,
                greedy=greedy,
            )
            for j, i in enumerate(batch):
                text = tok.decode(tokens[j, : int(lengths[j])].tolist(), skip_special_tokens=True)
                right += reward(text, task.problem(i)) == 1.0
        return right / n

    with torch.no_grad():
        out = dict(
            steps=list(steps),
            operand_max=operand_max,
            warmup_steps=warmup_steps,
            format=gsm8k_format,
            seed=seed,
            loss=loss,
            sampled=accuracy("train", False),
            greedy_id=accuracy("test", True),
            greedy_ood=accuracy("ood", True),
        )
    return dict(out, cpu_seconds=round(time.process_time() - t0, 1))


# -- the learning curve (the pilot's steps 3 and 4) ---------------------------------------------
class _Alone:
    """The transport of a node that trains alone in this process (`curve`): no peers, no
    barriers; its peer id is its rank, so its sampling seed is the one it has in its pair."""

    kind = "torch"

    def __init__(self, rank: int):
        self.peer_id = str(rank)

    def agree(self, what: str, fingerprint: str) -> None:
        pass

    def barrier(self, phase: str, *, setup: bool = False) -> None:
        pass

    def gather(self, obj):
        return [obj]


def curve(
    pair: str,
    node: str,
    lr: float,
    *,
    seed: int = PILOT_SEEDS[0],
    rounds: int = ROUNDS,
    every: int = 10,
    n: int = 256,
    sets: tuple[str, ...] = (),
) -> dict:
    """One node of `configs/confirm/<pair>.yaml` trained on-policy alone, in this process, at
    learning rate `lr` (0: the control, no update): its prompts, sampling seed and warmed-up
    weights are those it has in its pair (rank, slot and stream as there). Greedy accuracy on `n`
    test problems every `every` rounds and at the end; the share of right answers among its
    training samples each round; after the first update, the mean change of the log-probability
    of the samples it rewarded and of those it penalised (`first_step`). `sets` are --set flags
    over the config (`task_steps=[1,1]`).
    Paired with the control on the same seed, what the updates did is the difference of the
    sampled accuracies round by round (same prompts, same sampler): `curve_table`."""
    import time

    import torch

    from ftis_kernels.grpo.config import build_config

    torch.set_num_threads(1)
    t0 = time.process_time()
    cfg = build_config(
        config_file=str(HERE / "configs" / "confirm" / f"{pair}.yaml"),
        overrides=dict(
            seed=seed, loss="on-policy", eval_size=n, progress=False, out=str(HERE / "runs-curve")
        ),
        sets=tuple(sets),
    )
    alone = alone_node(cfg, node)
    params = [p for p in alone.model.parameters() if p.requires_grad]
    alone.optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    acc, at, sampled, first_step = [], [], [], {}
    for round_ in range(rounds + 1):
        if round_ % every == 0 or round_ == rounds:
            acc.append(alone.accuracy("test"))
            at.append(round_)
        if round_ == rounds:
            break
        own = alone.rollout(round_)
        sampled.append(sum(s.reward == 1.0 for s in own) / len(own))
        if lr > 0:
            before = _sequence_logprobs(alone, own) if round_ == 0 else None
            alone.update(own, {})
            if before is not None:  # what one step did to the log-probability of what it trained on
                change = _sequence_logprobs(alone, own) - before
                for sign, name in ((1, "rewarded"), (-1, "penalised")):
                    picked = [c for c, s in zip(change.tolist(), own) if s.advantage * sign > 0]
                    first_step[name] = round(statistics.mean(picked), 4) if picked else None
    return dict(
        pair=pair,
        node=node,
        lr=lr,
        seed=seed,
        sets=list(sets),
        rounds=rounds,
        n=n,
        every=every,
        eval_rounds=at,
        acc_id=acc,
        sample_acc=sampled,
        first_step=first_step,
        cpu_seconds=round(time.process_time() - t0, 1),
    )


def alone_node(cfg, name: str):
    """Node `name` of `cfg`'s pair, built and warmed up (from the cache when there), to train alone
    in this process: its rank, prompt slot, sampling seed and initial weights are its pair's."""
    import torch

    from ftis_kernels.grpo.models import apply_lora
    from ftis_kernels.grpo.node import Node

    names = [spec.name for spec in cfg.nodes]
    if name not in names:
        raise SystemExit(f"--node: expected one of {names}, got {name!r}")
    if cfg.warmup_cache:  # the configs' cache is relative to the repository root
        cfg.warmup_cache = str(HERE.parent / cfg.warmup_cache)
    rank = names.index(name)
    alone = Node(cfg, rank, 1, torch.device("cpu"), _Alone(rank), slot=rank, slots=len(names))
    alone.build()
    alone.warm_up()
    if alone.spec.lora:
        alone.model = apply_lora(
            alone.model, alone.spec.lora_r, alone.spec.lora_alpha, seed=cfg.init_seed(rank)
        )
    return alone


def _sequence_logprobs(node, samples):
    """(len(samples),) the log-probability of each completion under `node`'s model now, at the
    sampling temperature (what the sampler gave it, `Sample.gen_logprobs`, when it drew it)."""
    import torch

    from ftis_kernels.grpo.train import build_batch, completion_logits

    with torch.no_grad():
        batch = build_batch(samples, node.prompt_tokens, node.tokenizer.pad_token_id, node.device)
        logits = completion_logits(node.model, batch).float() / node.cfg.temperature
        taken = batch["tokens"].long().unsqueeze(-1)
        logp = torch.log_softmax(logits, dim=-1).gather(-1, taken).squeeze(-1)
        return (logp * batch["mask"]).sum(-1)


def curve_table(rows: list[dict]) -> str:
    """Per task, node and learning rate (over seeds): greedy accuracy at the start and the end,
    and the sampled accuracy's gain over the control (lr 0, same pair, node, seed and task) in each
    third of the rounds, mean over seeds and each seed's value (in seed order)."""

    def same(r: dict) -> tuple:
        return (r["pair"], tuple(r["sets"]), r["node"], r["seed"], r["rounds"], r["n"], r["every"])

    control = {same(r): r for r in rows if r["lr"] == 0}
    groups: dict[tuple, list[tuple[dict, dict]]] = {}
    for r in rows:
        base = control.get(same(r))
        if r["lr"] > 0 and base is not None and r["rounds"] >= 3:  # thirds of the rounds
            key = (" ".join(r["sets"]) or "(configs)", r["pair"], r["node"], r["lr"], r["rounds"])
            groups.setdefault(key, []).append((r, base))
    head = (
        "| task (--set) | pair: node | lr | rounds | seeds | greedy acc_id start -> end | "
        "gain over lr 0: 1st third | 2nd third | last third |\n"
        "|---|---|---|---|---|---|---|---|---|"
    )
    lines = [head]
    for (task, pair, node, lr, rounds), runs in sorted(groups.items()):
        runs.sort(key=lambda pair_: pair_[0]["seed"])
        thirds = [[] for _ in range(3)]
        for r, base in runs:
            d = [a - b for a, b in zip(r["sample_acc"], base["sample_acc"])]
            k = len(d) // 3
            for i, part in enumerate((d[:k], d[k : 2 * k], d[2 * k :])):
                thirds[i].append(sum(part) / len(part))
        start = statistics.mean(r["acc_id"][0] for r, _ in runs)
        end = statistics.mean(r["acc_id"][-1] for r, _ in runs)
        cols = [f"{statistics.mean(t):+.3f} ({', '.join(f'{x:+.2f}' for x in t)})" for t in thirds]
        lines.append(
            f"| {task} | {pair}: {node} | {lr:g} | {rounds} | {len(runs)} | "
            f"{start:.3f} -> {end:.3f} | " + " | ".join(cols) + " |"
        )
    return "\n".join(lines)


# -- cost ------------------------------------------------------------------------------------------
# CPU seconds per cell, measured by chunk 1 (seeds 10-13, the frozen task, 2 cells at a time on
# 2 idle cores, one thread per node; `results/confirm/cells.jsonl`), medians for the size pair
# (small + tiny): a cell with the final evaluation of EVAL_SIZE problems per split (F-TIS: 38),
# one whose final evaluation is SMALL_EVAL problems (36), one that also evaluates the start (the
# on-policy cell: 42 without warm-ups; the LoRA pair's start cell, which warms up nothing, is 49
# = 42 x 1.17). A pair of two small models costs TWO_SMALL times as much (the expertise and LoRA
# cells: 44-52 against 36-38); a seed's warm-ups (small, tiny, add-expert, stale) about 120. The
# first candidate (two or three steps, completions twice as long) cost 2-3 times as much a cell.
CPU_S = {"cell": 38.0, "cell_start": 42.0, "cell_small_eval": 36.0, "warmups": 120.0}
TWO_SMALL = 1.3


def _kind(cell: Cell) -> str:
    if "eval_start=true" in cell.flags:
        return "cell_start"
    return "cell_small_eval" if f"eval_size={SMALL_EVAL}" in cell.flags else "cell"


def cell_cpu(cell: Cell) -> float:
    """The estimated CPU seconds of one cell (its seed's warm-ups not included)."""
    return CPU_S[_kind(cell)] * (1.0 if cell.group.startswith("size") else TWO_SMALL)


def cost(todo: list[Cell], work: Path, done: frozenset = frozenset()) -> tuple[float, int]:
    """(CPU seconds, seeds to warm up) of the cells of `todo` not yet finished (here, or recorded:
    their ids in `done`)."""
    left = [c for c in todo if c.id not in done and not _finished(_out(c, work, ()))]
    started = {c.seed for c in todo if c not in left}
    fresh = {c.seed for c in left} - started
    return sum(cell_cpu(c) for c in left) + len(fresh) * CPU_S["warmups"], len(fresh)


def estimate(work: Path, results: Optional[Path] = None, cores: int = 2) -> str:
    """What is left of each chunk (finished here or recorded under `results`): cells, CPU-minutes,
    and the wall time on `cores` idle cores."""
    done = frozenset(r["id"] for r in recorded(results, "full")[0]) if results else frozenset()
    lines, total = [], 0.0
    for k, seeds in enumerate(chunks(), 1):
        todo = cells("full", seeds)
        cpu, fresh = cost(todo, work, done)
        left = sum(c.id not in done and not _finished(_out(c, work, ())) for c in todo)
        total += cpu
        lines.append(
            f"chunk {k} (seeds {seeds[0]}-{seeds[-1]}): {left} of {len(todo)} cells to run, "
            f"{cpu / 60:.0f} CPU-min, about {cpu / cores / 60:.0f} min on {cores} idle cores"
        )
    seed = cells("full", (-1,))
    per_seed = cost(seed, work)[0]
    # every cell evaluating the start and EVAL_SIZE problems, as the first round's cells did
    unshared = sum(CPU_S["cell_start"] * cell_cpu(c) / CPU_S[_kind(c)] for c in seed)
    lines.append(
        f"all: {total / 60:.0f} CPU-min, about {total / cores / 3600:.1f} h on {cores} idle cores; "
        f"{per_seed / 60:.1f} CPU-min per seed ({(unshared + CPU_S['warmups']) / 60:.1f} if every "
        f"cell evaluated the start and {EVAL_SIZE} problems); CPU seconds: {CPU_S}"
    )
    return "\n".join(lines)


def _result_files(scale: str) -> tuple[str, str]:
    """The files under the results folder that record a scale's finished cells (rows, curves)."""
    return (
        ("pilot.jsonl", "pilot_curves.jsonl")
        if scale == "pilot"
        else ("cells.jsonl", "curves.jsonl")
    )


def recorded(results: Path, scale: str) -> tuple[list[dict], list[dict]]:
    """The rows and curves `report` wrote for a scale's finished cells. They are what a chunk run
    on another machine (its run folders not here) leaves behind: `run` does not rerun those cells
    and `report` keeps them."""
    out = []
    for name in _result_files(scale):
        path = results / name
        out.append([json.loads(x) for x in path.read_text().splitlines()] if path.exists() else [])
    return out[0], out[1]


def run(todo: list[Cell], work: Path, jobs: int, results: Optional[Path] = None) -> int:
    """Run the cells (finished ones, here or recorded under `results`, are skipped), `jobs` at a
    time; 1 if any failed."""
    if results is not None:
        done = {
            r["id"]: r["command"]
            for scale in ("full", "pilot")
            for r in recorded(results, scale)[0]
        }
        # A confirmatory cell's record must be of the command it runs now (the pilot's flags were
        # pinned after some of its cells ran, as the configs then were: their records stand).
        moved = [
            c.id
            for c in todo
            if c.study != "pilot" and c.id in done and done[c.id] != shlex.join(c.argv(work))
        ]
        if moved:  # the configs or the cell list changed since: the record is not this cell's
            raise SystemExit(
                f"run: {len(moved)} recorded cells ran another command than they would now "
                f"(first: {moved[0]}); remove their rows from {results} to rerun them"
            )
        todo = [c for c in todo if c.id not in done or _finished(_out(c, work, ()))]
    return study.run_cells(todo, work, jobs, ())


# -- the claims ------------------------------------------------------------------------------------
def power_table() -> list[dict]:
    """Seeds each planned claim needs for 80% power at the first round's spread and effect, at
    the Holm family's smallest level (0.05 / 3) and its largest (0.05)."""
    out = []
    for cid, plan in PLAN.items():
        margin = MARGIN if cid == "C1" else 0.0
        out.append(
            dict(
                id=cid,
                **plan,
                holm_first=stats.seeds_needed(plan["sd"], plan["effect"], 0.05 / 3, margin=margin),
                holm_last=stats.seeds_needed(plan["sd"], plan["effect"], 0.05, margin=margin),
            )
        )
    return out


def _row(spec: ClaimSpec, res: Optional[stats.Result], d: dict[int, float]) -> dict:
    base = dict(id=spec.id, claim=spec.text, kind=spec.test.kind, metric=spec.test.metric, n=len(d))
    if res is None:  # the rules give no verdict yet: a provisional interval from 2 seeds
        why = f"fewer than {stats.MIN_SEEDS} seeds (the rules' minimum) with every cell of it"
        if len(d) < 2:
            return dict(base, verdict="pending", why=why)
        ci = stats.t_interval(list(d.values()))
        return dict(base, mean=ci.mean, ci=[ci.lo, ci.hi], verdict="pending", why=why)
    fields = study.tested_fields(spec, res, list(d.values()))
    return dict(base, **fields, per_seed={str(k): v for k, v in d.items()})


def analyse(rows: list[dict]) -> list[dict]:
    """The gate's and the family's verdicts (Holm over the family, gated by P), then the
    estimates (mean and 95% interval, `verdict` "estimate")."""
    pooled = {s.id: stats.pool(study.unit_differences(rows, s)) for s in CLAIMS}
    out = []
    gate_d = pooled[GATE.id]
    gate = (
        stats.evaluate([(GATE.test, list(gate_d.values()), None)])[0]
        if len(gate_d) >= stats.MIN_SEEDS
        else None
    )
    out.append(_row(GATE, gate, gate_d))
    ready = [s for s in FAMILY if len(pooled[s.id]) >= stats.MIN_SEEDS]
    # Holm over the whole family: a pending claim counts with p = 1 (it lowers no other's p_Holm)
    results = stats.evaluate(
        [(s.test, list(pooled[s.id].values()), None) for s in ready], size=len(FAMILY)
    )
    if gate is None:
        results = [
            stats.replace(r, verdict="pending", why="the gate P is pending") for r in results
        ]
    else:
        results = stats.gatekeep(gate, results)
    done = dict(zip([s.id for s in ready], results))
    out += [_row(s, done.get(s.id), pooled[s.id]) for s in FAMILY]
    for spec, reason in ESTIMATES:
        d = stats.pool(study.unit_differences(rows, spec))
        row = dict(id=spec.id, claim=spec.text, metric=spec.test.metric, n=len(d), left_out=reason)
        if len(d) >= 2:
            ci = stats.t_interval(list(d.values()))
            row.update(mean=ci.mean, ci=[ci.lo, ci.hi], verdict="estimate")
            row["per_seed"] = {str(k): v for k, v in d.items()}
            if spec.test.metric == "acc_ood":  # an out-of-domain baseline must be reachable
                base = study._baseline_mean(rows, spec)
                if base is not None and base < FLOOR:
                    row["left_out"] += f"; its baseline ({base:.3f}) is under the floor {FLOOR}"
        else:
            row["verdict"] = "pending"
        out.append(row)
    return out


def baseline_agreement(rows: list[dict]) -> Optional[float]:
    """The largest difference, over seeds, between the receiver's on-policy runs of the three
    heterogeneous pairs' configs (acc_late): 0 when a pair's on-policy run of the receiver does
    not depend on its peer, as the pairing assumes; None before any seed has two."""
    worst = None
    for seed in sorted({r["seed"] for r in rows}):
        vals = [
            study._value(rows, pair, RECEIVER, "on-policy", seed, "acc_late") for pair in HETERO
        ]
        vals = [v for v in vals if v is not None]
        if len(vals) >= 2:
            worst = max(worst or 0.0, max(vals) - min(vals))
    return worst


# -- tables and the README -------------------------------------------------------------------------
def _fmt(x: Optional[float], signed: bool = True) -> str:
    if x is None:
        return "-"
    return f"{x:+.3f}" if signed else f"{x:.3f}"


def _claim_line(c: dict) -> str:
    if c["verdict"] == "pending":
        ci = f"[{c['ci'][0]:+.3f}, {c['ci'][1]:+.3f}]" if "ci" in c else "-"
        return (
            f"| {c['id']} | {c['claim']} | {c['metric']} | {c['n']} | {_fmt(c.get('mean'))} | "
            f"{ci} | - | - | **pending** |"
        )
    return (
        f"| {c['id']} | {c['claim']} | {c['metric']} | {c['n']} | {c['mean']:+.3f} | "
        f"[{c['ci'][0]:+.3f}, {c['ci'][1]:+.3f}] | {c['p']:.3g} | {c['p_holm']:.3g} | "
        f"**{c['verdict']}** |"
    )


# What the paper reports for each comparison (Qwen2.5 1.5B / 3B, GSM8K, 50 iterations at lr 1e-6):
# its own words and figures, beside ours in `summary`.
PAPER = {
    "P": "NoIS with far-off peers degrades below isolated training (the harm the gate needs)",
    "C3": "F-TIS trains stably where NoIS degrades: F-TIS above NoIS in every heterogeneous pair",
    "C1": "F-TIS converges like on-policy training in every heterogeneous pair",
    "C5": "F-VIS (uncapped weights) collapses late in training",
    "C2": "NoIS degrades below isolated training",
    "C4": "the filter removes the harm of a far-off peer",
    "C6": "out-of-domain gains up to +12 points (3B Coder 0.478 -> 0.590 on MATH-500)",
}


def summary(claims: list[dict]) -> str:
    """One line per claim and estimate the paper makes: our verdict, effect and interval, seeds,
    and the paper's statement beside it."""
    parts = [
        "| id | ours: verdict | effect [95% interval] | seeds | the paper |",
        "|---|---|---|---|---|",
    ]
    for c in claims:
        if c["id"] not in PAPER:
            continue
        effect = (
            f"{c['mean']:+.3f} [{c['ci'][0]:+.3f}, {c['ci'][1]:+.3f}]"
            if c.get("mean") is not None
            else "-"
        )
        parts.append(f"| {c['id']} | {c['verdict']} | {effect} | {c['n']} | {PAPER[c['id']]} |")
    return "\n".join(parts)


def leave_one_out(rows: list[dict]) -> dict[str, dict[str, int]]:
    """Per claim of the gate and the family: how many of the leave-one-seed-out subsets (the
    analysis redone without one seed, for each seed with a finished cell) give each verdict."""
    seeds = sorted({r["seed"] for r in rows})
    out: dict[str, dict[str, int]] = {spec.id: {} for spec in CLAIMS}
    if len(seeds) < 3:
        return out
    for seed in seeds:
        for c in analyse([r for r in rows if r["seed"] != seed]):
            if c["id"] in out:
                out[c["id"]][c["verdict"]] = out[c["id"]].get(c["verdict"], 0) + 1
    return out


def tables(rows: list[dict], claims: list[dict]) -> str:
    n_seeds = len({r["seed"] for r in rows})
    parts = [
        f"### Summary against the paper ({n_seeds} of {len(SEEDS)} seeds)\n",
        summary(claims),
        "",
        f"### Claims ({n_seeds} of {len(SEEDS)} seeds with a finished cell; 95% t intervals of "
        "the per-seed difference)\n",
        "| id | claim | metric | seeds | mean diff | 95% t interval | p | p Holm | verdict |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    tested = {c.id for c in CLAIMS}
    parts += [_claim_line(c) for c in claims if c["id"] in tested]
    loo = leave_one_out(rows)
    if any(loo.values()):
        n = len({r["seed"] for r in rows})
        parts += [
            "",
            f"Leave one seed out ({n} subsets of {n - 1} seeds): "
            + "; ".join(
                f"{cid} " + ", ".join(f"{v} in {k}" for v, k in sorted(counts.items()))
                for cid, counts in loo.items()
            )
            + ".",
        ]
    parts += [
        "",
        "### Estimates (not tested: no verdict)\n",
        "| id | comparison | metric | seeds | mean diff | 95% t interval | why not in the family |",
        "|---|---|---|---|---|---|---|",
    ]
    for c in claims:
        if c["id"] in tested:
            continue
        ci = f"[{c['ci'][0]:+.3f}, {c['ci'][1]:+.3f}]" if "ci" in c else "-"
        parts.append(
            f"| {c['id']} | {c['claim']} | {c['metric']} | {c['n']} | {_fmt(c.get('mean'))} | "
            f"{ci} | {c['left_out']} |"
        )
    agree = baseline_agreement(rows)
    parts += [
        "",
        "The receiver's on-policy runs in the size, expertise and lora configs (one run three "
        "times, if the pairing holds): largest difference in acc_late over the seeds "
        + ("-" if agree is None else f"{agree:.3g}")
        + ".",
        "",
        "### Per node and mode (mean ± sd over seeds)\n",
        "| pair | node | mode | seeds | sample acc, 2nd half | sample acc, last third | acc_id "
        "| acc_ood | CPU-s per cell |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for pair, modes in PAIR_MODES.items():
        for name in (RECEIVER, PEER[pair]):
            for m in modes:
                sel = study._select(rows, study="pairs", group=pair, variant=m, name=name)
                if sel:
                    parts.append(
                        f"| {pair} | {name} | {m} | {len(sel)} | {study._stat(sel, 'acc_late')} | "
                        f"{study._stat(sel, 'acc_last')} | {study._stat(sel, 'acc_id')} | "
                        f"{study._stat(sel, 'acc_ood')} | {study._stat(sel, 'cpu_seconds')} |"
                    )
    return "\n".join(parts)


def _slope(xs: list[float]) -> float:
    """Least-squares change per round of `xs`."""
    n = len(xs)
    mx, my = (n - 1) / 2, statistics.fmean(xs)
    return sum((i - mx) * (x - my) for i, x in enumerate(xs)) / sum((i - mx) ** 2 for i in range(n))


def pilot_table(rows: list[dict], curves: list[dict]) -> str:
    """Per candidate task, mode and node, over the pilot seeds: sampled accuracy at the start
    (rounds 0-4) and the end (the last 5 rounds), its slope over the second half (per 10 rounds),
    the final greedy accuracies (the on-policy cells also at the start), what the filter did, and
    each cell's CPU time. Each column: the mean, then the seeds' values."""
    parts = [
        "| task | mode | node | seeds | sample acc, rounds 0-4 | last 5 rounds | slope, 2nd half "
        "(per 10 rounds) | acc_id start -> final | acc_ood start -> final | received KL "
        "| filter changed (of negative) | CPU-s per cell |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]

    def col(vals) -> str:
        vals = [v for v in vals if v is not None]
        if not vals:
            return "-"
        each = ", ".join(f"{v:.2f}" for v in vals)
        return f"{statistics.fmean(vals):.3f}" + (f" ({each})" if len(vals) > 1 else "")

    for name, pair in CANDIDATES:
        for mode in ("on-policy", "nois", "f-tis"):
            for node in (RECEIVER, PEER[pair]):
                prefix = f"pilot/{pair}-{name}/{mode}/"
                sel = [c for c in curves if c["id"].startswith(prefix) and c["name"] == node]
                rs = [r for r in rows if r["id"].startswith(prefix) and r["name"] == node]
                if not sel:
                    continue
                acc = [c["sample_acc"] for c in sel]
                start = col([statistics.fmean(a[:5]) for a in acc])
                end = col([statistics.fmean(a[-5:]) for a in acc])
                slope = col([10 * _slope(a[len(a) // 2 :]) for a in acc])
                acc_id = (
                    f"{col([r['acc_id_start'] for r in rs])} -> {col([r['acc_id'] for r in rs])}"
                )
                ood = (
                    f"{col([r['acc_ood_start'] for r in rs])} -> {col([r['acc_ood'] for r in rs])}"
                )
                if not all(r["command"].split().count("eval_start=true") for r in rs) or any(
                    "eval_start=false" in r["command"].split() for r in rs
                ):  # no evaluation before the first round
                    acc_id, ood = col([r["acc_id"] for r in rs]), col([r["acc_ood"] for r in rs])
                kl = col([r["metrics"].get("recv_kl_mean") for r in rs])
                changed = col([r["metrics"].get("filter_changed_neg") for r in rs])
                cpu = statistics.fmean(r["cpu_seconds"] for r in rs)
                parts.append(
                    f"| {name} ({pair}) | {mode} | {node} | {len(sel)} | {start} | {end} | "
                    f"{slope} | {acc_id} | {ood} | {kl} | {changed} | {cpu:.0f} |"
                )
    return "\n".join(parts)


def rules_section() -> str:
    """The confirmatory rules, as the code states them (the README's section, before any data)."""
    claim_rows = []
    for spec in CLAIMS:
        if spec.test.kind == "noninferiority":
            test = f"non-inferiority, margin {spec.test.margin:g}"
        else:
            test = f"paired t, predicted sign {'+' if spec.test.sign > 0 else '−'}"
        units = "; ".join(
            f"{p}: {n}, {m} − {bm}" + ("" if bp == p else f" ({bp} config)")
            for p, n, m, bp, bm in spec.units
        )
        role = "gate" if spec is GATE else "family (Holm)"
        claim_rows.append(
            f"| {spec.id} | {role} | {spec.text} | {spec.test.metric} "
            f"({study.METRICS[spec.test.metric]}) | {test} | {units} |"
        )
    power = [
        f"| {p['id']} | {p['sd']:.3f} | {p['effect']:+.3f} | {p['holm_first']} | {p['holm_last']} |"
        for p in power_table()
    ]
    left = [f"- **{spec.id}** ({spec.text}): {reason}." for spec, reason in ESTIMATES]
    return "\n".join(
        [
            stats.RULES,
            stats.RULE_NONINFERIORITY,
            stats.RULE_GATE,
            "",
            f"Unit: sample accuracy (the share of right answers, reward 1, among a node's own "
            f"training samples; the run's format credit is not counted). Margin of C1: "
            f"{MARGIN} in sample accuracy. Seeds: {SEEDS[0]}-{SEEDS[-1]} ({len(SEEDS)}), in "
            f"chunks of {CHUNK_SEEDS}; never seeds 0-9 (the first round) or "
            f"{PILOT_SEEDS[0]}-{PILOT_SEEDS[-1]} (the pilot). The gate is tested alone; the "
            f"family is {', '.join(s.id for s in FAMILY)} under Holm.",
            "",
            "| id | role | claim | metric | test | compared (pair: node, mode − baseline) |",
            "|---|---|---|---|---|---|",
            *claim_rows,
            "",
            "Seeds for 80% power (paired t) at the first round's per-seed spread and effect "
            "(`experiments/results/claims.jsonl`; C1 planned at a true difference of 0), at the "
            "family's smallest Holm level (0.05 / 3) and its largest (0.05):",
            "",
            "| claim | sd | effect | seeds at 0.05 / 3 | seeds at 0.05 |",
            "|---|---|---|---|---|",
            *power,
            "",
            "Left out of the family, reported as estimates with their intervals:",
            "",
            *left,
        ]
    )


RULES_BEGIN, RULES_END = "<!-- confirm-rules:begin -->", "<!-- confirm-rules:end -->"
BEGIN, END = "<!-- confirm:begin -->", "<!-- confirm:end -->"
PILOT_BEGIN, PILOT_END = "<!-- pilot:begin -->", "<!-- pilot:end -->"


def with_recorded(todo: list[Cell], work: Path, old: tuple[list, list]) -> tuple[list, list]:
    """The rows and curves of `todo`'s cells finished under `work`, plus those recorded before
    (`old`, as `recorded` reads them) whose run folders are not here (cells finished on another
    machine stay as recorded), in `todo`'s order, node by node."""
    rows, curves = study.collect(todo, work, ())
    here, ids = {r["id"] for r in rows}, {c.id for c in todo}
    old_rows, old_curves = old
    rows += [r for r in old_rows if r["id"] in ids and r["id"] not in here]
    curves += [c for c in old_curves if c["id"] in ids and c["id"] not in here]
    order = {c.id: i for i, c in enumerate(todo)}
    rows.sort(key=lambda r: (order[r["id"]], r["node"]))
    curves.sort(key=lambda c: (order[c["id"]], c["node"]))
    return rows, curves


def report(scale: str, work: Path, results: Path, readme: Optional[Path]) -> str:
    todo = cells(scale)
    rows, curves = with_recorded(todo, work, recorded(results, scale))
    results.mkdir(parents=True, exist_ok=True)
    files = _result_files(scale)
    if scale == "pilot":
        table = pilot_table(rows, curves) if rows else "(no pilot cell has finished)"
        marks = (PILOT_BEGIN, PILOT_END)
        written = ((files[0], rows), (files[1], curves))
    else:
        claims = analyse(rows)
        written = ((files[0], rows), (files[1], curves), ("claims.jsonl", claims))
        table = tables(rows, claims)
        marks = (BEGIN, END)
    for name, items in written:  # first: they carry the finished cells to the next machine
        (results / name).write_text("".join(json.dumps(x) + "\n" for x in items))
    if scale != "pilot":
        plot_claims(claims, results / "claims.png")
        plot_curves(curves, results / "curves.png")
    (results / f"{scale}.md").write_text(table + "\n")
    if readme is not None and readme.exists():
        text = study._replace(readme.read_text(), *marks, table)
        text = study._replace(text, RULES_BEGIN, RULES_END, rules_section())
        readme.write_text(text)
    return table


# -- plots -----------------------------------------------------------------------------------------
MODE_COLOR = {"on-policy": "black", "nois": "C3", "tis": "C1", "f-tis": "C0", "f-vis": "C2"}


def holm_levels(claims: list[dict]) -> dict[str, float]:
    """The confidence level each family claim is tested at under Holm's step-down: with the
    family's p-values in ascending order (a pending claim's last), the k-th (from 0) at
    1 - 0.05 / (m - k), m the family's size."""
    family = sorted(
        (c for c in claims if c["id"] in {s.id for s in FAMILY} and c.get("p") is not None),
        key=lambda c: c["p"],
    )
    return {c["id"]: 1 - stats.ALPHA / (len(FAMILY) - k) for k, c in enumerate(family)}


def plot_claims(claims: list[dict], path: Path) -> bool:
    """Per claim, each seed's paired difference (a dot) and their mean with its 95% t interval
    (thin); a family claim also with the interval at the level Holm tests it at (thick), the
    non-inferiority margin dashed. The estimates below a line, without verdicts."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    done = [c for c in claims if c.get("per_seed") and c.get("mean") is not None]
    if not done:
        return False
    levels = holm_levels(claims)
    fig, ax = plt.subplots(figsize=(9, 0.55 * len(done) + 1.6))
    colors = {"reproduced": "C2", "contradicted": "C3", "estimate": "C7"}
    for y, c in enumerate(reversed(done)):
        color = colors.get(c["verdict"], "C1")
        d = list(c["per_seed"].values())
        ax.scatter(d, [y + 0.22] * len(d), s=9, color=color, alpha=0.5)
        ax.errorbar(
            [c["mean"]],
            [y],
            xerr=[[c["mean"] - c["ci"][0]], [c["ci"][1] - c["mean"]]],
            fmt="o",
            color=color,
            capsize=3,
            lw=1,
        )
        if c["id"] in levels:
            ci = stats.t_interval(d, levels[c["id"]])
            ax.plot([ci.lo, ci.hi], [y, y], color=color, lw=4, alpha=0.5)
        if c.get("kind") == "noninferiority":
            ax.plot([-c["margin"]] * 2, [y - 0.4, y + 0.4], color="black", ls="--", lw=1)
        ax.annotate(
            f"{c['verdict']} (n={c['n']})", (max(c["ci"][1], max(d)) + 0.005, y), fontsize=7
        )
    ax.axvline(0, color="black", lw=0.8)
    ax.set_yticks(range(len(done)), [f"{c['id']}: {c['metric']}" for c in reversed(done)])
    ax.set_xlabel(
        "per-seed difference (mode - baseline): dots; mean with its 95% t interval\n"
        "thick: at Holm's level (it decides if the gate and the claims before it did); "
        "dashed: C1's margin",
        fontsize=8,
    )
    ax.grid(alpha=0.3, axis="x")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def plot_curves(curves: list[dict], path: Path, key: str = "sample_acc") -> bool:
    """Per pair and node, each mode's `key` per round (5-round means): the mean over seeds and a
    band of its 95% t interval over seeds; no single-run error bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(pair, name) for pair in PAIR_MODES for name in (RECEIVER, PEER[pair])]
    fig, axes = plt.subplots(
        len(PAIR_MODES), 2, figsize=(11, 2.8 * len(PAIR_MODES)), sharex=True, sharey=True
    )
    drawn = False
    for ax, (pair, name) in zip(axes.flat, panels):
        modes = ("on-policy", *PAIR_MODES[pair]) if pair not in HETERO else PAIR_MODES[pair]
        for mode in modes:
            base = "size" if mode == "on-policy" and pair not in HETERO else pair
            if name != RECEIVER and base != pair:
                continue  # the peer of stale / identical has no on-policy run
            sel = study._curves_of(curves, f"pairs/{base}/{mode}/", name)
            if len(sel) < 2:
                continue
            drawn = True
            series = [study.smooth(c[key], study.SMOOTH) for c in sel]
            n = min(len(x) for x in series)
            ci = [stats.t_interval([x[i] for x in series]) for i in range(n)]
            color = MODE_COLOR[mode]
            ax.plot([c.mean for c in ci], color=color, label=f"{mode} ({len(sel)} seeds)")
            ax.fill_between(
                range(n), [c.lo for c in ci], [c.hi for c in ci], color=color, alpha=0.15
            )
        ax.set_title(f"{pair} pair: {name}", fontsize=10)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7, loc="lower right")
    for ax in axes[-1]:
        ax.set_xlabel("round")
    for ax in axes[:, 0]:
        ax.set_ylabel(f"{key} ({study.SMOOTH}-round mean)")
    fig.suptitle("Mean over seeds, band: its 95% t interval over seeds", fontsize=9)
    fig.tight_layout(rect=(0, 0, 1, 0.98))
    if drawn:
        fig.savefig(path, dpi=100)
    plt.close(fig)
    return drawn


def recheck(todo: list[Cell], results: Path, work: Path) -> list[dict]:
    """Rerun recorded cells at the code checked out now, into `work` (not the study's run
    folders), and compare each node's per-round sample accuracy and final accuracies with the
    record: whether a verdict can move between code versions. Appends to recheck.jsonl."""
    rows, curves = recorded(results, "full")
    out = []
    for cell in todo:
        then = {(r["node"]): r for r in rows if r["id"] == cell.id}
        then_curves = {c["node"]: c for c in curves if c["id"] == cell.id}
        if not then:
            raise SystemExit(f"recheck: {cell.id} is not recorded in {results}")
        # A rerun left in `work` by an earlier recheck ran at another commit: run it again.
        shutil.rmtree(study._out(cell, work, ()), ignore_errors=True)
        study.run_cells([cell], work, 1, ())
        now_rows, now_curves = study.collect([cell], work, ())
        for r in now_rows:
            old, new_curve = then[r["node"]], next(c for c in now_curves if c["node"] == r["node"])
            diffs = [
                abs(a - b)
                for a, b in zip(new_curve["sample_acc"], then_curves[r["node"]]["sample_acc"])
            ]
            out.append(
                dict(
                    id=cell.id,
                    node=r["node"],
                    name=r["name"],
                    commit_then=old["environment"].get("commit"),
                    commit_now=r["environment"].get("commit"),
                    max_sample_acc_diff=max(diffs),
                    acc_late=[old["acc_late"], r["acc_late"]],
                    acc_id=[old["acc_id"], r["acc_id"]],
                    acc_ood=[old["acc_ood"], r["acc_ood"]],
                    identical=max(diffs) == 0
                    and old["acc_id"] == r["acc_id"]
                    and old["acc_ood"] == r["acc_ood"],
                )
            )
    with (results / "recheck.jsonl").open("a") as f:
        f.writelines(json.dumps(x) + "\n" for x in out)
    return out


CURVES_BEGIN, CURVES_END = "<!-- curves:begin -->", "<!-- curves:end -->"


def run_curves(args: argparse.Namespace, path: Path, readme: Optional[Path]) -> str:
    """`curve` at each of `args.lr` and at 0 (the control) unless `path` has that run already;
    appends the new runs to `path`, returns `curve_table` of all (and writes it to `readme`)."""
    rows = [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []
    for lr in dict.fromkeys([0.0, *args.lr]):
        key = dict(
            pair=args.pair,
            node=args.node,
            lr=lr,
            seed=args.seed,
            sets=args.set,
            rounds=args.rounds,
            n=args.n,
            every=args.every,
        )
        if any(all(r.get(k) == v for k, v in key.items()) for r in rows):
            continue
        row = curve(
            args.pair,
            args.node,
            lr,
            seed=args.seed,
            rounds=args.rounds,
            every=args.every,
            n=args.n,
            sets=tuple(args.set),
        )
        rows.append(row)
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a") as f:
            f.write(json.dumps(row) + "\n")
    table = curve_table(rows)
    if readme is not None and readme.exists():
        readme.write_text(study._replace(readme.read_text(), CURVES_BEGIN, CURVES_END, table))
    return table


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m experiments.confirm", description=__doc__.split("\n")[0]
    )
    p.add_argument(
        "action", choices=("run", "report", "list", "estimate", "probe", "curve", "recheck")
    )
    p.add_argument("--scale", choices=("full", "pilot"), default="full")
    p.add_argument(
        "--chunk",
        type=int,
        metavar="K",
        help=f"run the K-th chunk of {CHUNK_SEEDS} seeds only (1-{len(chunks())})",
    )
    p.add_argument("--only", action="append", metavar="GLOB", help="cell ids to run (repeatable)")
    p.add_argument("--jobs", type=int, default=2, help="cells run at once (default 2)")
    p.add_argument(
        "--work",
        type=Path,
        default=None,
        help="run folders (default experiments/runs-confirm; recheck: experiments/runs-recheck)",
    )
    p.add_argument("--results", type=Path, default=None, help="default experiments/results/confirm")
    p.add_argument("--readme", default=None, help="'none' to leave experiments/README.md as it is")
    p.add_argument(
        "--probe",
        nargs=5,
        type=float,
        metavar=("FEWEST", "MOST", "OPERAND_MAX", "WARMUP_STEPS", "FORMAT"),
        default=(2, 3, OPERAND_MAX, 300, 0.8),
        help="probe: the task (steps, largest operand) and the warm-up (steps, share in "
        "GSM8K's format) to measure",
    )
    p.add_argument("--seed", type=int, default=PILOT_SEEDS[0], help="probe, curve: the seed")
    p.add_argument("--pair", default="size", help="curve: the config (configs/confirm/PAIR.yaml)")
    p.add_argument("--node", default=RECEIVER, help="curve: the node of the pair that trains")
    p.add_argument(
        "--lr", type=float, nargs="+", default=[2e-4], help="curve: learning rates (0 runs too)"
    )
    p.add_argument("--rounds", type=int, default=ROUNDS, help="curve: rounds")
    p.add_argument("--every", type=int, default=10, help="curve: greedy evaluation every K rounds")
    p.add_argument("--n", type=int, default=256, help="curve: test problems per evaluation")
    p.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="curve: over the config"
    )
    args = p.parse_args(argv)
    if args.action == "estimate":  # the full study's chunks, every one: no selection applies
        for flag, given in (
            ("--scale", args.scale != "full"),
            ("--chunk", args.chunk is not None),
            ("--only", bool(args.only)),
        ):
            if given:
                p.error(f"{flag}: estimate covers every chunk of the full study; drop {flag}")
    study_work = HERE / "runs-confirm"
    if args.action == "recheck" and args.work and args.work.resolve() == study_work.resolve():
        p.error(f"--work: recheck reruns cells away from the study's run folders ({study_work})")
    if args.action == "probe":
        lo, hi, high, warm, fmt = args.probe
        print(json.dumps(probe((int(lo), int(hi)), int(high), int(warm), fmt, args.seed)))
        return 0
    work = args.work or study_work
    results = args.results or HERE / "results" / "confirm"
    readme = None if args.readme == "none" else Path(args.readme or HERE / "README.md")
    if args.action == "curve":
        print(run_curves(args, results / "lr_curves.jsonl", readme))
        return 0
    if args.chunk is not None:
        if args.scale != "full" or not 1 <= args.chunk <= len(chunks()):
            raise SystemExit(
                f"--chunk: expected 1-{len(chunks())} with --scale full, got {args.chunk}"
            )
        todo = cells("full", chunks()[args.chunk - 1])
    else:
        todo = cells(args.scale)
    if args.only:
        todo = [c for c in todo if any(fnmatch.fnmatchcase(c.id, g) for g in args.only)]
        if not todo:
            raise SystemExit(f"--only: no cell matches {args.only}; see `list`")
    if args.action == "list":
        for c in todo:
            print(f"{c.id:40s} {shlex.join(c.argv(work))}")
        return 0
    if args.action == "recheck":
        if not args.only:
            raise SystemExit("recheck: name the cells with --only (e.g. 'pairs/size/f-tis/s10')")
        for x in recheck(todo, results, args.work or HERE / "runs-recheck"):
            print(json.dumps(x))
        return 0
    if args.action == "estimate":
        print(estimate(work, results))
        return 0
    if args.action == "run" and args.scale == "full" and not FROZEN:
        raise SystemExit(
            "run: the task is not frozen yet (experiments/README.md, the pilot): no confirmatory "
            "seed may run before it is; set FROZEN in experiments/confirm.py when it is"
        )
    rc = run(todo, work, args.jobs, results) if args.action == "run" else 0
    print(report(args.scale, work, results, readme))
    return rc


if __name__ == "__main__":
    sys.exit(main())
