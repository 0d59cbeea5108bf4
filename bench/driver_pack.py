"""The GRPO driver's training step on packed vs padded micro-batches: training tokens/s, peak
memory and padding fraction, side by side in one process on the demo preset.

    python -m bench.driver_pack [--rounds 4] [--row-tokens 128 256] [--threads 1]
                                [--warmup-cache DIR] [--json PATH]

The demo's three nodes are built and warmed up as `ftis-grpo --preset demo` builds them (through
`Node`, on a one-process gloo group; `--warmup-cache` reuses warm-ups). Each round every node
samples its 64 completions and each node's batch is all 192 (its own and its peers', as in the
demo's vertical exchange). Every layout trains its own copy of each node's model (AdamW, the
demo's learning rates), in rotating order within a round, so a busy machine slows all alike.

Figures per layout: training tokens/s (completion tokens, the tokens the loss trains on, and all
real prompt + completion tokens, per second of `grpo_update`); the padding fraction (pad positions
/ all positions the model runs on); the peak memory of one step on the last round's batch, as the
rise of the resident-set high-water mark over the resident set before the step
(`bench.measure.peak_extra_bytes`: VmHWM after /proc/self/clear_refs), each in a fresh process
whose glibc serves every block of 64 KiB or more by mmap, so that freed memory leaves the resident
set (in a long-lived process the heap's reuse hides most of a step). The model, its optimizer
state and the batch are held before the step and not counted.
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from bench.measure import cpu_rss_supported, metadata, peak_extra_bytes
from ftis_kernels.grpo.config import build_config
from ftis_kernels.grpo.node import Node
from ftis_kernels.grpo.train import build_batch, build_packed_batch, grpo_update
from ftis_kernels.grpo.transport import TorchTransport


def layout_positions(samples, node: Node, row_tokens) -> int:
    """Token positions the model runs on for `samples` in one layout, summed over micro-batches."""
    total, step, cpu = 0, node.cfg.micro_batch, torch.device("cpu")
    for start in range(0, len(samples), step):
        chunk = samples[start : start + step]
        if row_tokens is None:
            total += build_batch(chunk, node.prompt_tokens, 0, cpu)["input_ids"].numel()
        else:
            total += build_packed_batch(chunk, node.prompt_tokens, 0, cpu, row_tokens)[
                "input_ids"
            ].numel()
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=4, help="timed rounds")
    parser.add_argument(
        "--row-tokens", type=int, nargs="+", default=[128], help="packed row lengths to compare"
    )
    parser.add_argument("--threads", type=int, default=1, help="torch threads (the demo: 1)")
    parser.add_argument("--warmup-cache", default=None, help="folder of cached warm-ups")
    parser.add_argument("--json", default=None, help="also write the figures here")
    parser.add_argument("--peak-of", default=None, help=argparse.SUPPRESS)  # a child's state
    args = parser.parse_args()
    if args.peak_of:
        print(peak_step(Path(args.peak_of), args.row_tokens[0] or None))
        return
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    with tempfile.TemporaryDirectory(prefix="driver_pack_") as out:
        run(args, out)
    dist.destroy_process_group()


def run(args: argparse.Namespace, out: str) -> None:
    """Build, warm up and time the nodes (the module docstring); `out` holds their checkpoints."""
    layouts = {"padded": None} | {f"packed {n}": n for n in args.row_tokens}
    demo = build_config(preset="demo")
    nodes, copies = [], {}
    for k, spec in enumerate(demo.nodes):
        cfg = build_config(
            preset="demo",
            overrides=dict(out=f"{out}/{k}", progress=False, warmup_cache=args.warmup_cache),
        )
        cfg.nodes = [spec]
        node = Node(cfg, 0, 1, torch.device("cpu"), TorchTransport())
        t0 = time.time()
        node.build()
        node.prepare()
        print(f"node {spec.name}: ready in {time.time() - t0:.0f} s", flush=True)
        nodes.append(node)
        for name in layouts:
            model = copy.deepcopy(node.model)
            params = [p for p in model.parameters() if p.requires_grad]
            copies[k, name] = (model, torch.optim.AdamW(params, lr=spec.lr, weight_decay=0.0))

    def step(k: int, name: str, batch) -> float:
        node, (model, optimizer) = nodes[k], copies[k, name]
        t0 = time.perf_counter()
        grpo_update(
            model,
            optimizer,
            batch,
            node.prompt_tokens,
            node.options,
            micro_batch=node.cfg.micro_batch,
            pad_id=node.tokenizer.pad_token_id,
            grad_clip=node.cfg.grad_clip,
            device=node.device,
            pack_row_tokens=layouts[name],
        )
        return time.perf_counter() - t0

    loads = [os.getloadavg()[0]]
    rec = {(k, n): dict(seconds=0.0, completion=0, real=0, positions=0) for k, n in copies}
    names = list(layouts)
    batches = []
    for r in range(args.rounds):
        own = [node.rollout(r) for node in nodes]
        batches = [
            own[k] + [s for j, theirs in enumerate(own) if j != k for s in theirs]
            for k in range(len(nodes))
        ]
        for k, batch in enumerate(batches):
            order = names[r % len(names) :] + names[: r % len(names)]
            for name in order:
                n = rec[k, name]
                n["seconds"] += step(k, name, batch)
                n["completion"] += sum(s.n_tokens for s in batch)
                n["real"] += sum(
                    len(nodes[k].prompt_tokens(s.prompt_id)) + s.n_tokens for s in batch
                )
                n["positions"] += layout_positions(batch, nodes[k], layouts[name])
        loads.append(os.getloadavg()[0])
        print(f"round {r + 1}/{args.rounds} timed (load {loads[-1]:.1f})", flush=True)
    peaks = {key: 0 for key in copies}
    if cpu_rss_supported():
        for k, batch in enumerate(batches):
            state = Path(out) / f"peak_{k}.pt"
            torch.save(
                dict(
                    model=nodes[k].model,
                    lr=demo.nodes[k].lr,
                    samples=batch,
                    prompts={s.prompt_id: nodes[k].prompt_tokens(s.prompt_id) for s in batch},
                    options=nodes[k].options,
                    micro_batch=nodes[k].cfg.micro_batch,
                    grad_clip=nodes[k].cfg.grad_clip,
                    pad_id=nodes[k].tokenizer.pad_token_id,
                ),
                state,
            )
            for name in names:
                peaks[k, name] = peak_in_a_fresh_process(state, layouts[name])
    for name in names:  # the three nodes together
        mine = [rec[k, name] for k in range(len(nodes))]
        rec["all", name] = {key: sum(n[key] for n in mine) for key in mine[0]}
        peaks["all", name] = max(peaks[k, name] for k in range(len(nodes)))
    rows = [
        dict(
            node="all (max peak)" if k == "all" else demo.nodes[k].name,
            layout=name,
            completion_tokens_per_s=n["completion"] / n["seconds"],
            real_tokens_per_s=n["real"] / n["seconds"],
            padding_fraction=1 - n["real"] / n["positions"],
            peak_mib=peaks[k, name] / 2**20,
            seconds_per_step=n["seconds"] / args.rounds,
        )
        for (k, name), n in rec.items()
    ]
    print_table(rows)
    record = dict(
        metadata(torch.device("cpu")),
        bench="driver_pack",
        rounds=args.rounds,
        threads=args.threads,
        loadavg_1min_per_round=loads,
        rows=rows,
    )
    if args.json:
        Path(args.json).write_text(json.dumps(record, indent=1) + "\n")


def peak_in_a_fresh_process(state: Path, row_tokens) -> int:
    """`peak_step(state, row_tokens)` in a fresh process whose glibc serves every block of 64 KiB
    or more by mmap from the start, so that its resident set follows its live allocations."""
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", OMP_NUM_THREADS="1")
    command = [sys.executable, "-m", "bench.driver_pack", "--peak-of", str(state)]
    command += ["--row-tokens", str(row_tokens or 0)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
    return int(done.stdout.split()[-1])


def peak_step(state: Path, row_tokens: Optional[int]) -> int:
    """Peak bytes of the second training step on the batch saved in `state` (`main`), over the
    resident set before it: the first allocates the optimizer's state and lazy buffers."""
    torch.set_num_threads(1)
    saved = torch.load(state, weights_only=False)
    model = saved["model"]
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=saved["lr"], weight_decay=0.0)
    step = functools.partial(
        grpo_update,
        model,
        optimizer,
        saved["samples"],
        saved["prompts"].__getitem__,
        saved["options"],
        micro_batch=saved["micro_batch"],
        pad_id=saved["pad_id"],
        grad_clip=saved["grad_clip"],
        device=torch.device("cpu"),
        pack_row_tokens=row_tokens,
    )
    step()
    return peak_extra_bytes(step, torch.device("cpu"))


def print_table(rows: list[dict]) -> None:
    head = "| node | layout | completion tok/s | all tok/s | padding | peak MiB | s/step |"
    print(head)
    print("|" + "---|" * 7)
    for row in rows:
        print(
            f"| {row['node']} | {row['layout']} | {row['completion_tokens_per_s']:.0f} | "
            f"{row['real_tokens_per_s']:.0f} | {100 * row['padding_fraction']:.1f}% | "
            f"{row['peak_mib']:.1f} | {row['seconds_per_step']:.2f} |"
        )


if __name__ == "__main__":
    main()
