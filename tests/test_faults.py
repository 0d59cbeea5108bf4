"""The driver's promises under faults, one test each: what `ftis-grpo` does when the user, the
machine or another run gets in the way.

Configuration and usage errors are one line, `ftis-grpo: <key>: expected ..., got <value>`, exit
code 2, found before any process starts; a signal to the launcher stops every process; one run per
output folder; a fresh run never destroys a previous one; warm-ups of different lengths do not
trip a peer's timeout; a non-finite update is skipped, never applied, and counted; a damaged
checkpoint or a torn metrics line does not lose the run. (The loss ops' own fault cases live
beside their validation tests.)
"""

from __future__ import annotations

import json
import math
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from ftis_kernels._extras import MissingExtraError

# Skips, naming the extra and its missing packages, where the 'grpo' extra is not installed; any
# other ImportError is an error.
pytest.importorskip("ftis_kernels.grpo", exc_type=MissingExtraError)

import psutil  # noqa: E402
import yaml  # noqa: E402

from ftis_kernels.grpo import checkpoint, cli  # noqa: E402
from ftis_kernels.grpo.config import (  # noqa: E402
    ConfigError,
    NodeSpec,
    RunConfig,
    build_config,
    describe_keys,
    to_dict,
)
from ftis_kernels.grpo.exchange import IMPROBABLE_LOGPROB, Sample, make_hostile, pack, unpack  # noqa: E402
from ftis_kernels.grpo.launch import _resume_hint  # noqa: E402
from ftis_kernels.grpo.models import build_model  # noqa: E402
from ftis_kernels.grpo.process import (  # noqa: E402
    EXIT_REPORTS_ENV,
    LAUNCHER_ENV,
    read_exit_reports,
)
from ftis_kernels.grpo.run_folder import LOCK_FILE, RUN_MARKER, OutLock, check_out  # noqa: E402
from ftis_kernels.grpo.task import ArithmeticTask, format_prompt, make_prompt_id  # noqa: E402
from ftis_kernels.grpo.tokenizer import build_tokenizer  # noqa: E402
from ftis_kernels.grpo.train import grpo_update, skip_cause  # noqa: E402
from ftis_kernels.options import FTISOptions  # noqa: E402
from tests.test_grpo_run import comparable, rows_of  # noqa: E402
from tests.test_grpo_run import ftis_grpo as run_swarm  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def ftis_grpo(*args: str, out: Path) -> tuple[int, list[str]]:
    """`ftis-grpo ARGS --out OUT` in this process (as far as the launcher goes); returns
    (exit code, stderr lines). Nothing may start: the tests' cases all fail before torchrun."""
    import contextlib
    import io

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            rc = cli.main(["--no-progress", *args, "--out", str(out)])
        except SystemExit as exc:  # argparse's own exits
            rc = exc.code
    return rc, err.getvalue().splitlines()


def _fake_run(out: Path, cfg: RunConfig, rounds_done: int) -> None:
    """What a run that completed `rounds_done` rounds leaves for the launcher's checks."""
    (out / "ckpt").mkdir(parents=True)
    checkpoint.mark_latest(out / "ckpt", rounds_done)
    (out / "config.json").write_text(json.dumps(to_dict(cfg)))
    (out / "metrics.jsonl").write_text("")


# -- configuration and usage errors: one line, the key named, exit code 2, nothing started ------
CONFIG_ERRORS = [
    (["--rounds", "-3"], "--rounds: expected a value >= 1, got -3"),
    (["--set", "rounds=-3"], "rounds: expected a value >= 1, got -3"),
    (["--set", "rounds=abc"], "rounds: expected an integer, got 'abc'"),
    (["--set", "group_size=abc"], "group_size: expected an integer, got 'abc'"),
    (["--set", "nodes.0.lr=fast"], "nodes.0.lr: expected a number, got 'fast'"),
    (["--set", "nodes.5.lr=1e-3"], "nodes.5: expected an index from 0 to 1"),
    (["--set", "nodes.7.lr"], "--set: expected KEY=VALUE, got 'nodes.7.lr'"),
    (["--set", "verify_rewards=nope"], "verify_rewards: expected true or false, got 'nope'"),
    (["--set", "ckpt_every=0"], "ckpt_every: expected a value >= 1, got 0"),
    (["--set", "nodes.1.hostile=evil"], "nodes.1.hostile: expected one of 'forged_logprobs'"),
    (["--set", "lossy=1"], "lossy: expected a known key (did you mean loss?"),
    (["--set", "rounds.x=1"], "rounds.x: expected a key inside a mapping"),
    (["--set", "epsilon=1.5"], "epsilon: expected a value < 1"),
    (["--nodes", "0"], "--nodes: expected a number of nodes >= 1, got 0"),
    (["--rounds", "x"], "--rounds: expected an integer, got 'x'"),
    (["--loss", "fast"], "--loss: expected one of 'on-policy'"),
    (["--set", "nodes.1.model=no/such"], "nodes.1.model: expected a Hugging Face model folder"),
    # values that once passed and crashed every node 15-18 s later, or wrote 1e30 weights
    (["--set", "seed=1e20"], "seed: expected an integer in range"),
    (["--set", "seed=4294967296"], "seed: expected a value <= 4294967295, got 4294967296"),
    (["--timeout", "1e300"], "--timeout: expected a value <= 1000000.0, got 1e+300"),
    (["--set", "setup_timeout_s=1e300"], "setup_timeout_s: expected a value <= 1000000.0"),
    (["--set", "nodes.0.lr=1e30"], "nodes.0.lr: expected a value <= 1.0, got 1e+30"),
    (["--set", "nodes.1.warmup_lr=2"], "nodes.1.warmup_lr: expected a value <= 1.0, got 2"),
]


@pytest.mark.parametrize("args, line", CONFIG_ERRORS, ids=[" ".join(a) for a, _ in CONFIG_ERRORS])
def test_config_error_is_one_line_naming_the_key_before_anything_starts(tmp_path, args, line):
    rc, err = ftis_grpo("--preset", "smoke", *args, out=tmp_path / "run")
    assert rc == 2 and len(err) == 1 and err[0].startswith(f"ftis-grpo: {line}"), err
    assert not (tmp_path / "run").exists()  # nothing was started, nothing was written


def test_each_of_several_problems_gets_its_own_line(tmp_path):
    rc, err = ftis_grpo("--preset", "smoke", "--set", "task=jsonl", out=tmp_path / "run")
    assert rc == 2 and err == [
        "ftis-grpo: data.train: expected a JSONL file (task jsonl), got null",
        "ftis-grpo: data.test: expected a JSONL file (task jsonl), got null",
        "ftis-grpo: data.ood: expected a JSONL file (task jsonl), got null",
    ] + [
        f"ftis-grpo: nodes.{i}.model: expected a model folder: preset models know only the "
        "built-in task's vocabulary (task jsonl), got null"
        for i in range(2)
    ]


def test_a_yaml_alias_bomb_is_refused_in_one_short_line(tmp_path):
    """237 bytes of nested aliases once echoed 4.3 MB back (9^6 strings)."""
    bomb = tmp_path / "bomb.yaml"
    lines = ['a: &a ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    for prev, name in zip("abcde", "bcdef"):
        lines.append(f"{name}: &{name} [{', '.join([f'*{prev}'] * 9)}]")
    bomb.write_text("\n".join(lines) + "\n")
    rc, err = ftis_grpo("--config", str(bomb), out=tmp_path / "run")
    assert rc == 2 and len(err) == 1 and len(err[0]) < 400, err
    assert err[0].startswith(f"ftis-grpo: --config: expected valid YAML or TOML, got {bomb}:")
    assert "aliases (*name) are not allowed" in err[0]


def test_an_error_echoes_at_most_200_characters_of_a_value(tmp_path):
    rc, err = ftis_grpo("--preset", "smoke", "--set", "nodes.0.arch=" + "y" * 5000, out=tmp_path)
    assert rc == 2 and len(err) == 1
    assert err[0].endswith("... (5002 characters)") and len(err[0]) < 350


def test_yaml_file_that_is_not_a_mapping_is_a_config_error(tmp_path):
    listed = tmp_path / "list.yaml"
    listed.write_text("[1, 2]\n")
    rc, err = ftis_grpo("--config", str(listed), out=tmp_path / "run")
    assert rc == 2 and err == [
        f"ftis-grpo: --config {listed}: expected a mapping of config keys "
        "(key: value lines), got [1, 2]"
    ]


def test_out_that_is_a_file_is_a_config_error(tmp_path):
    (tmp_path / "afile").write_text("")
    rc, err = ftis_grpo("--preset", "smoke", out=tmp_path / "afile")
    assert rc == 2 and err == [
        f"ftis-grpo: --out: expected a folder, got {str(tmp_path / 'afile')!r}, which is a file"
    ]


def test_resume_names_each_changed_key_with_its_old_and_new_value(tmp_path):
    _fake_run(tmp_path, build_config("smoke", overrides={"out": str(tmp_path)}), rounds_done=2)
    rc, err = ftis_grpo(
        "--preset",
        "smoke",
        "--resume",
        "--loss",
        "nois",
        "--set",
        "nodes.1.lr=0.5",
        "--rounds",
        "9",
        out=tmp_path,
    )
    assert rc == 2 and len(err) == 2, err
    assert err[0].startswith("ftis-grpo: loss: expected 'f-tis' as in the run being resumed")
    assert err[0].endswith(", got 'nois'")
    assert err[1].startswith("ftis-grpo: nodes.1.lr: expected 0.001 as in the run being resumed")
    assert err[1].endswith(", got 0.5")


def test_resume_without_a_checkpoint_or_rounds_left_is_a_config_error(tmp_path):
    rc, err = ftis_grpo("--preset", "smoke", "--resume", out=tmp_path / "new")
    assert rc == 2 and err[0].startswith("ftis-grpo: --resume: expected a complete checkpoint")
    assert not (tmp_path / "new").exists()  # the folder it made for the run is gone again
    _fake_run(tmp_path / "done", build_config("smoke", overrides={"out": str(tmp_path)}), 4)
    rc, err = ftis_grpo("--preset", "smoke", "--resume", out=tmp_path / "done")
    assert rc == 2 and err == [
        f"ftis-grpo: rounds: expected more than the 4 rounds the run in "
        f"{tmp_path / 'done'} has done (--rounds N extends it), got 4"
    ]


def test_resume_hint_only_when_a_checkpoint_exists(tmp_path):
    cfg = build_config("smoke", overrides={"out": str(tmp_path)})
    argv = ["--preset", "smoke", "--out", str(tmp_path), "--overwrite"]
    assert _resume_hint(argv, cfg) == ""  # died before its first checkpoint: nothing to resume
    (tmp_path / "ckpt").mkdir()
    checkpoint.mark_latest(tmp_path / "ckpt", 0)
    hint = _resume_hint(argv, cfg)
    assert hint.endswith(f"ftis-grpo --preset smoke --out {tmp_path} --resume"), hint
    checkpoint.mark_latest(tmp_path / "ckpt", cfg.rounds)
    assert _resume_hint(argv, cfg) == ""  # every round done: a resume would have nothing to do


def test_the_resume_hint_drops_injected_faults_and_covers_a_swarm_of_peers(tmp_path):
    """The printed command must work as printed: without the setting that made a node fail on
    purpose; a local swarm of peers resumes from the earliest of its peers' checkpoints."""
    cfg = build_config("smoke", overrides={"out": str(tmp_path)})
    argv = ["--preset", "smoke", "--set", "nodes.1.fail_at_round=2", "--set=seed=3"]
    argv += ["--set=nodes.0.fail_at_round=1", "--out", str(tmp_path)]
    (tmp_path / "ckpt").mkdir()
    checkpoint.mark_latest(tmp_path / "ckpt", 1)
    hint = _resume_hint(argv, cfg)
    assert hint.endswith(f"ftis-grpo --preset smoke --set=seed=3 --out {tmp_path} --resume"), hint
    peers = [tmp_path / f"node_{k}" for k in range(2)]
    for k, done in enumerate((3, 2)):
        (peers[k] / "ckpt").mkdir(parents=True)
        checkpoint.mark_latest(peers[k] / "ckpt", done)
    assert "from the checkpoint of round 2 with:" in _resume_hint(argv, cfg, peers)
    assert _resume_hint(argv, cfg, [*peers, tmp_path / "node_2"]) == ""  # one never checkpointed
    checkpoint.mark_latest(peers[0] / "ckpt", cfg.rounds)  # one done: it would refuse a resume
    assert _resume_hint(argv, cfg, peers) == ""


def test_every_config_value_is_checked_when_the_config_is_built():
    with pytest.raises(ValueError, match="nodes.0.warmup_format: expected a value <= 1"):
        build_config("smoke", sets=("nodes.0.warmup_format=2",))
    cfg = build_config("smoke")
    with pytest.raises(ValueError, match="number"):
        cfg.nodes[0].lr = "fast"  # assignments are checked too


# -- a CLI that explains itself -------------------------------------------------------------------
def test_help_gives_every_flag_a_text_and_lists_the_presets(capsys):
    from ftis_kernels.grpo.config import PRESET_HELP

    parser = cli.build_parser()
    with pytest.raises(SystemExit) as exit_:
        parser.parse_args(["--help"])
    assert exit_.value.code == 0
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    for name, line in PRESET_HELP.items():
        assert f"{name} {line}" in text
    for action in parser._actions:
        assert action.help and all(flag in text for flag in action.option_strings), action
    for flag, default in (
        ("--out", "runs/grpo"),
        ("--rounds", "20"),
        ("--loss", "f-tis"),
        ("--timeout", "120.0"),
        ("--threads", "cores / nodes"),
    ):
        assert f"(default {default})" in text or f"(default: {default})" in text, flag


def test_list_keys_names_every_key_with_allowed_values_and_default(capsys):
    assert cli.main(["--list-keys"]) == 0
    text = capsys.readouterr().out
    keys = [row[0] for row in describe_keys()]
    names = list(RunConfig.__pydantic_fields__) + [
        f"nodes.<i>.{n}" for n in NodeSpec.__pydantic_fields__
    ]
    assert keys == names and all(k in text for k in keys)
    assert "'vertical' | 'horizontal'" in text and "integer >= 1" in text


def test_print_config_is_the_effective_config_as_a_valid_config_file(tmp_path, capsys):
    args = ["--preset", "smoke", "--loss", "nois", "--set", "nodes.1.lr=0.01", "--print-config"]
    assert cli.main([*args, "--out", str(tmp_path / "run")]) == 0
    printed = capsys.readouterr().out
    assert "# 'on-policy' | 'nois'" in printed and not (tmp_path / "run").exists()
    (tmp_path / "printed.yaml").write_text(printed)
    again = build_config(config_file=str(tmp_path / "printed.yaml"))
    expected = build_config(
        "smoke", overrides={"loss": "nois", "out": str(tmp_path / "run")}, sets=("nodes.1.lr=0.01",)
    )
    assert to_dict(again) == to_dict(expected)
    assert yaml.safe_load(printed)["nodes"][1]["lr"] == 0.01


# -- one run per output folder --------------------------------------------------------------------
def test_second_run_on_a_locked_out_fails_at_once_naming_the_holder(tmp_path):
    tmp_path.mkdir(exist_ok=True)
    with OutLock(tmp_path):
        rc, err = ftis_grpo("--preset", "smoke", out=tmp_path)
    assert rc == 2 and len(err) == 1, err
    assert err[0].startswith("ftis-grpo: --out: expected a folder no other run is writing to")
    assert f"PID {os.getpid()} on host {socket.gethostname()}" in err[0]
    with OutLock(tmp_path):  # released when its holder is done
        assert (tmp_path / LOCK_FILE).exists()


# -- never destroy a previous run -----------------------------------------------------------------
def test_fresh_run_into_a_folder_holding_a_run_is_refused(tmp_path):
    _fake_run(tmp_path, build_config("smoke"), rounds_done=50)
    rc, err = ftis_grpo("--preset", "smoke", out=tmp_path)
    assert rc == 2 and len(err) == 1, err
    assert (
        "expected an empty or new folder (--resume continues the run there, --overwrite "
        "replaces it)"
        in err[0]
        and "holds a run: ckpt, metrics.jsonl, config.json" in err[0]
    )
    assert checkpoint.latest_round(tmp_path / "ckpt") == 50


def test_overwrite_deletes_the_previous_runs_outputs_and_nothing_else(tmp_path):
    _fake_run(tmp_path, build_config("smoke"), rounds_done=50)
    (tmp_path / "notes.txt").write_text("mine")
    check_out(build_config("smoke", overrides={"out": str(tmp_path)}), overwrite=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == [RUN_MARKER, "notes.txt"]


def test_overwrite_never_deletes_a_users_files_it_could_mistake_for_a_run(tmp_path):
    """A folder with the user's own config.yaml and tokenizer/ holds no run: neither a fresh run
    nor --overwrite takes it, and nothing in it is deleted."""
    (tmp_path / "config.yaml").write_text("mine: 1\n")
    (tmp_path / "tokenizer").mkdir()
    (tmp_path / "tokenizer" / "vocab.json").write_text("{}")
    for args in ((), ("--overwrite",)):
        rc, err = ftis_grpo("--preset", "smoke", *args, out=tmp_path)
        assert rc == 2 and err == [
            "ftis-grpo: --out: expected a folder without files of the names a run writes, or "
            f"one a run wrote, got {str(tmp_path)!r}, which holds config.yaml, tokenizer that "
            "no run wrote (move them, or choose another --out)"
        ]
    assert (tmp_path / "config.yaml").read_text() == "mine: 1\n"
    assert (tmp_path / "tokenizer" / "vocab.json").exists()


def test_a_run_leaves_its_marker_and_overwrite_deletes_only_what_a_run_writes(tmp_path):
    cfg = build_config("smoke", overrides={"out": str(tmp_path)})
    check_out(cfg, overwrite=False)
    assert (tmp_path / RUN_MARKER).is_file()
    (tmp_path / "metrics.jsonl").write_text("")
    (tmp_path / "tokenizer").mkdir()
    (tmp_path / "notes.txt").write_text("mine")
    rc, err = ftis_grpo("--preset", "smoke", out=tmp_path)
    assert rc == 2 and "which holds a run: metrics.jsonl, tokenizer" in err[0]
    check_out(cfg, overwrite=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == [RUN_MARKER, LOCK_FILE, "notes.txt"]


@pytest.mark.parametrize("held", ["user_files", "torch_run", "swarm_run"])
def test_a_local_swarm_of_peers_checks_its_folder_as_a_run_does(tmp_path, held):
    """`--transport hivemind` writes its merged summary.txt and curves.png into --out: a user's
    files of those names and another run are refused before any peer starts or any node_k
    folder is written; --overwrite replaces a run, --resume is left to the peers."""
    if held == "user_files":
        (tmp_path / "summary.txt").write_text("mine")
        want = "which holds summary.txt that no run wrote"
    elif held == "torch_run":
        _fake_run(tmp_path, build_config("smoke"), rounds_done=5)
        (tmp_path / RUN_MARKER).write_text("")
        want = "which holds a run: ckpt, metrics.jsonl, config.json"
    else:  # a swarm's merged outputs from before the folder had a marker: its peers' have
        (tmp_path / "summary.txt").write_text("merged")
        (tmp_path / "node_0").mkdir()
        (tmp_path / "node_0" / RUN_MARKER).write_text("")
        want = "which holds a run: summary.txt"
    before = sorted(p.name for p in tmp_path.rglob("*"))
    for args in ((), ("--overwrite",)) if held == "user_files" else ((),):
        rc, err = ftis_grpo("--preset", "smoke", "--transport", "hivemind", *args, out=tmp_path)
        assert rc == 2 and len(err) == 1 and want in err[0], err
    assert sorted(p.name for p in tmp_path.rglob("*") if p.name != LOCK_FILE) == before
    if held != "user_files":
        cfg = build_config("smoke", overrides={"out": str(tmp_path), "transport": "hivemind"})
        check_out(cfg, overwrite=True, peers_resume=True)
        assert not (tmp_path / "summary.txt").exists() and not (tmp_path / "ckpt").exists()


def test_checkpoint_pruning_never_deletes_a_later_rounds_folder(tmp_path):
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    later = checkpoint.node_dir(tmp_path, 0, 50)
    later.mkdir(parents=True)
    for r in (1, 2, 3):
        checkpoint.save_node(tmp_path, 0, r, model, optimizer, torch.Generator(), {})
    kept = sorted(p.name for p in (tmp_path / "node0").iterdir())
    assert kept == ["round_00002", "round_00003", "round_00050"]


def test_stray_folders_in_ckpt_are_neither_rounds_nor_pruned(tmp_path):
    """A user's `round_00004.bak` is no round: node_rounds skips it (it once crashed --resume
    with int()), and pruning neither counts it as kept nor deletes it."""
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    for r in (2, 4):
        checkpoint.save_node(tmp_path, 0, r, model, optimizer, torch.Generator(), {})
    for stray in ("round_00004.bak", "round_00002.bak", "round_x"):
        (tmp_path / "node0" / stray).mkdir()
    assert checkpoint.node_rounds(tmp_path, 0) == [4, 2]
    checkpoint.save_node(tmp_path, 0, 6, model, optimizer, torch.Generator(), {})
    kept = sorted(p.name for p in (tmp_path / "node0").iterdir())
    assert kept == ["round_00002.bak", "round_00004", "round_00004.bak", "round_00006", "round_x"]


@pytest.mark.parametrize("pointer", ["{}", '{"rou', '{"round": "x"}', "[]", ""])
def test_a_damaged_latest_pointer_falls_back_to_the_newest_good_round(tmp_path, pointer, caplog):
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    for node in (0, 1):
        for r in (2, 4):
            checkpoint.save_node(tmp_path, node, r, model, optimizer, torch.Generator(), {})
    (tmp_path / "latest.json").write_text(pointer)
    assert checkpoint.latest_round(tmp_path) == 4
    assert "latest.json is damaged" in caplog.text and "using round 4" in caplog.text
    _spoil(checkpoint.node_dir(tmp_path, 1, 4) / "model.safetensors")
    assert checkpoint.latest_round(tmp_path) == 2


def test_resume_with_a_damaged_latest_pointer_is_no_traceback(tmp_path):
    cfg = build_config("smoke", overrides={"out": str(tmp_path), "resume": True, "rounds": 9})
    _fake_run(tmp_path, cfg, rounds_done=2)
    (tmp_path / "ckpt" / "latest.json").write_text("{}")
    rc, err = ftis_grpo("--preset", "smoke", "--resume", "--rounds", "9", out=tmp_path)
    assert rc == 2 and err == [
        f"ftis-grpo: --resume: expected a complete checkpoint in {tmp_path / 'ckpt'}, got none "
        "(start the run without --resume)"
    ]


@pytest.mark.parametrize("writer", ["torch.save", "safetensors"])
def test_a_checkpoint_write_on_a_full_disk_names_the_path_and_the_cause(
    tmp_path, monkeypatch, writer
):
    """On a full disk torch.save says only "basic_ios::clear: iostream error"; safetensors, which
    writes the checkpoint's first file, raises its own error (an Exception, not an OSError)."""
    import collections

    from safetensors import SafetensorError

    if writer == "torch.save":
        error = RuntimeError("basic_ios::clear: iostream error")
        target, name = checkpoint.torch, "save"
    else:
        error = SafetensorError("Error while serializing: No space left on device (os error 28)")
        target, name = checkpoint, "save_model"

    def full(*args, **kwargs):
        raise error

    monkeypatch.setattr(target, name, full)
    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(checkpoint.shutil, "disk_usage", lambda path: usage(1 << 30, 1 << 30, 0))
    model = torch.nn.Linear(2, 2)
    with pytest.raises(OSError) as caught:
        checkpoint.save_node(
            tmp_path, 0, 2, model, torch.optim.AdamW(model.parameters()), torch.Generator(), {}
        )
    tmp = checkpoint.node_dir(tmp_path, 0, 2).with_suffix(".tmp")
    assert caught.value.filename == str(tmp) and not tmp.exists()
    assert caught.value.strerror == f"no space left on its disk ({error})"


def test_stale_tmp_checkpoint_folders_are_removed_when_a_run_resumes(tmp_path):
    cfg = build_config("smoke", overrides={"out": str(tmp_path), "resume": True, "rounds": 9})
    _fake_run(tmp_path, cfg, rounds_done=2)
    stale = checkpoint.node_dir(tmp_path / "ckpt", 1, 4).with_suffix(".tmp")
    stale.mkdir(parents=True)
    check_out(cfg, overwrite=False)
    assert not stale.exists() and (tmp_path / "ckpt" / "latest.json").exists()


# -- processes: signals and slow warm-ups (real runs of the smoke preset) -------------------------
def _env() -> dict[str, str]:
    env = dict(os.environ, FTIS_LOG_LEVEL="INFO")
    env.pop("TRITON_INTERPRET", None)  # the driver's CPU path, as a user's run takes
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    return env


def test_signal_to_the_launcher_alone_stops_every_process(tmp_path):
    log_file = tmp_path / "log.txt"
    with open(log_file, "w") as log_out:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "ftis_kernels.grpo",
                "--preset",
                "smoke",
                "--no-progress",
                "--rounds",
                "50",
                "--out",
                str(tmp_path / "run"),
            ],
            cwd=ROOT,
            env=_env(),
            stdout=log_out,
            stderr=subprocess.STDOUT,
        )
    launcher = psutil.Process(proc.pid)
    tree: list[psutil.Process] = []
    try:
        deadline = time.monotonic() + 120
        while "vocabulary of" not in log_file.read_text() and time.monotonic() < deadline:
            time.sleep(0.5)  # until both nodes are set up, inside the run
        tree = launcher.children(recursive=True)
        assert len(tree) >= 3, log_file.read_text()[-3000:]  # torchrun and its 2 nodes
        os.kill(proc.pid, signal.SIGTERM)  # the launcher's PID only
        proc.wait(timeout=90)
        log = log_file.read_text()
        assert proc.returncode == 128 + signal.SIGTERM, log[-3000:]
        assert "SIGTERM received: stopping the swarm" in log
        assert "node 0: stopped by SIGTERM" in log and "Traceback" not in log, log[-3000:]
        _, alive = psutil.wait_procs(tree, timeout=5)
        assert alive == [], [p.pid for p in alive]
    finally:
        for p in [launcher, *tree]:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass


def _launch(out: Path, log_file: Path, *args: str) -> subprocess.Popen:
    """The launcher of a smoke run of 50 rounds into `out`, its output into `log_file`."""
    with open(log_file, "w") as log_out:
        return subprocess.Popen(
            [sys.executable, "-m", "ftis_kernels.grpo", "--preset", "smoke", "--no-progress"]
            + ["--rounds", "50", "--out", str(out), *args],
            cwd=ROOT,
            env=_env(),
            stdout=log_out,
            stderr=subprocess.STDOUT,
        )


def _wait_for(log_file: Path, text: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while text not in log_file.read_text() and time.monotonic() < deadline:
        time.sleep(0.3)
    assert text in log_file.read_text(), log_file.read_text()[-3000:]


def test_a_launcher_killed_by_sigkill_takes_its_swarm_and_the_lock_with_it(tmp_path):
    """SIGKILL leaves the launcher no chance to stop anything: torchrun dies with it, the nodes
    see their parent gone and stop within seconds, and until the last has stopped the folder
    stays locked."""
    log_file, out = tmp_path / "log.txt", tmp_path / "run"
    proc = _launch(out, log_file)
    launcher = psutil.Process(proc.pid)
    tree: list[psutil.Process] = []
    try:
        _wait_for(log_file, "vocabulary of")
        tree = launcher.children(recursive=True)
        assert len(tree) >= 3, log_file.read_text()[-3000:]  # torchrun and its 2 nodes
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        t0 = time.monotonic()
        with pytest.raises(ConfigError, match="locked by ftis-grpo PID"):
            OutLock(out).acquire()  # the nodes hold it
        _, alive = psutil.wait_procs(tree, timeout=10)
        assert alive == [], [p.cmdline() for p in alive]
        assert time.monotonic() - t0 < 5
        assert "is gone; stopping" in log_file.read_text()
        with OutLock(out):  # free again
            pass
    finally:
        for p in [launcher, *tree]:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass


def test_a_nodes_share_of_the_lock_outlives_the_process_that_checked_the_folder(tmp_path):
    first = OutLock(tmp_path)
    first.acquire()
    first.share()
    node = OutLock(tmp_path)
    node.join()
    first.release()
    with pytest.raises(ConfigError, match="no other run is writing to"):
        OutLock(tmp_path).acquire()
    node.release()
    with OutLock(tmp_path):
        pass


def _torchrun(out: Path, *args: str, nodes: int = 2) -> subprocess.CompletedProcess:
    """`torchrun ... -m ftis_kernels.grpo --preset smoke ARGS`, the mode the launcher's docstring
    gives for runs across hosts."""
    return subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", f"--nproc-per-node={nodes}"]
        + ["--master-addr=127.0.0.1", f"--master-port={_port()}", "-m", "ftis_kernels.grpo"]
        + ["--preset", "smoke", "--no-progress", "--out", str(out), *args],
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_torchrun_by_hand_refuses_a_folder_holding_a_run_and_a_locked_one(tmp_path):
    cfg = build_config("smoke", overrides={"out": str(tmp_path)})
    _fake_run(tmp_path, cfg, rounds_done=4)
    (tmp_path / "metrics.jsonl").write_text('{"round": 0}\n' * 8)
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    proc = _torchrun(tmp_path)
    assert proc.returncode != 0
    assert (
        f"ftis-grpo: --out: expected an empty or new folder (--resume continues the run there, "
        f"--overwrite replaces it), got {str(tmp_path)!r}, which holds a run" in proc.stderr
    ), proc.stderr[-3000:]
    after = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file() and p.name != LOCK_FILE}
    assert after == {p: b for p, b in before.items() if p.name != LOCK_FILE}
    other = tmp_path / "other"
    other.mkdir()
    with OutLock(other) as lock:
        lock.share()
        proc = _torchrun(other)
    assert proc.returncode != 0 and "expected a folder no other run is writing to" in proc.stderr
    assert sorted(p.name for p in other.iterdir()) == [LOCK_FILE]


def test_a_long_warm_up_does_not_trip_a_peers_timeout(tmp_path):
    # Node 0 warms up for 200 steps (several seconds), node 1 not at all: node 1 waits for it
    # far longer than the 5 s a silent peer is given once the rounds run.
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "ftis_kernels.grpo",
            "--preset",
            "smoke",
            "--no-progress",
            "--rounds",
            "1",
            "--timeout",
            "5",
            "--out",
            str(tmp_path),
            "--set",
            "nodes.0.warmup_steps=200",
            "--set",
            "nodes.1.warmup_steps=0",
            "--set",
            "nodes.1.lora=false",
        ],
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-3000:]
    assert (
        "warm-up of 200 steps" in log
        and len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 2
    )


# == Non-finite updates, damaged checkpoints, torn metrics ================
TASK = ArithmeticTask(seed=0)
TOKENIZER = build_tokenizer(TASK.vocabulary_text())


def _prompt(pid: int) -> list[int]:
    return TOKENIZER(format_prompt(TASK.problem(pid).question))["input_ids"]


# -- poisoned updates: a non-finite loss or gradient never reaches the weights -------
def _batch(poisoned: bool) -> list[Sample]:
    """Three peer samples with positive advantages; `poisoned`: the first claims log pi_gen =
    -100 at one token (the issue's sample: the parser accepts it, VIS's weight overflows)."""
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(3):
        tokens = torch.randint(3, len(TOKENIZER), (5,), generator=g, dtype=torch.int32)
        out.append(
            Sample(
                make_prompt_id("train", i), 1, tokens, -torch.rand(5, generator=g) * 3, 1.0, 1.0 + i
            )
        )
    if poisoned:
        out[0].logprobs[2] = -100.0
    return out


def _update(model, optimizer, samples, loss: str) -> dict[str, float]:
    return grpo_update(
        model,
        optimizer,
        samples,
        _prompt,
        FTISOptions.for_variant(loss),
        micro_batch=2,
        pad_id=TOKENIZER.pad_token_id,
        grad_clip=1.0,
        device=torch.device("cpu"),
    )


@pytest.mark.parametrize("loss", ["vis", "f-vis"])
def test_poisoned_peer_sample_skips_the_step_and_changes_no_parameter_or_optimizer_state(loss):
    model = build_model("tiny", TOKENIZER, seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    assert _update(model, optimizer, _batch(poisoned=False), loss)["skipped"] == 0.0
    params = {k: v.clone() for k, v in model.state_dict().items()}
    state = {
        i: {k: v.clone() for k, v in s.items()}
        for i, s in enumerate(optimizer.state_dict()["state"].values())
    }
    stats = _update(model, optimizer, _batch(poisoned=True), loss)
    assert stats["skipped"] == 1.0
    assert skip_cause(stats) == "non-finite loss (-inf)"
    assert all(torch.equal(params[k], v) for k, v in model.state_dict().items())
    after = list(optimizer.state_dict()["state"].values())
    assert all(torch.equal(state[i][k], v) for i, s in enumerate(after) for k, v in s.items())
    assert all(p.grad is None for p in model.parameters())
    assert _update(model, optimizer, _batch(poisoned=False), loss)["skipped"] == 0.0
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())


def test_non_finite_gradient_with_a_finite_loss_skips_the_step():
    model = build_model("tiny", TOKENIZER, seed=0)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    next(model.parameters()).register_hook(lambda grad: grad * math.nan)
    stats = _update(model, optimizer, _batch(poisoned=False), "f-tis")
    assert math.isfinite(stats["loss"]) and stats["skipped"] == 1.0
    assert skip_cause(stats) == "non-finite gradient norm (nan)"
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_max_skipped_steps_defaults_to_three_and_must_be_positive():
    from ftis_kernels.grpo.config import RESUMABLE

    assert build_config("smoke").max_skipped_steps == 3 and "max_skipped_steps" in RESUMABLE
    with pytest.raises(ValueError, match="max_skipped_steps: expected a value >= 1, got 0"):
        build_config("smoke", sets=("max_skipped_steps=0",))


def test_skipped_in_a_row_counts_each_nodes_trailing_skipped_rounds():
    from ftis_kernels.grpo.report import skipped_in_a_row

    flags = {0: [1, 0, 1, 1], 1: [1, 1, 1, 0], 2: [1, 1]}
    rows = [
        {"round": r, "node": n, "skipped": f} for n, fs in flags.items() for r, f in enumerate(fs)
    ]
    assert skipped_in_a_row(rows[::-1]) == {0: 2, 1: 0, 2: 2}


def test_improbable_logprobs_peer_sends_the_issues_sample_and_the_parser_accepts_it():
    pid = make_prompt_id("train", 0)  # one group of three
    honest = [Sample(pid, 1, s.tokens, s.logprobs, 0.0, 0.0) for s in _batch(poisoned=False)]
    sent = make_hostile(honest, "improbable_logprobs", len(TOKENIZER), torch.Generator())
    assert sent[0].logprobs[0] == IMPROBABLE_LOGPROB == -100.0 and sent[0].advantage > 0
    assert all(torch.equal(a.logprobs, b.logprobs) for a, b in zip(sent[1:], honest[1:]))
    got, drops = unpack(pack(sent), sender=1, vocab_size=len(TOKENIZER), max_tokens=64)
    assert len(got) == 3 and drops == []


# -- a peer's claims are checked: its advantage, its prompts ------------------------------------
@pytest.mark.parametrize("claim", [1e6, 1e20, 1e30, "negated"])
def test_a_peers_advantage_field_is_checked_against_its_groups_rewards(tmp_path, claim):
    """The receiver recomputes each peer group's advantages from its rewards: a claimed 1e6,
    1e20 or 1e30, or advantages negated next to true rewards, are dropped and the sender named."""
    from tests.test_grpo_units import _bare_node, _group

    for verify in (False, True):
        node = _bare_node(tmp_path, verify_rewards=verify)
        honest = _group(node, make_prompt_id("train", 5), (True, False, True, False))
        other = _group(node, make_prompt_id("train", 6), (False, True, False, False))
        tampered = [Sample(**vars(s)) for s in honest]
        if claim == "negated":
            for s in tampered:
                s.advantage = -s.advantage
        else:
            tampered[0].advantage = claim
        kept, drops = node.check_advantages(tampered + other)
        wrong = 4 if claim == "negated" else 1
        assert [(d.kind, d.sender) for d in drops] == [("advantage", 1)] * wrong, drops
        assert [_key(s) for s in kept] == [_key(s) for s in honest[wrong:] + other]


def _key(s: Sample) -> tuple:
    return s.prompt_id, s.source, s.tokens.tolist(), s.logprobs.tolist(), s.reward, s.advantage


def test_a_peer_group_of_the_wrong_size_is_dropped(tmp_path):
    from tests.test_grpo_units import _bare_node, _group

    node = _bare_node(tmp_path)
    group = _group(node, make_prompt_id("train", 5), (True, False, True, False))
    kept, drops = node.check_advantages(group[:3])
    assert kept == [] and [d.kind for d in drops] == ["advantage"] * 3
    assert "3 samples for prompt" in drops[0] and "a group is 4" in drops[0]


def test_horizontal_advantages_are_checked_against_the_reward_exchange(tmp_path):
    from ftis_kernels.grpo.rollout import horizontal_advantages
    from tests.test_grpo_units import _bare_node, _group

    node = _bare_node(tmp_path, collab="horizontal")
    pids = [make_prompt_id("train", i) for i in (0, 1)]
    swarm = torch.tensor([[[1.0, 0.0], [0.0, 0.0]], [[0.0, 1.0], [1.0, 1.0]]])  # (N, P, G/N)
    node.swarm_rewards, node.shared_prompts = swarm, {pid: p for p, pid in enumerate(pids)}
    advantages = horizontal_advantages(swarm)[1]
    share = []
    for p, pid in enumerate(pids):
        group = _group(node, pid, tuple(bool(r) for r in swarm[1, p].tolist()))
        for s, adv in zip(group, advantages[p].tolist()):
            s.advantage = adv
            share.append(s)
    kept, drops = node.check_advantages(share)
    assert [_key(s) for s in kept] == [_key(s) for s in share] and drops == []
    share[0].advantage, share[2].reward = 1e20, 0.0  # a false advantage; a reward not reported
    kept, drops = node.check_advantages(share)
    assert [_key(s) for s in kept] == [_key(share[1])]
    assert [d.kind for d in drops] == ["advantage"] * 3
    assert "it reported [1.0, 1.0] in the reward exchange" in drops[-1]


def test_a_peer_may_send_training_prompts_only(tmp_path):
    """Correct answers to the receiver's own test and OOD problems are dropped by the parser."""
    from ftis_kernels.grpo.task import Problems

    problems = Problems(0)
    splits = ("train", "test", "ood")
    tokens = torch.tensor([4, 5], dtype=torch.int32)
    samples = [Sample(make_prompt_id(sp, 3), 1, tokens, -torch.ones(2), 1.0, 0.5) for sp in splits]
    got, drops = unpack(
        pack(samples), sender=1, vocab_size=100, max_tokens=8, prompt_ok=problems.is_train
    )
    assert [_key(s) for s in got] == [_key(samples[0])]
    assert [d.kind for d in drops] == ["prompt", "prompt"]
    assert "is not a training problem" in drops[0]
    data = {}
    for split in splits:
        data[split] = str(tmp_path / f"{split}.jsonl")
        lines = [json.dumps({"question": f"{split} {i}", "answer": f"#### {i}"}) for i in range(2)]
        Path(data[split]).write_text("\n".join(lines))
    files = Problems(0, "jsonl", data)
    ids = [p.prompt_id for split in splits for p in files.files.split(split)]
    assert [files.is_train(pid) for pid in ids] == [True, True] + [False] * 4


def test_a_peer_whose_samples_make_the_update_non_finite_is_dropped_and_named(tmp_path):
    """Under --loss vis every round brings node 0 the -100 sample: node 0 retries its step without
    node 1's samples, takes it, and names node 1; it never skips a step, the swarm runs to the end.
    """
    rc, log, _ = run_swarm(
        "--preset",
        "smoke",
        "--out",
        str(tmp_path),
        "--rounds",
        "3",
        "--loss",
        "vis",
        "--set",
        "nodes.1.hostile=improbable_logprobs",
    )
    assert rc == 0, log[-3000:]
    for round_ in range(3):
        line = (
            f"node 0 (tiny-full) round {round_}: the update with every peer's samples was skipped"
        )
        assert line + " (non-finite loss" in log
    assert log.count("; without those of node 1 it is finite and was taken") == 3
    rows = rows_of(tmp_path)
    node0 = [r for r in rows if r["node"] == 0]
    assert [r["skipped"] for r in rows] == [0] * 6
    assert all(r["dropped_diverged"] > 0 and r["samples_received"] == 0 for r in node0)
    assert all(r["dropped_diverged"] == 0 for r in rows if r["node"] == 1)


def test_swarm_counts_skipped_steps_and_stops_after_max_skipped_steps_in_a_row(tmp_path):
    """With blame_peers off, under --loss vis every round brings node 0 the -100 sample: each step
    is skipped, logged and counted, the swarm stops after the third, and node 0's weights never
    changed."""
    from safetensors.torch import load_file

    rc, log, _ = run_swarm(
        "--preset",
        "smoke",
        "--out",
        str(tmp_path),
        "--loss",
        "vis",
        "--set",
        "nodes.1.hostile=improbable_logprobs",
        "--set",
        "blame_peers=false",
    )
    assert rc == 4, log[-3000:]  # the swarm's own exit code, not torchrun's 1
    (line,) = [x for x in log.splitlines() if "the swarm stopped" in x]
    assert "the swarm stopped with exit code 4: node 0 (tiny-full) skipped its optimizer" in line
    assert "Traceback" not in log and "ChildFailedError" not in log and "SIGTERM" not in log
    for round_ in range(3):
        assert f"node 0 (tiny-full) round {round_}: optimizer step skipped, non-finite loss" in log
    assert "node 0 (tiny-full) skipped its optimizer step 3 rounds in a row" in log
    assert "max_skipped_steps=3" in log
    assert "a --resume would repeat it" in log and "Continue from the checkpoint" not in log
    rows = rows_of(tmp_path)
    assert [(r["round"], r["node"], r["skipped"]) for r in rows] == [
        (r, n, int(n == 0)) for r in range(3) for n in range(2)
    ]
    assert "skipped" in (tmp_path / "summary.txt").read_text()
    ckpt = tmp_path / "ckpt" / "node0"
    start, after = (load_file(ckpt / f"round_0000{r}" / "model.safetensors") for r in (0, 2))
    assert all(
        torch.equal(start[k], after[k]) and bool(torch.isfinite(after[k]).all()) for k in start
    )


# -- checkpoints that prove themselves, metrics that survive a torn write -----------
def _spoil(path) -> None:
    """Write finite garbage (float32 123.0s) over the first tensor bytes of a safetensors file."""
    header = int.from_bytes(path.read_bytes()[:8], "little")
    with open(path, "r+b") as f:
        f.seek(8 + header)
        f.write(torch.full((16,), 123.0).numpy().tobytes())


def test_checkpoint_manifest_catches_finite_garbage_in_a_weights_file(tmp_path):
    from ftis_kernels.grpo import checkpoint

    model = build_model("tiny", TOKENIZER, seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sampler = torch.Generator().manual_seed(0)
    for round_ in (2, 4):
        checkpoint.save_node(tmp_path, 0, round_, model, optimizer, sampler, {"config": "x"})
    assert checkpoint.node_rounds(tmp_path, 0) == [4, 2]
    assert [checkpoint.verify_node(tmp_path, 0, r) for r in (4, 2)] == [None, None]
    _spoil(checkpoint.node_dir(tmp_path, 0, 4) / "model.safetensors")
    problem = checkpoint.verify_node(tmp_path, 0, 4)
    assert "model.safetensors does not match its sha256" in problem
    assert checkpoint.verify_node(tmp_path, 0, 2) is None
    (checkpoint.node_dir(tmp_path, 0, 2) / "rng.pt").unlink()
    assert "rng.pt is missing" in checkpoint.verify_node(tmp_path, 0, 2)
    (checkpoint.node_dir(tmp_path, 0, 2) / checkpoint.MANIFEST).write_text("{")
    assert "unreadable" in checkpoint.verify_node(tmp_path, 0, 2)


def test_resume_round_is_the_newest_that_every_node_has_good():
    from ftis_kernels.grpo.checkpoint import newest_common

    assert newest_common([[4, 2], [4, 2]]) == 4
    assert newest_common([[4, 2], [2]]) == 2
    assert newest_common([[4], [2]]) is None
    assert newest_common([[4, 2], []]) is None


def _metrics_file(tmp_path, tail: str = "", middle: str = ""):
    rows = [
        json.dumps({"round": r, "node": n, "reward_mean": 0.5}) for r in range(3) for n in range(2)
    ]
    path = tmp_path / "metrics.jsonl"
    path.write_text("\n".join(rows[:3] + ([middle] if middle else []) + rows[3:]) + "\n" + tail)
    return path


@pytest.mark.parametrize(
    "tail", ['{"round": 3, "node": 0, "rew', "\x00\x00\x00\x00", '["not", "a", "row"]\n']
)
def test_torn_or_garbage_last_metrics_line_is_dropped_with_a_warning(tmp_path, caplog, tail):
    from ftis_kernels.grpo.report import read_metrics

    rows = read_metrics(_metrics_file(tmp_path, tail=tail))
    assert [(r["round"], r["node"]) for r in rows] == [(r, n) for r in range(3) for n in range(2)]
    assert "line 7 (the last): dropped a torn or garbage row" in caplog.text


@pytest.mark.parametrize("middle", ['{"round": 1, "node": 1, "rew', "garbage", '{"node": 1}'])
def test_bad_metrics_line_before_the_last_is_an_error_naming_the_line(tmp_path, middle):
    from ftis_kernels.grpo.report import read_metrics

    with pytest.raises(ValueError, match=r"metrics.jsonl, line 4: .*fix or delete that line"):
        read_metrics(_metrics_file(tmp_path, middle=middle))


@pytest.fixture(scope="module")
def four_rounds(tmp_path_factory):
    out = tmp_path_factory.mktemp("faults") / "run"
    rc, log, _ = run_swarm("--preset", "smoke", "--out", str(out))
    assert rc == 0, log[-4000:]
    return out, rows_of(out)


def test_resume_falls_back_past_a_damaged_checkpoint_and_a_torn_metrics_line(four_rounds):
    """Finite garbage in node 1's newest weights (and later in node 0's older ones): --resume
    refuses when no round is good on every node, and otherwise reruns from the newest that is,
    giving the metrics of the uninterrupted run (extended by a fifth round)."""
    out, full = four_rounds
    ckpt = out / "ckpt"
    _spoil(ckpt / "node1" / "round_00004" / "model.safetensors")
    older = ckpt / "node0" / "round_00002" / "model.safetensors"
    intact = older.read_bytes()
    _spoil(older)
    rc, log, _ = run_swarm("--preset", "smoke", "--out", str(out), "--resume", "--rounds", "5")
    assert rc == 1, log[-4000:]  # a refusal: said once (by node 0, then the launcher), no hint
    said = [x for x in log.splitlines() if "--resume: no checkpoint under" in x]
    assert len(said) == 2 and all(x.count("--resume: no checkpoint") == 1 for x in said), said
    assert "node0 ERROR" in said[0] and "the swarm stopped with exit code 1: --resume" in said[1]
    assert "is good on every node" in log and "node 0: [4]; node 1: [2]" in log
    assert "Continue from the checkpoint" not in log and "Traceback" not in log
    older.write_bytes(intact)
    with open(out / "metrics.jsonl", "a") as f:
        f.write('{"round": 4, "node": 0, "rew')  # a write cut short by a kill
    rc, log, _ = run_swarm("--preset", "smoke", "--out", str(out), "--resume", "--rounds", "5")
    assert rc == 0, log[-4000:]
    assert "checkpoint of round 4 is damaged, not used" in log
    assert "model.safetensors does not match its sha256" in log
    assert "falling back to the checkpoint of round 2" in log
    assert "dropped a torn or garbage row" in log
    rows = comparable(rows_of(out))
    assert rows[:-2] == comparable(full) and [r["round"] for r in rows[-2:]] == [4, 4]


def test_resume_with_a_bad_metrics_line_before_the_last_names_the_line(four_rounds, tmp_path):
    import shutil

    out = tmp_path / "run"
    shutil.copytree(four_rounds[0], out)
    lines = (out / "metrics.jsonl").read_text().splitlines(keepends=True)
    lines[2] = "garbage\n"
    (out / "metrics.jsonl").write_text("".join(lines))
    rc, log, _ = run_swarm("--preset", "smoke", "--out", str(out), "--resume", "--rounds", "9")
    assert rc == 2 and "starting a local swarm" not in log  # the launcher refuses at once
    assert "ftis-grpo: --resume: " in log and "metrics.jsonl, line 3: " in log


_BUSY_NODE = """
import os, sys, torch
from ftis_kernels.grpo import worker
torch.set_num_threads(1)
worker.stop_on_signals(0)
worker.watch_parent(0, poll_s=0.02, grace_s=30.0)
a = torch.randn(4000, 4000)
print(os.getpid(), flush=True)
while True:
    torch.mm(a, a)  # most of a second in C, the GIL released: no Python signal handler runs
"""


def test_a_stop_signal_that_comes_with_its_torchruns_end_is_what_the_node_reports(tmp_path):
    """The launcher stopping a swarm signals the nodes, then kills torchrun: a node busy in a
    long kernel sees its parent gone before its main thread can run the signal's handler. It
    reports the signal (128 + SIGTERM), not its torchrun's end (128 + SIGHUP)."""
    env = {k: v for k, v in _env().items() if k != LAUNCHER_ENV}
    env[EXIT_REPORTS_ENV] = str(tmp_path)
    torchrun = f"import subprocess, sys; subprocess.run([sys.executable, '-c', {_BUSY_NODE!r}])"
    parent = subprocess.Popen(
        [sys.executable, "-c", torchrun],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        node = psutil.Process(int(parent.stdout.readline()))
        time.sleep(0.3)  # inside a matmul
        node.send_signal(signal.SIGTERM)
        parent.kill()
        node.wait(timeout=60)  # not this process's child: its code is in its exit report
        code, why = read_exit_reports(tmp_path)[0]
        assert (code, why) == (128 + signal.SIGTERM, "node 0: stopped by SIGTERM")
    finally:
        parent.kill()
        for p in psutil.Process().children(recursive=True):
            p.kill()


def test_a_stopped_local_swarm_exits_with_the_signal_not_a_peer_the_launcher_killed():
    """Ctrl-C to `ftis-grpo --transport hivemind`'s launcher: the peers get the signal, one that
    outlives the grace is killed by the launcher. The swarm's code is the signal's, not that
    peer's 137, which would rank as a failure of its own."""
    import threading

    from ftis_kernels.grpo.launch import supervise_peers, swarm_exit

    polite = "import signal, sys, time; signal.signal(signal.SIGTERM, lambda *a: sys.exit(143))"
    stubborn = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN)"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", f"{code}; print(1, flush=True); time.sleep(60)"],
            stdout=subprocess.PIPE,
        )
        for code in (polite, stubborn)
    ]
    try:
        for p in procs:
            p.stdout.readline()  # its handler is set
        threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGTERM)).start()
        codes, stopped_by = supervise_peers(procs, grace_s=1.0)
    finally:
        for p in procs:
            p.kill()
    assert codes == {0: 143, 1: 137} and stopped_by == signal.SIGTERM
    reports = {k: (c, f"peer {k} exited with code {c}.") for k, c in codes.items()}
    assert swarm_exit(128 + stopped_by, reports)[0] == 128 + signal.SIGTERM
