"""The command line as a user meets it: which flag or key an error names, the checks of data
files and model folders before torchrun starts, `ftis-grpo export`, and what the terminal shows."""

from __future__ import annotations

import json
import logging
import re
import shutil
from pathlib import Path

import pytest
import torch

from ftis_kernels.grpo import cli
from ftis_kernels.grpo.checkpoint import mark_latest, save_node
from ftis_kernels.grpo.config import RESUMABLE, ConfigError, build_config, describe_keys, to_dict
from ftis_kernels.grpo.model_folder import model_folder_problem
from ftis_kernels.grpo.models import apply_lora, build_model, load_pretrained, warm_up
from ftis_kernels.grpo.process import CLEAR_LINE, log_formatter
from ftis_kernels.grpo.report import write_run_config
from ftis_kernels.grpo.run_folder import check_resume
from ftis_kernels.grpo.task import ArithmeticTask, format_prompt, load_jsonl
from ftis_kernels.grpo.tokenizer import build_tokenizer
from tests.test_faults import _fake_run, ftis_grpo

# A value given by a flag is named by the flag, as argparse names it for a value of the wrong
# type; the same value given by --set (or a --config file) is named by its key.
NAMING = [
    (["--rounds", "x"], "--rounds: expected an integer, got 'x'"),
    (["--rounds", "-3"], "--rounds: expected a value >= 1, got -3"),
    (["--set", "rounds=-3"], "rounds: expected a value >= 1, got -3"),
    (["--rounds", "4", "--set", "rounds=-3"], "rounds: expected a value >= 1, got -3"),
    (["--is-cap", "0"], "--is-cap: expected a value > 0"),
    (["--timeout", "-1"], "--timeout: expected a value > 0"),
    (["--kl-threshold", "-1"], "--kl-threshold: expected a value >= 0"),
    # A loss option given in loss_options is named by its key there, not as the op names it.
    (["--set", "loss_options.epsilon_high=-1"], "loss_options.epsilon_high: expected a finite"),
    (["--set", "loss_options.is_mode=x"], "loss_options.is_mode: expected one of ('none'"),
]


@pytest.mark.parametrize("args, line", NAMING, ids=[" ".join(a) for a, _ in NAMING])
def test_an_error_names_the_flag_the_value_came_from(tmp_path, args, line):
    rc, err = ftis_grpo("--preset", "smoke", *args, out=tmp_path / "run")
    assert rc == 2 and len(err) == 1 and err[0].startswith(f"ftis-grpo: {line}"), err


def test_a_set_of_a_nodes_model_wins_over_model_as_every_set_wins_over_flags():
    # --model used to replace every node's model after the --set's, the last layer.
    def models(*argv: str) -> list:
        return [n.model for n in cli.config_from_args(cli.parse_args(argv)).nodes]

    assert models("--preset", "smoke", "--model", "a") == ["a", "a"]
    assert models("--preset", "smoke", "--model", "a", "--set", "nodes.0.model=b") == ["b", "a"]
    assert models("--preset", "smoke", "--set", "nodes.1={model: c}", "--model", "a") == ["a", "c"]
    nodes = "nodes=[{model: d}, {model: e}]"
    assert models("--preset", "smoke", "--model", "a", "--set", nodes) == ["d", "e"]


def test_the_resume_refusal_lists_every_key_a_resume_may_change(tmp_path):
    before = build_config("smoke", overrides={"out": str(tmp_path)})
    _fake_run(tmp_path, before, rounds_done=2)
    now = build_config("smoke", overrides={"out": str(tmp_path), "resume": True, "seed": 5})
    with pytest.raises(ConfigError) as refused:
        check_resume(now)
    (line,) = refused.value.lines
    changeable = line.split("may change only ", 1)[1].removesuffix("), got 5")
    assert changeable.split(", ") == [k for k in RESUMABLE if k not in ("out", "resume")]
    assert "pack, pack_row_tokens" in line


# -- the files a run reads: checked in the launcher, one line naming the flag or key, exit 2 ------
@pytest.fixture(scope="module")
def run_with_ckpt(tmp_path_factory) -> tuple[Path, torch.nn.Module]:
    """A smoke run's output folder with the checkpoint of round 2 of both nodes (node 1 a LoRA
    adapter whose B matrices are not zero, so merging it changes the weights); returns the
    folder and node 1's model."""
    out = tmp_path_factory.mktemp("run")
    cfg = build_config("smoke", overrides={"out": str(out)})
    write_run_config(out, to_dict(cfg))
    tokenizer = build_tokenizer(ArithmeticTask().vocabulary_text())
    models = []
    for node in (0, 1):
        spec = cfg.node(node)
        model = build_model(spec.arch, tokenizer, seed=node)
        if spec.lora:
            model = apply_lora(model, spec.lora_r, spec.lora_alpha, seed=node)
            with torch.no_grad():
                for name, p in model.named_parameters():
                    if "lora_B" in name:
                        p.normal_(0, 0.05)
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
        save_node(out / "ckpt", node, 2, model, optimizer, torch.Generator(), {"name": spec.name})
        models.append(model)
    mark_latest(out / "ckpt", 2)
    return out, models[1]


@pytest.fixture(scope="module")
def model_folder(run_with_ckpt, tmp_path_factory) -> Path:
    """Node 1's checkpoint, exported by `ftis-grpo export`."""
    out, _ = run_with_ckpt
    to = tmp_path_factory.mktemp("models") / "tiny-lora"
    assert cli.main(["export", str(out), "--node", "1", "--to", str(to)]) == 0
    return to


def test_export_writes_a_model_folder_with_the_checkpointed_weights(run_with_ckpt, model_folder):
    _, trained = run_with_ckpt
    assert model_folder_problem(str(model_folder)) is None
    model, tokenizer = load_pretrained(str(model_folder))
    ids = torch.tensor([tokenizer(format_prompt("Ava has 3 pens. How many pens?"))["input_ids"]])
    with torch.no_grad():
        expected, got = trained(input_ids=ids).logits, model(input_ids=ids).logits
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_export_builds_the_vocabulary_the_run_trained_with(tmp_path):
    """A run with ood_surface's extra words: its models' vocabulary is larger than the default
    task's, and the export builds the run's own."""
    out = tmp_path
    cfg = build_config("smoke", overrides={"out": str(out), "ood_surface": True})
    write_run_config(out, to_dict(cfg))
    tokenizer = build_tokenizer(ArithmeticTask(cfg.seed, cfg.difficulty()).vocabulary_text())
    assert len(tokenizer) > len(build_tokenizer(ArithmeticTask().vocabulary_text()))
    model = build_model(cfg.node(0).arch, tokenizer, seed=0)
    optimizer = torch.optim.AdamW(model.parameters())
    save_node(out / "ckpt", 0, 1, model, optimizer, torch.Generator(), {"name": "n0"})
    mark_latest(out / "ckpt", 1)
    to = tmp_path / "exported"
    assert cli.main(["export", str(out), "--node", "0", "--to", str(to)]) == 0
    assert len(load_pretrained(str(to))[1]) == len(tokenizer)


def test_a_checkpoint_round_given_as_model_names_the_export_command_that_makes_one(
    run_with_ckpt, tmp_path
):
    out, _ = run_with_ckpt
    round_folder = out / "ckpt" / "node1" / "round_00002"
    rc, err = ftis_grpo("--preset", "smoke", "--model", str(round_folder), out=tmp_path / "r")
    assert rc == 2 and len(err) == 1, err
    assert err[0].startswith(
        "ftis-grpo: --model: expected a Hugging Face model folder (config.json, weights, "
        f"tokenizer), got '{round_folder}', a checkpoint of ftis-grpo, not a model folder"
    )
    command = re.search(r"\((ftis-grpo export .*) writes one\)", err[0]).group(1).split()
    to = tmp_path / "exported"
    assert cli.main([*command[1:-1], str(to)]) == 0  # the command as printed, DIR filled in
    assert model_folder_problem(str(to)) is None


@pytest.mark.parametrize(
    "args, error",
    [
        (["--node", "5"], "--node: expected a node of the run in {out}: [0, 1], got 5"),
        (["--round", "1"], "--round: expected a round checkpointed for node 0: [2], got 1"),
        (["--to", "{out}"], "--to: expected a new or empty folder, got '{out}'"),
    ],
)
def test_export_refuses_what_it_cannot_do_in_one_line(run_with_ckpt, tmp_path, capsys, args, error):
    out, _ = run_with_ckpt
    args = [a.format(out=out) for a in args]
    argv = ["export", str(out), *args] + ([] if "--to" in args else ["--to", str(tmp_path / "m")])
    assert cli.main(argv) == 2
    assert capsys.readouterr().err.splitlines() == [f"ftis-grpo export: {error.format(out=out)}"]


def test_export_names_a_model_folder_of_the_run_that_is_not_there(run_with_ckpt, tmp_path, capsys):
    # It was a traceback from transformers, which took the path for a Hub model id.
    out, _ = run_with_ckpt
    run = tmp_path / "run"
    shutil.copytree(out, run)
    config = json.loads((run / "config.json").read_text())
    config["nodes"][0]["model"] = "models/moved"  # relative: read from the current folder
    (run / "config.json").write_text(json.dumps(config))
    assert cli.main(["export", str(run), "--to", str(tmp_path / "m")]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "ftis-grpo export: nodes.0.model: expected the run's model folder (a relative path is read "
        "from the current folder), got 'models/moved', which does not exist"
    ]
    assert not (tmp_path / "m").exists()


BAD_MODELS = [
    ("{nowhere}", "'{nowhere}', which does not exist"),
    ("{empty}", "'{empty}', which has no readable config.json, no weights"),
]


@pytest.mark.parametrize("model, got", BAD_MODELS, ids=["missing", "empty"])
def test_a_bad_model_is_one_line_naming_model_for_every_node(tmp_path, model, got):
    paths = {"nowhere": tmp_path / "nonexistent", "empty": tmp_path / "empty"}
    paths["empty"].mkdir()
    model = model.format(**paths)
    rc, err = ftis_grpo("--preset", "demo", "--model", model, out=tmp_path / "run")
    assert rc == 2 and len(err) == 1, err  # the demo's 3 nodes share the one --model
    assert err[0].startswith(
        "ftis-grpo: --model: expected a Hugging Face model folder (config.json, weights, "
        f"tokenizer), got {got.format(**paths)}"
    )
    assert not (tmp_path / "run").exists()


GOOD = json.dumps({"question": "Ava has 2 pens. How many?", "answer": "2+0=2. #### 2"})
BAD_LINES = [
    ("not json", "not JSON (Expecting value at column 1)"),
    ("[1, 2]", "a JSON list, not an object"),
    (json.dumps({"answer": "#### 2"}), "no 'question' (or 'problem') string"),
    (json.dumps({"question": "Q?"}), "no 'answer' string"),
    (
        json.dumps({"question": "Q?", "answer": "2+2=4"}),
        "answer '2+2=4' is not a number: it must end in '#### <number>' (GSM8K) or be one",
    ),
    (
        json.dumps({"problem": "Q?", "answer": "\\frac{1}{2}"}),
        "answer '\\\\frac{1}{2}' is not a number",
    ),
]


@pytest.mark.parametrize("line, why", BAD_LINES, ids=[w.split(" (")[0] for _, w in BAD_LINES])
def test_a_bad_data_line_is_one_line_naming_the_key_file_and_line(
    model_folder, tmp_path, line, why
):
    good, bad = tmp_path / "good.jsonl", tmp_path / "bad.jsonl"
    good.write_text(GOOD + "\n")
    bad.write_text(f"{GOOD}\n\n{line}\n{GOOD}\n")  # the blank line 2 counts, and is skipped
    sets = [f"data.train={bad}", f"data.test={good}", f"data.ood={good}", "task=jsonl"]
    args = [a for kv in sets for a in ("--set", kv)] + ["--model", str(model_folder)]
    rc, err = ftis_grpo("--preset", "smoke", *args, out=tmp_path / "run")
    assert rc == 2 and len(err) == 1, err
    assert err[0].startswith(
        'ftis-grpo: data.train: expected a JSONL file of {"question" (or "problem"), "answer"} '
        "objects, got "
    )
    assert f"got {bad}:3: {why}" in err[0], err[0]
    assert not (tmp_path / "run").exists()


def test_a_train_file_of_fewer_problems_than_prompts_per_node_is_refused(model_folder, tmp_path):
    # A node's prompts of a round would repeat one: its two groups, read by a receiver as one
    # group of the wrong size, were dropped as a false claim of an honest peer.
    train, good = tmp_path / "train.jsonl", tmp_path / "good.jsonl"
    train.write_text(GOOD + "\n")
    good.write_text(GOOD + "\n")
    sets = [f"data.train={train}", f"data.test={good}", f"data.ood={good}", "task=jsonl"]
    args = [a for kv in sets for a in ("--set", kv)] + ["--model", str(model_folder)]
    rc, err = ftis_grpo("--preset", "smoke", *args, out=tmp_path / "run")
    assert rc == 2 and err == [
        "ftis-grpo: data.train: expected at least prompts_per_node = 2 problems (a node's "
        f"prompts of a round must differ), got '{train}', which holds 1"
    ], err
    assert not (tmp_path / "run").exists()
    train.write_text(GOOD + "\n" + GOOD + "\n")
    rc, err = ftis_grpo("--preset", "smoke", *args, "--print-config", out=tmp_path / "run")
    assert rc == 0, err


def test_jsonl_schema_reads_gsm8k_math500_and_numbers(tmp_path):
    path = tmp_path / "mixed.jsonl"
    rows = [
        {"question": "Q1?", "answer": "3*4=12. #### 1,200"},
        {"problem": "Q2?", "answer": "-0.5", "level": 3},
        {"problem": "Q3?", "answer": 7},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    got = [(p.question, p.solution, p.answer) for p in load_jsonl(str(path), "train")]
    assert got == [("Q1?", "3*4=12.", "1,200"), ("Q2?", "", "-0.5"), ("Q3?", "", "7")]
    path.write_text("\n\n")
    with pytest.raises(ValueError, match="no problems"):
        load_jsonl(str(path), "train")


# -- what the terminal shows ----------------------------------------------------------------------
def test_list_keys_fits_in_100_columns_and_each_key_starts_a_line(capsys):
    assert cli.main(["--list-keys"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert max(len(line) for line in lines) <= 100
    starts = [line.split(":", 1)[0] for line in lines if not line.startswith(" ")]
    assert starts == [row[0] for row in describe_keys()]


def test_on_a_terminal_a_node_log_line_starts_by_clearing_the_progress_bar_line():
    record = logging.LogRecord("ftis_kernels.grpo", logging.INFO, "", 0, "hello", None, None)
    assert log_formatter(1, terminal=True).format(record).startswith(CLEAR_LINE)
    assert (
        log_formatter(1, terminal=True)
        .format(record)
        .endswith("node1 INFO ftis_kernels.grpo: hello")
    )
    assert not log_formatter(1, terminal=False).format(record).startswith("\r")


def test_warm_up_logs_its_progress_only_without_a_progress_bar(caplog):
    tokenizer = build_tokenizer(ArithmeticTask().vocabulary_text())
    recipe = dict(steps=4, lr=1e-3, batch_size=2, seed=0, operations=["add"])
    with caplog.at_level(logging.INFO, logger="ftis_kernels.grpo.models"):
        warm_up(build_model("tiny", tokenizer, 0), tokenizer, ArithmeticTask(), **recipe)
        assert sum("warm-up step" in r.message for r in caplog.records) == 4
        caplog.clear()
        steps = []
        warm_up(
            build_model("tiny", tokenizer, 0),
            tokenizer,
            ArithmeticTask(),
            on_step=lambda step, loss: steps.append(step),
            **recipe,
        )
        assert steps == [1, 2, 3, 4] and not any("warm-up" in r.message for r in caplog.records)
