"""FTISGRPOTrainer with ftis_linear_loss under accelerate's multi-process launch (DDP over gloo,
2 CPU processes): the trainer's loss on each process's half of a fixed global batch, backward
through the accelerator and one SGD step give the losses, updated weights and TRL's token-mean
metrics (entropy, kl) of one process on the whole batch.

Run by the test as `python tests/test_trl_ddp.py MODEL_DIR OUT` (one process) and under
`torchrun --nproc_per_node 2`; TRL's generation is left out (its sampling differs with the
process count): the batch is fixed.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest
import torch

B, PROMPT, COMPLETION = 4, 5, 6
LR = 0.5


def _batch(V: int) -> dict:
    g = torch.Generator().manual_seed(0)
    lengths = torch.tensor([6, 3, 5, 1])
    return {
        "prompt_ids": torch.randint(2, V, (B, PROMPT), generator=g),
        "prompt_mask": torch.ones(B, PROMPT, dtype=torch.long),
        "completion_ids": torch.randint(2, V, (B, COMPLETION), generator=g),
        "completion_mask": (torch.arange(COMPLETION)[None] < lengths[:, None]).long(),
        "advantages": torch.randn(B, generator=g),
        "old_per_token_logps": -torch.rand(B, COMPLETION, generator=g) * 4 - 1,
        "ref_per_token_logps": -torch.rand(B, COMPLETION, generator=g) * 4 - 1,
        "num_items_in_batch": lengths.sum(),
    }


def _trainer(model_dir: str, out: str, world: int, **engine):
    """The FTISGRPOTrainer both multi-process tests drive: the tiny model in model_dir, B // world
    samples per process, the filter on; `engine` overrides config fields (DeepSpeed's)."""
    from datasets import Dataset
    from transformers import AutoTokenizer

    from ftis_kernels.integrations.trl import FTISGRPOConfig, FTISGRPOTrainer
    from tests.test_trl_integration import CHECKPOINTING, PROMPTS, _vowel_reward

    args = FTISGRPOConfig(
        output_dir=os.path.dirname(out),
        **{"use_cpu": True, **engine},
        report_to="none",
        bf16=False,
        per_device_train_batch_size=B // world,
        num_generations=2,
        max_completion_length=COMPLETION,
        seed=0,
        filter="negative_offpolicy",
        kl_threshold=0.5,
        **{CHECKPOINTING: False},
    )
    return FTISGRPOTrainer(
        model=model_dir,
        reward_funcs=_vowel_reward,
        args=args,
        train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
        processing_class=AutoTokenizer.from_pretrained(model_dir),
    )


def _leave() -> None:
    """Ends a worker once its results are written and every rank has them: destroys the process
    group, then exits at once, before the worker's locals are freed. Left to the interpreter,
    gloo's teardown hung or crashed after the work was done: once "terminate called without an
    active exception" (SIGABRT on one rank); once a rank hung until the 300 s timeout, its main
    thread holding the GIL while freeing the DDP model (its reducer held the group's last
    reference, whose destructor joins gloo's threads) and gloo's thread waiting for the GIL to
    free a finished all-gather's tensor."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _local_batch(trainer, world: int) -> dict:
    """Puts the trainer in training mode (one micro-batch per step) and returns this process's
    rows of the fixed global batch."""
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    rank = trainer.accelerator.process_index
    rows = slice(rank * B // world, (rank + 1) * B // world)
    V = trainer.model.config.vocab_size
    return {k: (v[rows] if v.dim() else v) for k, v in _batch(V).items()}


def _worker(model_dir: str, out: str) -> None:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    trainer = _trainer(model_dir, out, world, beta=0.1)  # ref_per_token_logps: TRL's kl metric
    accelerator = trainer.accelerator
    assert accelerator.num_processes == world
    model = accelerator.prepare_model(trainer.model)
    assert (world > 1) == (model is not accelerator.unwrap_model(model))
    inputs = _local_batch(trainer, world)
    loss = trainer.compute_loss(model, inputs)
    accelerator.backward(loss)
    losses = accelerator.gather(loss.detach()[None])
    with torch.no_grad():
        updated = {n: p - LR * p.grad for n, p in trainer.model.named_parameters()}
    if accelerator.is_main_process:
        logged = {k: trainer._metrics["train"][k] for k in ("entropy", "kl")}
        torch.save({"loss": losses.mean(), "weights": updated, "logged": logged}, out)
    accelerator.wait_for_everyone()
    _leave()


def _bad_worker(model_dir: str, out: str) -> None:
    """Rank 1's batch fails the value check (a NaN advantage): every rank raises in the loss,
    none waits in the backward's all-reduce for the others; each writes its error."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    trainer = _trainer(model_dir, out, world)
    model = trainer.accelerator.prepare_model(trainer.model)
    inputs = _local_batch(trainer, world)
    rank = trainer.accelerator.process_index
    if rank == 1:
        inputs["advantages"] = inputs["advantages"].clone()
        inputs["advantages"][0] = float("nan")
    try:
        trainer.accelerator.backward(trainer.compute_loss(model, inputs))
        error = ""
    except ValueError as exc:
        error = str(exc)
    with open(f"{out}.{rank}", "w") as f:
        f.write(error)
    _leave()


def _launch(P: int, model_dir: str, out: str, *mode: str, timeout: int = 300) -> dict:
    env = dict(os.environ, PYTHONPATH=os.getcwd(), OMP_NUM_THREADS="1")
    with socket.socket() as s:  # torchrun's --master_port=0 does not rendezvous here
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # As a module, not a script path: a script puts tests/ first on sys.path, where its folders
    # would shadow packages a dependency imports.
    command = [sys.executable, "-m", "tests.test_trl_ddp", model_dir, out, *mode]
    if P > 1:  # the reference is one plain process: the trainer's unwrapped-model path
        launcher = ["-m", "torch.distributed.run", f"--nproc_per_node={P}", f"--master_port={port}"]
        command[1:1] = launcher
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-4000:]
    return {} if mode else torch.load(out)


def _model_dir(tmp_path) -> str:
    """The tiny model and its tokenizer saved for the workers."""
    pytest.importorskip("trl")
    from tests.test_trl_integration import _tiny_qwen2, _tokenizer

    model_dir = tmp_path / "model"
    tok = _tokenizer()
    _tiny_qwen2(len(tok), seed=0).save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    return str(model_dir)


def test_two_ddp_processes_give_the_single_process_loss_and_weights(tmp_path):
    model_dir = _model_dir(tmp_path)
    from tests.test_trl_integration import _tiny_qwen2, _tokenizer

    tok = _tokenizer()
    single = _launch(1, model_dir, str(tmp_path / "one.pt"))
    ddp = _launch(2, model_dir, str(tmp_path / "two.pt"))
    torch.testing.assert_close(ddp["loss"], single["loss"], rtol=1e-6, atol=1e-7)
    # TRL's entropy and kl: token means over every process's tokens (the halves hold 9 and 6).
    torch.testing.assert_close(ddp["logged"], single["logged"], rtol=1e-6, atol=1e-7)
    for name, want in single["weights"].items():
        torch.testing.assert_close(ddp["weights"][name], want, rtol=1e-6, atol=1e-7, msg=name)
    base = _tiny_qwen2(len(tok), seed=0).state_dict()
    moved = sum(not torch.equal(base[n], w) for n, w in single["weights"].items() if n in base)
    assert moved > 0  # the step moved the weights: the comparison is not vacuous


def test_a_bad_batch_on_one_process_raises_on_every_process(tmp_path):
    out = str(tmp_path / "bad")
    _launch(2, _model_dir(tmp_path), out, "bad", timeout=120)  # a rank left waiting: TimeoutExpired
    errors = [open(f"{out}.{rank}").read() for rank in (0, 1)]
    assert errors[1].startswith("advantages: "), errors
    assert errors[0].startswith("value check: another process's batch failed it"), errors


if __name__ == "__main__":
    worker = _bad_worker if sys.argv[3:] == ["bad"] else _worker
    worker(sys.argv[1], sys.argv[2])  # exits through _leave
