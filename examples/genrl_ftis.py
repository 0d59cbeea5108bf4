"""GenRL (RL Swarm) with F-TIS: two peers of different sizes share rollouts through GenRL's game
manager; the receiver trains with `FTISGRPOLanguageTrainerModule`. CPU, no download, seconds.

Everything is made here: a character tokenizer with a chat template, two tiny Qwen2 models from a
config (the peer is wider and deeper, as RL Swarm's peers run different Qwen2.5 sizes), a toy task
(the reward is the share of digits in the completion). GenRL's `BaseGameManager`, `GameState`,
`SimpleTextDataManager` and `DefaultRewardManager` play the game; the peer's payload reaches the
receiver's game state as RL Swarm's data manager puts it there (its rollouts join the receiver's
trees), here in one process with GenRL's local (null) communication and a two-line exchange.

The receiver's trainer is the one line a GenRL user changes (`--trainer stock` runs GenRL's
`GRPOLanguageTrainerModule` instead): it trains on the generators' own tokens and log-probabilities,
so the peer's rollouts get F-TIS's IS weight and filter instead of being taken as on-policy.

Run: pip install 'ftis-kernels[genrl]' && python examples/genrl_ftis.py [--trainer stock]
     [--rounds 2]
"""

import argparse
import logging
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from datasets import Dataset  # noqa: E402
from genrl.communication.local.null_comm import NullCommunicationBackend  # noqa: E402
from genrl.data.text_data_managers import SimpleTextDataManager  # noqa: E402
from genrl.game.game_manager import BaseGameManager  # noqa: E402
from genrl.rewards.reward_manager import DefaultRewardManager  # noqa: E402
from genrl.rewards.reward_store import RewardFnStore, RoundRewardFnStore  # noqa: E402
from genrl.state import GameState  # noqa: E402
from genrl.trainer.grpo_trainer import GRPOLanguageTrainerModule, GRPOTrainerConfig  # noqa: E402
from tokenizers import Regex, Tokenizer, models, pre_tokenizers  # noqa: E402
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM  # noqa: E402

from ftis_kernels.integrations.genrl import FTISGRPOLanguageTrainerModule  # noqa: E402

CHARS = "abcdefghijklmnopqrstuvwxyz0123456789 +=?"
PROMPTS = [f"what is {a}+{b}?" for a in range(2) for b in range(2)]


def make_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {"<pad>": 0, "<eos>": 1, "\n": 2, **{ch: i + 3 for i, ch in enumerate(CHARS)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), "isolated")
    tok = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, pad_token="<pad>", eos_token="<eos>", padding_side="left"
    )
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
    return tok


def make_model(vocab_size: int, hidden: int, layers: int, seed: int) -> Qwen2ForCausalLM:
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(
        Qwen2Config(
            vocab_size=vocab_size,
            hidden_size=hidden,
            intermediate_size=2 * hidden,
            num_hidden_layers=layers,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=128,
            tie_word_embeddings=False,
            initializer_range=0.2,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=1,
        )
    )


def prompts(**_) -> Dataset:
    return Dataset.from_dict({"question": PROMPTS, "answer": [""] * len(PROMPTS)})


def digit_share(state: GameState) -> dict:
    """GenRL reward function: per agent, per batch item, per node, one reward per completion."""
    return {
        agent: {
            batch_id: [
                [sum(ch.isdigit() for ch in c) / max(len(c), 1) for c in node.actions]
                for node in tree[0]
            ]
            for batch_id, tree in trees.items()
        }
        for agent, trees in state.trees.items()
    }


class SwarmDataManager(SimpleTextDataManager):
    """Puts the peers' rollouts into this peer's game state, as RL Swarm's data manager does."""

    def prepare_states(self, current_state, swarm_states):
        for agent, batches in swarm_states.items():
            if agent not in current_state.trees:
                current_state.trees[agent] = {}
                for batch_id, payloads in batches.items():
                    tree = current_state.game_tree_factory(payloads[0].world_state)
                    tree.append_node_actions(current_state.stage, 0, payloads[0].actions)
                    current_state.trees[agent][batch_id] = tree
        return current_state.get_latest_state()


class Exchange(NullCommunicationBackend):
    """GenRL's local communication, plus the payloads of the other peer of this process: the
    k-th all-gather returns each peer's k-th payload."""

    def __init__(self, name: str, board: dict):
        super().__init__()
        self.name, self.board, self.calls = name, board, 0

    def all_gather_object(self, obj, *args, **kwargs):
        self.board.setdefault(self.name, []).append(obj)
        k, self.calls = self.calls, self.calls + 1
        return {name: sent[k] for name, sent in self.board.items() if len(sent) > k}

    def get_id(self):
        return self.name


def record_logs(trainer) -> list[dict]:
    """The metrics each training step hands to GenRL's logger."""
    logs: list[dict] = []
    log = trainer.log

    def keep(metrics, global_step):
        logs.append(dict(metrics))
        return log(metrics, global_step)

    trainer.log = keep
    return logs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trainer", default="ftis", choices=["ftis", "stock"])
    parser.add_argument("--rounds", type=int, default=2)
    cli = parser.parse_args()
    logging.getLogger("genrl").setLevel(logging.WARNING)

    tokenizer = make_tokenizer()
    config = GRPOTrainerConfig(
        max_new_tokens=8,
        num_generations=4,
        minibatch_size=16,
        learning_rate=3e-3,
        enable_gradient_checkpointing=False,
    )
    # The one line a GenRL user changes: the receiver's trainer class.
    Trainer = FTISGRPOLanguageTrainerModule if cli.trainer == "ftis" else GRPOLanguageTrainerModule
    receiver = Trainer([make_model(len(tokenizer), 32, 2, 0)], config, processing_class=tokenizer)
    peer = FTISGRPOLanguageTrainerModule(
        [make_model(len(tokenizer), 48, 3, 1)], config, processing_class=tokenizer
    )
    logs = record_logs(receiver)
    board: dict = {}
    managers = {}
    for name, trainer in (("peer", peer), ("receiver", receiver)):
        rewards = DefaultRewardManager(
            RewardFnStore(cli.rounds, [RoundRewardFnStore(1, [digit_share])])
        )
        data = SwarmDataManager(train_dataset=None, data_generator=prompts, num_train_samples=None)
        managers[name] = BaseGameManager(
            max_stage=1,
            max_round=cli.rounds,
            game_state=GameState(0, 0),
            reward_manager=rewards,
            trainer=trainer,
            data_manager=data,
            communication=Exchange(name, board),
        )
    # The peer plays its rounds first, so that its payload of round k is on the board when the
    # receiver plays round k (a swarm runs them at once, one process per peer).
    for gm in managers.values():
        gm.run_game()

    label = "F-TIS" if cli.trainer == "ftis" else "stock GenRL (NoIS)"
    print(f"receiver: {label}, trained on its own rollouts and the peer's")
    for r, m in enumerate(logs):
        line = f"round {r}  reward {m['train/rewards']:.3f}  loss {m['train/loss']:+.4f}"
        if "ftis/recorded" in m:
            line += (
                f"  rollouts {m['ftis/recorded']:.0f} recorded  kl {m['ftis/kl_mean']:.2f}"
                f"  filtered {m['ftis/filtered_frac']:.2f}  w {m['ftis/is_weight_mean']:.3f}"
                f"  truncated {m['ftis/is_truncated_frac']:.3f}"
            )
        print(line)
    if len(logs) != cli.rounds:
        raise SystemExit(
            f"the receiver trained {len(logs)} of {cli.rounds} rounds (GenRL logs why)"
        )


if __name__ == "__main__":
    main()
