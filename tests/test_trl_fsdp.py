"""FTISGRPOTrainer with ftis_linear_loss under FSDP2 and DeepSpeed ZeRO-2/3, 2 CPU processes over
gloo. As in tests/test_trl_ddp.py, the trainer's loss on each process's half of a fixed global
batch, the backward and one SGD step give the loss, the pi_old log-probabilities and the updated
weights of one plain process on the whole batch, for an lm-head tied to the input embedding
(Qwen2's tiny configs) and an untied one.

What runs on this CPU machine (torch 2.13 CPU, accelerate 1.15):
- FSDP2: torch's `fully_shard` runs on a CPU device mesh over gloo. accelerate does not enable
  FSDP on CPU (with `use_cpu` it drops the FSDP plugin and wraps the model in DDP; without,
  transformers' Trainer refuses FSDP outside distributed training), so the worker shards the
  trainer's model itself: "fsdp2" with `fully_shard` (the lm-head resharded after its forward,
  so that the loss all-gathers it), "fsdp2-accelerate" with accelerate's own
  `fsdp2_prepare_model` (its [norm, lm_head] group, kept gathered after the forward; the
  embedding apart or, tied, in that group), as accelerate's FSDP2 plugin does on GPUs.
- FSDP1 with ftis_op="ftis_loss" (the fused loss refuses it): `FullyShardedDataParallel` on the
  CPU, applied by the worker as well.
- DeepSpeed ZeRO-2 and -3 (deepspeed 0.19.8, `DS_ACCELERATOR=cpu`, gloo): run through
  accelerate once its state is made before the trainer with `PartialState(backend="gloo")`
  (without it, accelerate finds no backend on a CPU-only machine and counts one process).
  deepspeed is not installed here (nor in CI: it must be built from source against the
  installed torch), so those cases are skipped unless it is importable, e.g. from a venv that
  keeps the torch in place:

      python -m venv --system-site-packages /tmp/ds && /tmp/ds/bin/pip install wheel hjson \\
          ninja py-cpuinfo msgpack einops && DS_BUILD_OPS=0 /tmp/ds/bin/pip install --no-deps \\
          --no-build-isolation deepspeed==0.19.8
      /tmp/ds/bin/python -m pytest tests/test_trl_fsdp.py

Run by the test as `python tests/test_trl_fsdp.py MODE MODEL_DIR OUT`, one process for
MODE=single and under torchrun otherwise.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from tests.test_trl_ddp import LR, _leave, _local_batch, _trainer

SHARDED_MODES = ("fsdp2", "fsdp2-accelerate", "zero3")
MODES = (*SHARDED_MODES, "zero2")  # ZeRO-2 keeps whole parameters and partitions the gradients


def _shard_fsdp2(model, world: int) -> None:
    """`fully_shard` on each decoder layer, on the lm-head as a group of its own that reshards
    after its forward (tied: with the embedding), so that the loss must gather it again, and on
    the root."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    head, embedding = model.lm_head, model.model.embed_tokens
    group = [embedding, head] if head.weight is embedding.weight else head
    fully_shard(group, mesh=mesh, reshard_after_forward=True)
    fully_shard(model, mesh=mesh)


def _shard_fsdp2_accelerate(model, world: int) -> None:
    from accelerate import FullyShardedDataParallelPlugin
    from accelerate.utils.fsdp_utils import fsdp2_prepare_model
    from torch.distributed.device_mesh import init_device_mesh

    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2, auto_wrap_policy="transformer_based_wrap", reshard_after_forward=True
    )
    # The Accelerator attributes fsdp2_prepare_model reads, as a GPU run with this plugin sets them.
    accelerator = SimpleNamespace(
        state=SimpleNamespace(fsdp_plugin=plugin),
        torch_device_mesh=init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard",)),
        parallelism_config=SimpleNamespace(fsdp_dim_names=("dp_shard",)),
        mixed_precision="no",
        is_main_process=int(os.environ["RANK"]) == 0,
        device=torch.device("cpu"),
    )
    assert fsdp2_prepare_model(accelerator, model) is model


def _whole(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def _worker(mode: str, model_dir: str, out: str) -> None:
    from accelerate import PartialState

    world = int(os.environ.get("WORLD_SIZE", "1"))
    engine = {}
    if mode.startswith("zero"):
        os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
        PartialState(backend="gloo")
        engine = dict(
            use_cpu=False,
            accelerator_config={"use_configured_state": True},
            deepspeed={
                "train_micro_batch_size_per_gpu": "auto",
                "gradient_accumulation_steps": "auto",
                "zero_optimization": {"stage": int(mode[-1])},
                "zero_allow_untested_optimizer": True,
            },
        )
    trainer = _trainer(model_dir, out, world, **engine)
    accelerator = trainer.accelerator
    assert accelerator.num_processes == world
    model = trainer.model
    if mode == "fsdp2":
        _shard_fsdp2(model, world)
    elif mode == "fsdp2-accelerate":
        _shard_fsdp2_accelerate(model, world)
    elif mode.startswith("zero"):
        optimizer = torch.optim.SGD(model.parameters(), lr=LR)
        model, optimizer = accelerator.prepare(model, optimizer)
    head = trainer.model.get_output_embeddings().weight  # this process's shard
    assert hasattr(head, "placements") == mode.startswith("fsdp2")  # a DTensor
    assert (head.numel() == 0) == (mode == "zero3")  # a ZeRO-3 partition lives in head.ds_tensor
    inputs = _local_batch(trainer, world)
    logps = _completion_logps(trainer, model, inputs)
    loss = trainer.compute_loss(model, inputs)
    if mode.startswith("zero"):
        accelerator.backward(loss)  # DeepSpeed's backward and optimizer step
        import deepspeed

        params = dict(trainer.model.named_parameters())
        with deepspeed.zero.GatheredParameters(list(params.values())):
            updated = {n: p.detach().clone() for n, p in params.items()}
    else:
        loss.backward()
        with torch.no_grad():
            updated = {
                n: _whole(p) - LR * _whole(p.grad) for n, p in trainer.model.named_parameters()
            }
    result = {
        "loss": accelerator.gather(loss.detach()[None]).mean(),
        "logps": accelerator.gather(logps),
        "weights": updated,
    }
    if accelerator.is_main_process:
        torch.save(result, out)
    accelerator.wait_for_everyone()
    _leave()


def _completion_logps(trainer, model, inputs) -> torch.Tensor:
    """TRL's per-token log-probabilities of the batch's completions under `model`."""
    T = inputs["completion_ids"].shape[1]
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
    attention = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
    return trainer._get_per_token_logps_and_entropies(model, ids, attention, T)[0]


def _fsdp1_worker(model_dir: str, out: str) -> None:
    """FSDP1 (`FullyShardedDataParallel`, its parameters flattened) with ftis_op="ftis_loss", the
    configuration docs/integrations.md gives for it: the pi_old pass and the loss."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    world = int(os.environ.get("WORLD_SIZE", "1"))
    trainer = _trainer(model_dir, out, world, ftis_op="ftis_loss")
    model = FullyShardedDataParallel(
        trainer.model, device_id=torch.device("cpu"), use_orig_params=True
    )
    inputs = _local_batch(trainer, world)
    logps = _completion_logps(trainer, model, inputs)
    loss = trainer.compute_loss(model, inputs)
    loss.backward()
    accelerator = trainer.accelerator
    with FullyShardedDataParallel.summon_full_params(model, with_grads=True):
        updated = {n: p.detach() - LR * p.grad for n, p in trainer.model.named_parameters()}
    result = {
        "loss": accelerator.gather(loss.detach()[None]).mean(),
        "logps": accelerator.gather(logps),
        "weights": updated,
    }
    trainer.args.ftis_op = "ftis_linear_loss"  # the fused pass: refused on every process
    try:
        _completion_logps(trainer, model, inputs)
    except ValueError as exc:
        result["refused"] = str(exc)
    if accelerator.is_main_process:
        torch.save(result, out)
    accelerator.wait_for_everyone()
    _leave()


def _launch(mode: str, model_dir: str, out: str) -> dict:
    env = dict(os.environ, PYTHONPATH=os.getcwd(), OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu")
    with socket.socket() as s:  # torchrun's --master_port=0 does not rendezvous here
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # As a module, not a script path: a script puts tests/ first on sys.path, where its folders
    # would shadow packages a dependency imports.
    command = [sys.executable, "-m", "tests.test_trl_fsdp", mode, model_dir, out]
    if mode != "single":
        launcher = ["-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={port}"]
        command[1:1] = launcher
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    return torch.load(out)


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def single(request, tmp_path_factory) -> tuple:
    """The tiny Qwen2 (lm-head tied to the embedding or not) and one plain process's step."""
    pytest.importorskip("trl")
    from tests.test_trl_integration import _tiny_qwen2, _tokenizer

    path = tmp_path_factory.mktemp("tied" if request.param else "untied")
    tok = _tokenizer()
    model = _tiny_qwen2(len(tok), seed=0)
    if request.param:
        model.config.tie_word_embeddings = True
        model.lm_head.weight = model.model.embed_tokens.weight
    model.save_pretrained(path / "model")
    tok.save_pretrained(path / "model")
    base = {n: p.detach().clone() for n, p in model.named_parameters()}
    return str(path / "model"), base, _launch("single", str(path / "model"), str(path / "one.pt"))


@pytest.mark.parametrize("mode", MODES)
def test_two_sharded_processes_give_the_single_process_loss_logprobs_and_weights(
    mode, single, tmp_path
):
    if mode.startswith("zero"):
        pytest.importorskip("deepspeed", reason="deepspeed is not installed (module docstring)")
    model_dir, base, want = single
    got = _launch(mode, model_dir, str(tmp_path / f"{mode}.pt"))
    torch.testing.assert_close(got["loss"], want["loss"], rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(got["logps"], want["logps"], rtol=1e-6, atol=1e-6)
    assert got["weights"].keys() == want["weights"].keys() == base.keys()
    for name, w in want["weights"].items():
        torch.testing.assert_close(got["weights"][name], w, rtol=1e-6, atol=1e-7, msg=name)
    head = "model.embed_tokens.weight" if "lm_head.weight" not in base else "lm_head.weight"
    assert not torch.equal(want["weights"][head], base[head])  # the step moved the lm-head


def test_the_fused_loss_runs_inside_the_lm_heads_forward_as_zero3_needs():
    """ZeRO-3's protocol, simulated in one process: the lm-head weight is empty outside the
    module's forward, whole inside it, and whole again once the backward reaches the module's
    output (ZeRO's hooks do this with all-gathers). Through `_call_as_forward` the fused loss and
    its weight gradient are those of the whole weight, and the module's forward is restored."""
    from ftis_kernels import ftis_linear_loss
    from ftis_kernels.integrations.trl.trainer import _call_as_forward

    g = torch.Generator().manual_seed(0)
    head = torch.nn.Linear(8, 11, bias=False)
    whole = torch.randn(11, 8, generator=g)
    head.weight.data = torch.empty(0)

    class Regather(torch.autograd.Function):
        @staticmethod
        def forward(ctx, out):
            return out.view_as(out)

        @staticmethod
        def backward(ctx, grad):
            head.weight.data = whole
            return grad

    def gather(module, args):
        module.weight.data = whole

    def release(module, args, out):
        module.weight.data = torch.empty(0)
        return Regather.apply(out)

    head.register_forward_pre_hook(gather)
    head.register_forward_hook(release)
    hidden = torch.randn(2, 5, 8, generator=g, requires_grad=True)
    tokens = torch.randint(0, 11, (2, 5), generator=g)
    gen = -torch.rand(2, 5, generator=g) - 0.5
    advantages = torch.tensor([1.0, -0.5])

    def loss_of(h, weight):
        return ftis_linear_loss(h, weight, tokens, gen, advantages)

    loss, metrics = _call_as_forward(head, lambda h: loss_of(h, head.weight), hidden)
    assert head.weight.numel() == 0 and "forward" not in head.__dict__
    loss.backward()
    reference = whole.clone().requires_grad_()
    want, want_metrics = loss_of(hidden.detach(), reference)
    want.backward()
    torch.testing.assert_close(loss, want)
    torch.testing.assert_close(metrics["logp"], want_metrics["logp"])
    torch.testing.assert_close(head.weight.grad, reference.grad)


def test_a_lora_lm_head_under_zero3_is_refused_naming_ftis_op():
    peft = pytest.importorskip("peft")
    from ftis_kernels.integrations.trl.trainer import _sharding, _zero3_lm_head
    from tests.test_trl_integration import _tiny_qwen2

    config = peft.LoraConfig(r=2, target_modules=["lm_head"])
    model = peft.get_peft_model(_tiny_qwen2(13, seed=0), config)
    for i, p in enumerate(model.get_output_embeddings().parameters()):
        p.ds_id = i  # how deepspeed.zero marks its partitioned parameters
    assert _sharding(model, model) == "zero3"
    with pytest.raises(ValueError, match="^ftis_op=.*ZeRO-3.*plain nn.Linear"):
        _zero3_lm_head(model)


def test_fsdp1_with_ftis_loss_gives_the_single_process_loss_logprobs_and_weights(single, tmp_path):
    """FSDP1 is refused for the fused loss, and the refusal sends the user to ftis_op="ftis_loss";
    there the pi_old / reference pass is TRL's own (the lm-head weight is in FSDP1's flat
    parameter), not the fused pass that refused FSDP1 whatever ftis_op was. 2 processes,
    FULL_SHARD; the weights after an SGD step from the gathered gradients."""
    model_dir, _, want = single
    got = _launch("fsdp1", model_dir, str(tmp_path / "fsdp1.pt"))
    torch.testing.assert_close(got["loss"], want["loss"], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got["logps"], want["logps"], rtol=1e-5, atol=1e-5)
    for name, w in want["weights"].items():
        torch.testing.assert_close(got["weights"][name], w, rtol=1e-5, atol=1e-6, msg=name)
    assert got["refused"].startswith("ftis_op='ftis_linear_loss' is not supported") and (
        "FSDP1" in got["refused"]
    )


if __name__ == "__main__":
    if sys.argv[1] == "fsdp1":
        _fsdp1_worker(*sys.argv[2:4])
    _worker(*sys.argv[1:4])  # exits through _leave
