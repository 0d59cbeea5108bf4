"""The suite's closing summary stays short: the per-dtype error table goes to a file, and into
the terminal only with --error-table."""

from tests import conftest, numerics


class _Reporter:
    def __init__(self):
        self.lines: list[str] = []

    def section(self, title):
        self.lines.append(f"== {title}")

    def write_line(self, line):
        self.lines.append(line)


class _Cache:
    def __init__(self, root):
        self.root = root

    def mkdir(self, name):
        path = self.root / ".pytest_cache" / "d" / name
        path.mkdir(parents=True, exist_ok=True)
        return path


class _Config:
    def __init__(self, root, error_table):
        self.rootpath, self.cache, self._error_table = root, _Cache(root), error_table

    def getoption(self, name):
        assert name == "error_table"
        return self._error_table


def _summary(tmp_path, monkeypatch, error_table):
    errors = {("bfloat16", "triton", "dlogits"): 1e-3, ("float32", "torch", "loss"): 2e-7}
    monkeypatch.setattr(numerics, "MAX_ERRORS", errors)
    monkeypatch.setattr(numerics, "EXAMPLES", {"count": 7})
    reporter = _Reporter()
    conftest.pytest_terminal_summary(reporter, _Config(tmp_path, error_table))
    table = (tmp_path / ".pytest_cache" / "d" / "ftis" / "error_table.txt").read_text()
    return reporter.lines, table.splitlines()


def test_summary_is_one_line_naming_the_table_file(tmp_path, monkeypatch):
    lines, table = _summary(tmp_path, monkeypatch, error_table=False)
    assert lines == [
        "property tests: 7 examples; largest errors against the float64 reference in "
        ".pytest_cache/d/ftis/error_table.txt; --error-table prints it"
    ]
    assert table == [
        "property examples run: 7",
        "bfloat16  triton  dlogits            1.000e-03",
        "float32   torch   loss               2.000e-07",
    ]


def test_error_table_flag_prints_the_table(tmp_path, monkeypatch):
    lines, table = _summary(tmp_path, monkeypatch, error_table=True)
    assert lines[1:] == table and lines[0].startswith("== property tests")
