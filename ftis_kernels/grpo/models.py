"""Node models: tiny Qwen2-style presets with a supervised warm-up, local checkpoints, LoRA.

A preset model is built from a `Qwen2Config` (no weights can be downloaded) over the project's
tokenizer and warmed up with a short supervised run on the task, so that GRPO starts from a
non-zero reward like a base model does. Different architectures give different sizes; a different
warm-up (seed, length, operations seen) gives a different "expertise". `--model PATH` loads any
local Hugging Face causal LM and its tokenizer instead.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import math
import os
import random
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Optional

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

from ftis_kernels.grpo.schema import ARCHS
from ftis_kernels.grpo.task import ArithmeticTask, format_prompt, make_prompt_id

log = logging.getLogger(__name__)

# Warm-up problems live far above any index a GRPO run reaches.
_WARMUP_INDEX_BASE = 1 << 40


def build_model(arch: str, tokenizer, seed: int) -> Qwen2ForCausalLM:
    """A freshly initialised Qwen2-style causal LM of preset size `arch` over `tokenizer`."""
    if arch not in ARCHS:
        raise ValueError(f"arch: expected one of {tuple(ARCHS)}, got {arch!r}")
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        max_position_embeddings=256,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.eos_token_id,
        **ARCHS[arch],
    )
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)
    return model.float()


def load_pretrained(path: str):
    """(model, tokenizer) from a local Hugging Face checkpoint folder, in float32."""
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    return model, tokenizer


def apply_lora(model, r: int, alpha: float, seed: int = 0):
    """Wrap `model` in a peft LoRA adapter on every linear layer; only the adapter trains.
    The adapter's random init (its A matrices) draws from `seed`."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=r, lora_alpha=alpha, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM"
    )
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return get_peft_model(model, config)


def warmup_cache_file(cache_dir: str, arch: str, **warmup: Any) -> Path:
    """Where the weights after a warm-up are cached: a file named by the hash of everything the
    warm-up depends on (`warmup`: the architecture's init seed, steps, lr, data, vocabulary...)."""
    key = json.dumps(dict(arch=arch, version=1, **warmup), sort_keys=True)
    return Path(cache_dir) / f"{arch}-{hashlib.sha256(key.encode()).hexdigest()[:16]}.pt"


def warm_up(
    model,
    tokenizer,
    task: ArithmeticTask,
    *,
    steps: int,
    lr: float,
    batch_size: int,
    seed: int,
    operations: Sequence[str],
    gsm8k_format: float = 1.0,
    on_step: Optional[Callable[[int, float], None]] = None,
) -> float:
    """Supervised next-token training on worked answers ('7+5=12. #### 12<eos>'); returns last loss.

    Only completion tokens are scored. Problems come from the train split restricted to
    `operations`, drawn from `seed`; a share `gsm8k_format` of the answers ends in GSM8K's
    '#### x', the rest in 'The answer is x.', like a base model that only sometimes follows the
    format. Together they are the node's expertise. `on_step(step, loss)` follows the progress
    (a progress bar); without it, the loss is logged at every quarter of the steps.
    """
    if steps <= 0:
        return math.nan
    rng = random.Random(f"warmup:{seed}")
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / 20) * 0.5 * (1 + math.cos(math.pi * s / steps))
    )
    model.train()
    loss_value = math.nan
    for step in range(steps):
        rows, labels = [], []
        for _ in range(batch_size):
            index = _WARMUP_INDEX_BASE + rng.randrange(1 << 30)
            problem = task.problem(make_prompt_id("train", index), operations=operations)
            prompt = tokenizer(format_prompt(problem.question))["input_ids"]
            styled = task.target(problem, gsm8k_format=rng.random() < gsm8k_format)
            target = tokenizer(styled)["input_ids"] + [tokenizer.eos_token_id]
            rows.append(prompt + target)
            labels.append([-100] * len(prompt) + target)
        width = max(len(r) for r in rows)
        pad = tokenizer.pad_token_id
        input_ids = torch.tensor([r + [pad] * (width - len(r)) for r in rows])
        label_ids = torch.tensor([lab + [-100] * (width - len(lab)) for lab in labels])
        attention = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
        loss = model(input_ids=input_ids, attention_mask=attention, labels=label_ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        loss_value = loss.item()
        if on_step is not None:
            on_step(step + 1, loss_value)
        elif (step + 1) % max(1, steps // 4) == 0:  # without a progress bar, 4 log lines
            log.info("warm-up step %d/%d: loss %.3f", step + 1, steps, loss_value)
    return loss_value


def warm_up_cached(
    model, tokenizer, task: ArithmeticTask, cache_file: Optional[Path], **recipe: Any
) -> Optional[float]:
    """`warm_up(model, tokenizer, task, **recipe)`, or with `cache_file` (from `warmup_cache_file`)
    the weights an identical warm-up saved there. Returns the final warm-up loss, or None when the
    weights were loaded.

    Runs started at once share the cache: an exclusive file lock lets one process warm up while
    the others wait for its file and load it.
    """
    if cache_file is None:
        return warm_up(model, tokenizer, task, **recipe)
    cache_file.parent.mkdir(parents=True, exist_ok=True)
    with open(cache_file.with_name(cache_file.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if cache_file.exists():
            model.load_state_dict(torch.load(cache_file, weights_only=True))
            return None
        loss = warm_up(model, tokenizer, task, **recipe)
        tmp = cache_file.with_name(f"{cache_file.name}.{os.getpid()}.tmp")
        torch.save(model.state_dict(), tmp)
        os.replace(tmp, cache_file)
        return loss
