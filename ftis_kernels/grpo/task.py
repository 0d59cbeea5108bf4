"""The task: GSM8K-format arithmetic word problems, a strict binary reward, and a JSONL loader.

The built-in generator writes grade-school word problems whose worked answer follows GSM8K's format
("7+5=12. 12-3=9. #### 9"). A problem is a pure function of (seed, split, index), so every node
rebuilds a peer's prompt from its 64-bit prompt id alone and nothing but ids crosses the wire.

Splits: "train" and "test" (in distribution: 1-2 steps, operands 1-9) and "ood" (the stand-in for
MATH-500: 3-4 steps and operands up to 19, never seen in training); `Difficulty` moves both, and
with `ood_surface` the ood problems also speak of people and things no train or test problem
names (`OOD_NAMES`, `OOD_ITEMS`): the same arithmetic in words the model never trained on; with
`disjoint_splits` no test or ood problem computes a chain a train problem computes. For
real data, `JsonlTask` reads local GSM8K (`question`/`answer` with "#### x") or MATH-500
(`problem`/`answer`) files.

Rewards: the paper's binary correctness, or with `format_credit` > 0 partial credit: a
well-formed final answer ('#### x') that is wrong earns `format_credit`, a right one 1.
"""

from __future__ import annotations

import hashlib
import json
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Optional

NAMES = {"Ava": "She", "Ben": "He", "Cara": "She", "Dan": "He", "Eli": "He", "Fay": "She"}
ITEMS = ("apples", "pens", "cards", "books", "coins", "shells")
# The ood split's names and items under `Difficulty.ood_surface`: never in a train or test problem
# (nor in the vocabulary of a task without it, so that its token ids stay the original ones).
OOD_NAMES = {"Gus": "He", "Hana": "She", "Ivy": "She", "Jon": "He"}
OOD_ITEMS = ("stamps", "beads", "cups", "keys")
OPERATIONS = ("add", "sub")
SPLITS = ("train", "test", "ood", "file")
_SPLIT_CODE = {name: code for code, name in enumerate(SPLITS)}
_INDEX_BITS = 48

# The answer is the number after the last "####"; anything else after it makes the answer wrong.
_ANSWER_RE = re.compile(r"####\s*(-?[\d,]*\.?\d+)\s*$")


# Under `Difficulty.disjoint_splits`, one chain of computations in HELD_OUT goes to the test and
# ood splits only, the rest to train only: a chain is in one split, whatever its words.
HELD_OUT = 8


def _held_out(solution: str) -> bool:
    """Whether the chain `solution` ('7+5=12. 12-3=9.') belongs to the held-out (test, ood)
    side: the first byte of its SHA-256, modulo HELD_OUT, is 0."""
    return hashlib.sha256(solution.encode()).digest()[0] % HELD_OUT == 0


def make_prompt_id(split: str, index: int) -> int:
    """64-bit prompt id: the split's code in the high bits, the problem index in the low 48."""
    return (_SPLIT_CODE[split] << _INDEX_BITS) | index


def split_prompt_id(prompt_id: int) -> tuple[str, int]:
    """Inverse of `make_prompt_id`; ValueError for an id that names no problem."""
    code, index = prompt_id >> _INDEX_BITS, prompt_id & ((1 << _INDEX_BITS) - 1)
    if prompt_id < 0 or code >= len(SPLITS):
        raise ValueError(f"prompt_id: expected a valid id, got {prompt_id}")
    return SPLITS[code], index


@dataclass(frozen=True)
class Problem:
    """One prompt and its reference answer (the number or string after '####')."""

    prompt_id: int
    question: str
    solution: str
    answer: str


def extract_answer(text: str) -> Optional[str]:
    """The final answer of a GSM8K-format completion, normalised ('1,200' -> '1200'), or None."""
    match = _ANSWER_RE.search(text.strip())
    if match is None:
        return None
    return _normalise(match.group(1))


def _normalise(answer: str) -> str:
    """A number's canonical text, exact at any size ('1,200' and '1200.0' -> '1200'; '2.50' ->
    '2.5'); any other text as it is."""
    answer = answer.strip().replace(",", "")
    try:
        value = Decimal(answer)
    except InvalidOperation:
        return answer
    if not value.is_finite():
        return answer
    if value == value.to_integral_value():
        return str(int(value))
    return str(value.normalize())


def reward(completion: str, problem: Problem, format_credit: float = 0.0) -> float:
    """1.0 iff the extracted answer equals the reference; else `format_credit` when the completion
    ends in a well-formed '#### x', else 0. `format_credit` = 0 is the paper's binary reward."""
    got = extract_answer(completion)
    if got is None:
        return 0.0
    return 1.0 if got == _normalise(problem.answer) else format_credit


@dataclass(frozen=True)
class Difficulty:
    """How hard the generated problems are: the number of steps (drawn from [steps_min,
    steps_max]) and the largest operand, for the train and test splits and for the ood split;
    `ood_surface`: the ood problems use `OOD_NAMES` and `OOD_ITEMS`, words no train or test
    problem contains; `disjoint_splits`: no test or ood problem computes a chain (its worked
    solution) that a train problem computes (`_held_out`). The defaults are the task's original
    ones."""

    steps_min: int = 1
    steps_max: int = 2
    operand_max: int = 9
    ood_steps_min: int = 3
    ood_steps_max: int = 4
    ood_operand_max: int = 19
    ood_surface: bool = False
    disjoint_splits: bool = False

    def __post_init__(self):
        for prefix in ("", "ood_"):
            lo, hi = getattr(self, f"{prefix}steps_min"), getattr(self, f"{prefix}steps_max")
            if not 1 <= lo <= hi:
                raise ValueError(
                    f"{prefix}steps: expected 1 <= {prefix}steps_min <= {prefix}steps_max, "
                    f"got {lo}, {hi}"
                )
            if getattr(self, f"{prefix}operand_max") < 1:
                raise ValueError(f"{prefix}operand_max: expected a value >= 1")

    def of(self, split: str) -> tuple[int, int, int]:
        """(fewest steps, most steps, largest operand) of `split`'s problems."""
        if split == "ood":
            return self.ood_steps_min, self.ood_steps_max, self.ood_operand_max
        return self.steps_min, self.steps_max, self.operand_max


class ArithmeticTask:
    """Deterministic generator of GSM8K-format arithmetic problems.

    `problem(prompt_id)` is the same on every node. Only the supervised warm-up passes a subset of
    `operations` (a node warmed up on additions alone has a different "expertise"); such problems
    live under a different seed and never cross the wire.
    """

    def __init__(self, seed: int = 0, difficulty: Difficulty = Difficulty()):
        self.seed, self.difficulty = seed, difficulty

    def problem(self, prompt_id: int, *, operations: Sequence[str] = OPERATIONS) -> Problem:
        split, index = split_prompt_id(prompt_id)
        if split == "file":
            raise ValueError(f"prompt_id: {prompt_id} names a file problem, not a generated one")
        rng = random.Random(f"ftis-arith:{self.seed}:{split}:{index}:{','.join(operations)}")
        while True:
            question, solution, answer = self._draw(rng, split, operations)
            if not self.difficulty.disjoint_splits or _held_out(solution) == (split != "train"):
                return Problem(prompt_id, question, solution, answer)

    def _draw(self, rng: random.Random, split: str, operations: Sequence[str]):
        """(question, worked solution, answer) of one problem drawn from `rng`."""
        fewest, most, high = self.difficulty.of(split)
        steps = rng.randint(fewest, most)
        names, items = NAMES, ITEMS
        if split == "ood" and self.difficulty.ood_surface:
            names, items = OOD_NAMES, OOD_ITEMS
        name = rng.choice(sorted(names))
        pronoun, item = names[name], rng.choice(items)
        total = rng.randint(1, high)
        sentences = [f"{name} has {total} {item}."]
        work = []
        for _ in range(steps):
            op = rng.choice(list(operations))
            if op == "sub" and total <= 1:
                op = "add" if "add" in operations else op
            if op == "sub" and total > 1:
                amount = rng.randint(1, min(high, total - 1))
                sentences.append(f"{pronoun} gives away {amount}.")
                work.append(f"{total}-{amount}={total - amount}.")
                total -= amount
            else:
                amount = rng.randint(1, high)
                sentences.append(f"{pronoun} gets {amount} more.")
                work.append(f"{total}+{amount}={total + amount}.")
                total += amount
        sentences.append(f"How many {item} does {name} have now?")
        return " ".join(sentences), " ".join(work), str(total)

    def target(self, problem: Problem, *, gsm8k_format: bool = True) -> str:
        """A supervised completion for warm-up: worked steps then '#### answer' (GSM8K's format),
        or, with gsm8k_format=False, 'The answer is answer.', which the strict reward rejects."""
        if gsm8k_format:
            return f"{problem.solution} #### {problem.answer}"
        return f"{problem.solution} The answer is {problem.answer}."

    def vocabulary_text(self) -> list[str]:
        """Every word and symbol a generated problem or answer can contain."""
        words = list(NAMES) + list(NAMES.values()) + list(ITEMS)
        if self.difficulty.ood_surface:
            words += list(OOD_NAMES) + list(OOD_ITEMS)
        words += "Q A The answer is has gives away gets more How many does have now ? . + - = ####".split()  # noqa: E501
        return words


def format_prompt(question: str) -> str:
    """The prompt a model sees; the completion follows it directly."""
    return f"Q: {question}\nA: "


class JsonlTask:
    """Problems from local JSONL files (GSM8K: question/answer with '#### x'; MATH-500: problem/answer).

    Prompt ids are `make_prompt_id("file", line_index)` into `paths[split]`; the completion must end
    with '#### answer' for the strict reward (as the GSM8K format asks).
    """  # noqa: E501

    def __init__(self, paths: dict[str, str]):
        self.problems: dict[str, list[Problem]] = {}
        for split, path in paths.items():
            self.problems[split] = load_jsonl(path, split)

    def split(self, name: str) -> list[Problem]:
        if name not in self.problems:
            raise ValueError(f"task: no JSONL file given for split {name!r}")
        return self.problems[name]


# A reference answer the reward can match: a number, as `_ANSWER_RE` reads it from '#### x'.
_NUMBER_RE = re.compile(r"-?[\d,]*\.?\d+")


def parse_jsonl_row(line: str) -> tuple[str, str, str]:
    """(question, worked solution, final answer) of one JSONL line; ValueError saying what is
    wrong with it. A line is a JSON object with `question` (GSM8K) or `problem` (MATH-500), both
    strings, and `answer`: GSM8K's '<worked solution> #### <number>', or a bare number; other
    fields are ignored. The answer must be a number because the reward compares it with the
    number after a completion's '####'."""
    try:
        row = json.loads(line)
    except ValueError as exc:
        raise ValueError(f"not JSON ({exc.msg} at column {exc.colno})") from None
    if not isinstance(row, dict):
        raise ValueError(f"a JSON {type(row).__name__}, not an object")
    question = row.get("question", row.get("problem"))
    if not isinstance(question, str) or not question.strip():
        raise ValueError("no 'question' (or 'problem') string")
    answer = row.get("answer")
    if isinstance(answer, (int, float)) and not isinstance(answer, bool):
        answer = str(answer)
    if not isinstance(answer, str) or not answer.strip():
        raise ValueError("no 'answer' string")
    solution = ""
    if "####" in answer:
        solution, answer = answer.rsplit("####", 1)
    if _NUMBER_RE.fullmatch(answer.strip()) is None:
        raise ValueError(
            f"answer {answer.strip()!r} is not a number: it must end in '#### <number>' "
            "(GSM8K) or be one"
        )
    return question, solution.strip(), answer.strip()


def load_jsonl(path: str, split: str) -> list[Problem]:
    """The problems of a JSONL file (`parse_jsonl_row` gives the schema of a line; blank lines
    are skipped); ValueError naming `path:line` and what is wrong, or an empty file."""
    problems = []
    offset = {"train": 0, "test": 1 << 40, "ood": 2 << 40}.get(split, 0)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    for lineno, line in enumerate(text.splitlines()):
        if not line.strip():
            continue
        try:
            question, solution, answer = parse_jsonl_row(line)
        except ValueError as exc:
            raise ValueError(f"{path}:{lineno + 1}: {exc}") from None
        problems.append(
            Problem(make_prompt_id("file", offset + lineno), question, solution, answer)
        )
    if not problems:
        raise ValueError(f"{path}: no problems (every line is blank)")
    return problems


class Problems:
    """The problems behind prompt ids: the built-in generator (`task="arith"`) or local JSONL files
    (`task="jsonl"`, `data` mapping split -> path), and the ids a run draws from them."""

    def __init__(
        self,
        seed: int,
        task: str = "arith",
        data: Optional[dict[str, str]] = None,
        difficulty: Difficulty = Difficulty(),
    ):
        self.arith = ArithmeticTask(seed, difficulty)
        self.files = JsonlTask(data or {}) if task == "jsonl" else None
        self._by_id = (
            {p.prompt_id: p for ps in self.files.problems.values() for p in ps}
            if self.files
            else {}
        )
        self._train = {p.prompt_id for p in self.files.split("train")} if self.files else set()

    def problem(self, prompt_id: int) -> Problem:
        if self.files is not None:
            return self._by_id[prompt_id]
        return self.arith.problem(prompt_id)

    def is_train(self, prompt_id: int) -> bool:
        """Whether `prompt_id` names a training problem: the only prompts a peer may send, so that
        no peer can train a node on its own test or OOD problems."""
        if self.files is not None:
            return prompt_id in self._train
        try:
            return split_prompt_id(prompt_id)[0] == "train"
        except ValueError:
            return False

    def train_ids(self, indices: range) -> list[int]:
        """Prompt ids of the training problems at `indices` (files wrap around)."""
        if self.files is not None:
            train = self.files.split("train")
            return [train[i % len(train)].prompt_id for i in indices]
        return [make_prompt_id("train", i) for i in indices]

    def eval_ids(self, split: str, n: int) -> list[int]:
        """The first `n` prompt ids of an evaluation split ("test" or "ood")."""
        if self.files is not None:
            return [p.prompt_id for p in self.files.split(split)[:n]]
        return [make_prompt_id(split, i) for i in range(n)]
