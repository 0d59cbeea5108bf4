"""The lean core: `import ftis_kernels` needs torch and triton only, and whatever needs an extra
names it in one line when a package is missing (simulated here by hiding the package)."""

import importlib.metadata
import os
import re
import subprocess
import sys
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python < 3.11
    import tomli as tomllib

from ftis_kernels import _extras
from ftis_kernels._extras import EXTRAS

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
HEAVY = ("transformers", "peft", "yaml", "matplotlib", "tqdm", "trl", "tokenizers", "safetensors")


def _python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300
    )


def _hide(*names: str) -> str:
    """Code that makes `names` unimportable, as if they were not installed."""
    return "import sys\n" + "".join(f"sys.modules[{n!r}] = None\n" for n in names)


def _name(requirement: str) -> str:
    return re.split(r"[<>=!~;\[ ]", requirement, maxsplit=1)[0].lower()


def test_core_dependencies_are_torch_triton_numpy_only():
    assert {_name(r) for r in PYPROJECT["dependencies"]} == {"torch", "triton", "numpy"}


def test_each_extra_lists_the_distributions_of_its_import_names():
    extras = PYPROJECT["optional-dependencies"]
    dists = importlib.metadata.packages_distributions()
    for extra, modules in EXTRAS.items():
        listed = {_name(r) for r in extras[extra]}
        for ref in [r for r in extras[extra] if r.startswith("ftis-kernels[")]:
            inner = ref[len("ftis-kernels[") : -1].split(",")
            listed |= {_name(r) for e in inner for r in extras[e]}
        for module in modules:
            # A package not installed here (verl installs apart) is its own distribution.
            provided = {d.lower() for d in dists.get(module, [module])}
            assert provided & listed, (extra, module, provided)
    # verl pins a torch that would replace the CPU build: it installs apart (pyproject's note).
    assert set(extras["all"][0][len("ftis-kernels[") : -1].split(",")) == set(extras) - {
        "all",
        "verl",
    }


def test_import_ftis_kernels_loads_no_optional_package():
    # torch itself imports tqdm when it is installed (torch.hub): count only what we add.
    code = (
        "import sys, torch, triton\n"
        "before = set(sys.modules)\n"
        "import ftis_kernels\n"
        f"print(sorted(m for m in {HEAVY!r} if m in set(sys.modules) - before))"
    )
    result = _python(code)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_ops_run_with_every_optional_package_hidden():
    code = _hide(*HEAVY) + (
        "import torch\n"
        "from ftis_kernels import ftis_linear_loss, ftis_loss\n"
        "logits = torch.randn(2, 3, 11, requires_grad=True)\n"
        "tokens = torch.randint(0, 11, (2, 3))\n"
        "gen, adv = -torch.rand(2, 3), torch.tensor([1.0, -1.0])\n"
        "ftis_loss(logits, tokens, gen, adv)[0].backward()\n"
        "hidden, weight = torch.randn(2, 3, 5, requires_grad=True), torch.randn(11, 5)\n"
        "ftis_linear_loss(hidden, weight, tokens, gen, adv, None)[0].backward()\n"
        "print(logits.grad.abs().sum().item() > 0, hidden.grad.abs().sum().item() > 0)\n"
    )
    result = _python(code)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["True", "True"]


def test_ftis_grpo_without_its_extra_says_so_in_one_line_and_exits_2(tmp_path):
    # The console script as pip writes it for pyproject's entry point, with a package hidden.
    module, function = PYPROJECT["scripts"]["ftis-grpo"].split(":")
    script = tmp_path / "ftis-grpo"
    script.write_text(
        _hide("yaml")
        + f"import re\nfrom {module} import {function}\n"
        + "if __name__ == '__main__':\n"
        + "    sys.argv[0] = re.sub(r'(-script\\.pyw|\\.exe)?$', '', sys.argv[0])\n"
        + f"    sys.exit({function}())\n"
    )
    result = subprocess.run(
        [sys.executable, str(script), "--preset", "smoke", "--out", "unused"],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 2
    assert result.stdout == ""
    assert result.stderr.splitlines() == [
        "ftis-grpo: needs the 'grpo' extra: pip install -e \".[grpo]\" (missing: yaml)"
    ]


def test_python_m_ftis_kernels_grpo_without_its_extra_says_so_in_one_line_and_exits_2(tmp_path):
    # A sitecustomize hides the package before `python -m` imports ftis_kernels.grpo.
    (tmp_path / "sitecustomize.py").write_text("import sys\nsys.modules['transformers'] = None\n")
    result = subprocess.run(
        [sys.executable, "-m", "ftis_kernels.grpo", "--help"],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 2, result.stderr
    assert result.stderr.splitlines() == [
        f"ftis-grpo: needs the 'grpo' extra: pip install -e \"{ROOT}[grpo]\" "
        "(missing: transformers)"
    ]


def test_the_install_hint_is_the_command_that_works_from_where_the_package_came(
    tmp_path, monkeypatch
):
    assert _extras.install_command("trl") == 'pip install -e ".[trl]"'  # the tests run in ROOT
    monkeypatch.chdir(tmp_path)
    assert _extras.install_command("trl") == f'pip install -e "{ROOT}[trl]"'
    monkeypatch.setattr(_extras, "_TREE", tmp_path)  # installed into site-packages
    wheel = "/tmp/dist/ftis_kernels-0.1.0-py3-none-any.whl"
    monkeypatch.setattr(_extras, "_direct_url", lambda: {"url": f"file://{wheel}"})
    assert _extras.install_command("grpo") == f'pip install "{wheel}[grpo]"'
    monkeypatch.setattr(_extras, "_direct_url", lambda: None)  # from a package index
    assert _extras.install_command("grpo") == 'pip install "ftis-kernels[grpo]"'


def test_importing_the_driver_or_an_integration_without_the_extra_names_it():
    for module, hidden, extra, named in (
        ("ftis_kernels.grpo.cli", "transformers", "grpo", "ftis_kernels.grpo"),
        ("ftis_kernels.integrations.trl", "trl", "trl", "ftis_kernels.integrations.trl"),
        ("ftis_kernels.integrations.genrl", "genrl", "genrl", "ftis_kernels.integrations.genrl"),
        ("ftis_kernels.integrations.verl", "verl", "verl", "ftis_kernels.integrations.verl"),
    ):
        code = _hide(hidden) + (
            "try:\n"
            f"    import {module}\n"
            "except ImportError as err:\n"
            "    print(type(err).__name__, err)\n"
        )
        result = _python(code)
        assert result.returncode == 0, result.stderr
        assert result.stdout.strip() == (
            f"MissingExtraError {named}: needs the '{extra}' extra: "
            f'pip install -e ".[{extra}]" (missing: {hidden})'
        )


def test_hf_helper_imports_without_peft_or_transformers():
    result = _python(_hide("peft", "transformers") + "import ftis_kernels.integrations.hf\n")
    assert result.returncode == 0, result.stderr
