"""Every code block in the docs (docs/**/*.md and README.md) runs or is checked here, so the docs cannot rot.

One test per page. What happens to a fenced block depends on its language:

* ``python``: executed, in page order, in one namespace per page, in a scratch working directory
  (with ``examples/`` reachable). A block of ``>>>`` lines runs as a doctest: its printed output
  must match.
* ``yaml``: parsed. A recipe (it has ``model``) is validated as a ``TrainerConfig``; a fragment whose
  keys are all recipe fields is validated on top of ``examples/digits_baseline.yaml``.
* ``toml``: parsed.
* ``bash`` / ``console``: each command is checked without being run: ``composerjax ...`` parses
  with the real argument parser and its recipe (with ``--set`` overrides) validates; ``make X``
  names a Makefile target; other programs must be on a known list (cluster tools are only shown).
* ``text`` (output, error messages, layouts) and ``mermaid`` (diagrams) are not code.

A page with ``<!-- docs-test: cpu-devices=N -->`` runs in its own process with N simulated CPU
devices (multi-device examples need them before JAX starts); ``<!-- docs-test: own-process -->``
runs in its own process too (for pages that register names in the process-wide registries).

A fence with no language fails: say what the block is.
"""

from __future__ import annotations

import doctest
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib

REPO = Path(__file__).resolve().parents[2]
PAGES = sorted((REPO / "docs").rglob("*.md")) + [REPO / "README.md"]
FENCE = re.compile(r"^(?P<indent>[ ]*)```(?P<info>[^`\n]*)\n(?P<body>.*?)^(?P=indent)```[ ]*$", re.M | re.S)
SHOWN_ONLY = {"srun", "sbatch", "kubectl", "pip", "git", "cd", "export", "python", "uv", "tensorboard", "nvidia-smi"}
NOT_CODE = {"text", "mermaid"}
OWN_PROCESS = re.compile(r"<!-- docs-test: (?:own-process|cpu-devices=(\d+)) -->")


def blocks(page: Path) -> list[tuple[int, str, str]]:
    """``(line, language, body)`` for each fenced block of ``page``, indentation removed."""
    text = page.read_text()
    found = []
    for match in FENCE.finditer(text):
        indent = len(match["indent"])
        body = "".join(line[indent:] if line[:indent].isspace() else line
                       for line in match["body"].splitlines(keepends=True))
        language = match["info"].strip().split(" ")[0].lower()
        found.append((text.count("\n", 0, match.start()) + 1, language, body))
    return found


def run_python(body: str, namespace: dict, where: str, line: int = 0) -> None:
    if body.lstrip().startswith(">>>"):
        test = doctest.DocTestParser().get_doctest(body, namespace, where, where, 0)
        runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
        output: list[str] = []
        runner.run(test, out=output.append, clear_globs=False)
        assert runner.failures == 0, f"{where}: doctest failed\n" + "".join(output)
        return
    # Padded so tracebacks give the page's own line numbers.
    exec(compile("\n" * line + body, where.rsplit(":", 1)[0], "exec"), namespace)  # noqa: S102 - the docs' code


def check_yaml(body: str, where: str) -> None:
    from composerjax.trainer.config import TrainerConfig, load_config

    values = yaml.safe_load(body)
    if not isinstance(values, dict):
        return
    if "model" in values:
        load_config(values)
    elif set(values) <= set(TrainerConfig.model_fields):
        base = yaml.safe_load((REPO / "examples" / "digits_baseline.yaml").read_text())
        load_config({**base, **values})


def commands(body: str, console: bool) -> list[list[str]]:
    """The commands of a shell block: continuations joined, comments and (console) output dropped."""
    lines, current = [], ""
    for raw in body.splitlines():
        line = raw.rstrip()
        if console:
            if not line.startswith("$ ") and not current:
                continue
            line = line[2:] if line.startswith("$ ") else line
        if line.endswith("\\"):
            current += line[:-1] + " "
            continue
        line, current = current + line, ""
        if line.strip() and not line.lstrip().startswith("#"):
            lines.append(shlex.split(line, comments=True))
    return [words for words in lines if words]


def check_command(words: list[str], where: str) -> None:
    from composerjax.cli import _load_recipe, build_parser

    program = words[0]
    if program in (".venv/bin/python", "python", "python3") and words[1:3] == ["-m", "composerjax"]:
        words, program = ["composerjax", *words[3:]], "composerjax"
    if program in ("composerjax", ".venv/bin/composerjax"):
        try:
            args = build_parser().parse_args(words[1:])
        except SystemExit as error:
            if error.code == 0:  # --help
                return
            raise AssertionError(f"{where}: `{shlex.join(words)}` does not parse (exit {error.code})") from None
        if args.command in ("train", "explain"):
            assert (REPO / args.recipe).is_file(), f"{where}: no recipe {args.recipe}"
            args.recipe = str(REPO / args.recipe)
            _load_recipe(args)
        return
    if program == "make":
        targets = set(re.findall(r"^([A-Za-z][\w-]*):", (REPO / "Makefile").read_text(), re.M))
        for target in words[1:]:
            assert target in targets, f"{where}: `make {target}`: the Makefile has no target {target!r}"
        return
    if program in (".venv/bin/python", "python", "python3") and len(words) > 1 and words[1].endswith(".py"):
        script = REPO / words[1]
        assert script.is_file() or words[1] == "train.py", f"{where}: no script {words[1]}"
        return
    assert program in SHOWN_ONLY or program.startswith("#"), (
        f"{where}: `{program}` is not a command the docs test knows; check it here or add it to SHOWN_ONLY")


def run_page(page: Path) -> None:
    """Run or check every block of ``page``, in order (the working directory is the caller's)."""
    namespace: dict = {"__name__": f"docs_{page.stem}"}
    for line, language, body in blocks(page):
        where = f"{page.relative_to(REPO)}:{line}"
        if language in NOT_CODE:
            continue
        assert language, f"{where}: a fence without a language; mark it python, yaml, bash, text, ..."
        if language == "python":
            run_python(body, namespace, where, line)
        elif language == "yaml":
            check_yaml(body, where)
        elif language == "toml":
            tomllib.loads(body)
        elif language in ("bash", "sh", "shell", "console"):
            for words in commands(body, console=language == "console"):
                check_command(words, where)
        else:
            raise AssertionError(f"{where}: no rule for ```{language} blocks in tests/docs/test_doc_blocks.py")


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(REPO)) for p in PAGES])
def test_every_code_block_on_the_page_runs(page, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "examples").symlink_to(REPO / "examples")
    marker = OWN_PROCESS.search(page.read_text())
    if marker is None:
        run_page(page)
        return
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    if marker[1]:
        env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={marker[1]}"
    done = subprocess.run([sys.executable, __file__, str(page)], env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, f"{page.relative_to(REPO)} failed in its own process:\n{done.stdout}\n{done.stderr}"


def test_the_harness_finds_blocks_and_rejects_bad_commands(tmp_path):
    page = tmp_path / "p.md"
    page.write_text("# t\n\n```python\nx = 1\n```\n\n- item\n\n  ```bash\n  make demo \\\n    test\n  ```\n")
    assert blocks(page) == [(3, "python", "x = 1\n"), (9, "bash", "make demo \\\n  test\n")]
    assert commands("make demo \\\n  test\n# note\n", console=False) == [["make", "demo", "test"]]
    assert commands("$ composerjax --help\nusage: ...\n", console=True) == [["composerjax", "--help"]]
    with pytest.raises(AssertionError, match="no target 'dmeo'"):
        check_command(["make", "dmeo"], "here")
    with pytest.raises(AssertionError, match="does not parse"):
        check_command(["composerjax", "trian", "x.yaml"], "here")
    with pytest.raises(AssertionError, match="not a command the docs test knows"):
        check_command(["rm", "-rf", "/"], "here")
    with pytest.raises(AssertionError, match="doctest failed"):
        run_python(">>> 1 + 1\n3\n", {}, "here")


if __name__ == "__main__":  # one page in this process: python test_doc_blocks.py PAGE
    run_page(Path(sys.argv[1]))
