"""Every code block in the docs (docs/**/*.md and README.md) runs or is checked here, so the docs cannot rot.

One test per page. The blocks of a page are handled in page order, in one scratch working directory
per page (with ``examples/`` reachable), so a later block sees what an earlier one wrote. What
happens to a fenced block depends on its language:

* ``python``: executed, in one namespace per page, with its stdout captured for the output block
  after it (and echoed, so pytest shows it on failure). A block of ``>>>`` lines runs as a
  doctest: its printed output must match what the block shows.
* ``yaml``: parsed. A recipe (it has ``model``) is validated as a ``TrainerConfig``; a fragment whose
  keys are all recipe fields is validated on top of ``examples/digits_baseline.yaml``.
* ``toml``: parsed.
* ``bash`` / ``console``: every command is checked first: ``composerjax ...`` parses with the real
  argument parser and its recipe (with ``--set`` overrides) validates; ``make X`` names a Makefile
  target; ``python SCRIPT`` names a file of the repository. Then, in the scratch directory, every
  command runs, except those in ``NOT_RUN``, which says for each why it is only checked (``make``
  targets, benchmarks, the test suite, ``launch``, placeholder run folders and scripts,
  installers, cluster tools); a command neither runnable nor in ``NOT_RUN`` fails. ``composerjax
  ...`` runs in this process through ``composerjax.cli.main``, the console script's entry point
  (a new JAX process would add 3-5 s per command); anything else runs as a subprocess with
  ``JAX_PLATFORMS=cpu``. Either way stdout and stderr are taken together, as a terminal shows
  them, and the exit status must be 0, or N when the command's line ends with the comment
  ``# exit status N``. ``composerjax train`` runs with ``--set max_duration=1ba`` appended
  (``TRAIN_CAP``) unless an output block shows what it prints (then the page keeps it short).
  A ``console`` block holds ``$ `` commands only: what they print goes in an output block.
* A block titled ``Output`` (```` ```text title="Output" ````; material renders the title as a
  caption; ```` ```json title="Output" ```` and so on work too): the output of the block just
  before it, with nothing but blank lines between them: a ``python`` block (what it printed) or a
  shell block (what its commands printed; all of them must run). The two are compared line by
  line, trailing whitespace and blank lines at the start and end ignored; a difference fails with
  a diff. ``...`` in the shown output matches any text (doctest's ELLIPSIS, across lines too): use
  it only for values that change from run to run (timings, paths, dates), and add the reason to
  ``ELLIPSIS_USES``, which allows, per page, one output block with ``...`` per reason.
* ``text`` without that title (a layout, an error message quoted in prose, a table of results) and
  ``mermaid`` (diagrams): shown, not checked. So that an output block cannot go unchecked by
  mistake, a plain ``text`` block directly after a ``python`` or shell block that printed
  something (nothing but blank lines between them) fails: title it ``Output``, or say in a
  sentence before it what it is.

A page with ``<!-- docs-test: cpu-devices=N -->`` runs in its own process with N simulated CPU
devices (multi-device examples need them before JAX starts); ``<!-- docs-test: own-process -->``
runs in its own process too (for pages that register names in the process-wide registries).

A fence with no language fails: say what the block is.
"""

from __future__ import annotations

import contextlib
import difflib
import doctest
import io
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import pytest
import yaml

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib

REPO = Path(__file__).resolve().parents[2]
PAGES = sorted((REPO / "docs").rglob("*.md")) + [REPO / "README.md"]
FENCE = re.compile(r"^(?P<indent>[ ]*)```(?P<info>[^`\n]*)\n(?P<body>.*?)^(?P=indent)```[ ]*$", re.M | re.S)
OUTPUT_TITLE = re.compile(r'(?:^|\s)title="Output"(?:\s|$)')
NOT_CODE = {"text", "mermaid"}
SHELL = {"bash", "sh", "shell", "console"}
PYTHON = (".venv/bin/python", "python", "python3")  # all run as this interpreter
OWN_PROCESS = re.compile(r"<!-- docs-test: (?:own-process|cpu-devices=(\d+)) -->")
EXIT_STATUS = re.compile(r"#.*\bexit status (\d+)\s*$")

# Shell commands that are checked but not run, each with the reason. A key matches a command that
# starts with it, as written on the page (words joined by single spaces). Every other command runs.
NOT_RUN = {
    "make": "Makefile targets work on the checkout itself and take minutes (demo: a venv and two trainings; "
            "test: the suite; docs: the site; bench: the benchmarks; clean: deletes)",
    "python -m pytest": "runs tests; the suite runs on its own",
    "python benchmarks/": "benchmarks run for minutes",
    "composerjax launch": "starts processes running train.py, which stands for the reader's own script",
    "srun python train.py": "train.py stands for the reader's own script, on a cluster",
    "composerjax traces runs/my-run": "runs/my-run and runs/other-run stand for the reader's runs",
    "composerjax train examples/gpt2_stdlib.yaml": "the full corpus takes a minute even capped at 1 batch; "
                                                   "docs/language-models.md runs this recipe on part of it",
    "composerjax generate runs/gpt2-stdlib --prompt def  --max-new-tokens 64": "follows the run above; "
                                                                               "docs/language-models.md runs generate",
    "composerjax generate runs/my-lm": "runs/my-lm stands for the reader's language-model run (docs/language-models.md "
                                       "runs train and generate)",
    "composerjax traces runs/digits-speedup": "the example recipes record no traces (no TraceRecorder)",
    "pip": "installs into the environment",
    "uv": "installs into the environment",
    "git": "changes a clone",
    "cd": "a shell built-in: the commands run in the page's scratch directory",
    "export": "a shell built-in: the commands run in the page's scratch directory",
    "srun": "cluster tool (Slurm)",
    "sbatch": "cluster tool (Slurm)",
    "kubectl": "cluster tool (Kubernetes)",
    "tensorboard": "a server",
    "nvidia-smi": "needs a GPU",
}
# composerjax train runs short unless its output is shown (then the page must keep it short itself).
TRAIN_CAP = ["--set", "max_duration=1ba"]
COMMAND_TIMEOUT_S = 180
# Pages whose output blocks may contain the `...` wildcard: page -> one reason per such block.
ELLIPSIS_USES: dict[str, list[str]] = {
    "docs/checkpointing.md": ["the absolute path of the page's scratch folder in CheckpointMismatchError"],
}


class Block(NamedTuple):
    line: int  # of the opening fence, 1-based
    language: str
    body: str  # indentation removed
    output: bool  # titled Output (```text title="Output"): compared with what the block before it printed
    follows_code: bool  # nothing but blank lines between this block and the block before it


class Command(NamedTuple):
    words: list[str]
    status: int  # the exit status it must end with


def blocks(page: Path) -> list[Block]:
    """Each fenced block of ``page``, in order."""
    text = page.read_text()
    found: list[Block] = []
    previous_end = None
    for match in FENCE.finditer(text):
        indent = len(match["indent"])
        body = "".join(line[indent:] if line[:indent].isspace() else line
                       for line in match["body"].splitlines(keepends=True))
        info = match["info"].strip()
        language = info.split(" ")[0].lower()
        follows_code = previous_end is not None and not text[previous_end:match.start()].strip()
        found.append(Block(text.count("\n", 0, match.start()) + 1, language, body,
                           bool(OUTPUT_TITLE.search(info)), follows_code))
        previous_end = match.end()
    return found


def normalised(text: str) -> str:
    """``text`` without trailing whitespace on its lines, nor blank lines at its start and end."""
    return "\n".join(line.rstrip() for line in text.splitlines()).strip("\n")


def check_output(shown: str, printed: str, where: str) -> None:
    """The shown output block must be what the code printed (``...`` matches any text)."""
    shown, printed = normalised(shown), normalised(printed)
    if shown == printed:
        return
    if "..." in shown and doctest.OutputChecker().check_output(shown + "\n", printed + "\n", doctest.ELLIPSIS):
        return
    diff = "\n".join(difflib.unified_diff(shown.splitlines(), printed.splitlines(), "shown on the page",
                                          "printed by the code", lineterm=""))
    raise AssertionError(f"{where}: the shown output is not what the code prints:\n{diff}")


def run_python(body: str, namespace: dict, where: str, line: int = 0) -> str | None:
    """Run one python block; return what it printed (None for a doctest block, checked here)."""
    if body.lstrip().startswith(">>>"):
        test = doctest.DocTestParser().get_doctest(body, namespace, where, where, 0)
        runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
        output: list[str] = []
        runner.run(test, out=output.append, clear_globs=False)
        assert runner.failures == 0, f"{where}: doctest failed\n" + "".join(output)
        return None
    printed = io.StringIO()
    try:
        with contextlib.redirect_stdout(printed):
            # Padded so tracebacks give the page's own line numbers.
            exec(compile("\n" * line + body, where.rsplit(":", 1)[0], "exec"), namespace)  # noqa: S102 - the docs' code
    finally:
        sys.stdout.write(printed.getvalue())
    return printed.getvalue()


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


def commands(body: str, console: bool) -> list[Command]:
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
            words = shlex.split(line, comments=True)
            status = EXIT_STATUS.search(line)
            if words:
                lines.append(Command(words, int(status[1]) if status else 0))
    return lines


def console_output(body: str) -> list[str]:
    """The lines of a console block that are output: not a ``$ `` command, its continuation or a comment."""
    output, continued = [], False
    for line in body.splitlines():
        if continued or line.startswith("$ "):
            continued = line.rstrip().endswith("\\")
        elif line.strip() and not line.lstrip().startswith("#"):
            output.append(line)
    return output


def _as_composerjax(words: list[str]) -> list[str]:
    """``python -m composerjax ...`` and ``.venv/bin/composerjax ...`` as ``composerjax ...``."""
    if words[0] in PYTHON and words[1:3] == ["-m", "composerjax"]:
        return ["composerjax", *words[3:]]
    if words[0] == ".venv/bin/composerjax":
        return ["composerjax", *words[1:]]
    return words


def not_run_reason(words: list[str]) -> str | None:
    """Why this command is only checked, from ``NOT_RUN``; None when it runs."""
    words = _as_composerjax(words)
    if words[0] in PYTHON:
        words = ["python", *words[1:]]
    command = " ".join(words)
    for start, reason in NOT_RUN.items():
        if command == start or command.startswith(start + " ") or (start.endswith("/") and command.startswith(start)):
            return reason
    return None


def _recipe_path(recipe: str) -> Path:
    """A recipe as the page names it: in the scratch directory (``examples/`` is there), else in the repository."""
    return Path(recipe) if Path(recipe).is_file() else REPO / recipe


def check_command(words: list[str], where: str, status: int = 0) -> None:
    """The command is well formed, without running it (see the module docstring)."""
    from composerjax.cli import _load_recipe, build_parser

    words = _as_composerjax(words)
    program = words[0]
    if program == "composerjax":
        try:
            args = build_parser().parse_args(words[1:])
        except SystemExit as error:
            if error.code == 0:  # --help
                return
            raise AssertionError(f"{where}: `{shlex.join(words)}` does not parse (exit {error.code})") from None
        if args.command in ("train", "explain"):
            recipe = _recipe_path(args.recipe)
            assert recipe.is_file(), f"{where}: no recipe {args.recipe}"
            if status == 0:  # a command shown failing may fail on its recipe
                args.recipe = str(recipe)
                _load_recipe(args)
        return
    if program == "make":
        targets = set(re.findall(r"^([A-Za-z][\w-]*):", (REPO / "Makefile").read_text(), re.M))
        for target in words[1:]:
            assert target in targets, f"{where}: `make {target}`: the Makefile has no target {target!r}"
        return
    if program in PYTHON and len(words) > 1 and words[1].endswith(".py"):
        script = REPO / words[1]
        assert script.is_file() or words[1] == "train.py", f"{where}: no script {words[1]}"
        return
    if program in PYTHON and len(words) > 2 and words[1] in ("-c", "-m"):
        return
    assert not_run_reason(words) is not None, (
        f"{where}: `{program}` is not a command the docs test knows; check it here or add it to NOT_RUN")


def run_command(words: list[str], where: str, status: int = 0, shown: bool = False) -> str:
    """Run a checked command in the current (scratch) directory; return what it printed.

    ``composerjax ...`` runs in this process, through ``composerjax.cli.main`` (the console script's
    entry point: same parser, same code, same exit status, stdout and stderr captured together);
    that saves the 3-5 s a new JAX process takes to start. Anything else runs as a subprocess.
    """
    words = _as_composerjax(words)
    if words[0] == "composerjax":
        from composerjax.cli import main

        args = words[1:] + (TRAIN_CAP if words[1:2] == ["train"] and not shown else [])
        captured = io.StringIO()
        columns = os.environ.get("COLUMNS")
        os.environ["COLUMNS"] = "80"  # --help wraps to the terminal's width; a pipe's is 80
        with contextlib.redirect_stdout(captured), contextlib.redirect_stderr(captured):
            try:
                returncode = main(args)
            except SystemExit as exit_:  # argparse: --help, a usage error; a signal stop
                returncode = exit_.code if isinstance(exit_.code, int) else int(exit_.code is not None)
            finally:
                if columns is None:
                    del os.environ["COLUMNS"]
                else:
                    os.environ["COLUMNS"] = columns
        printed, ran = captured.getvalue(), shlex.join(["composerjax", *args])
    else:
        argv = [sys.executable, *words[1:]] if words[0] in PYTHON else words
        env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1"}
        try:
            done = subprocess.run(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                  timeout=COMMAND_TIMEOUT_S, check=False)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{where}: `{shlex.join(words)}` ran for more than {COMMAND_TIMEOUT_S} s; "
                                 "make it cheaper or add it to NOT_RUN with the reason") from None
        returncode, printed, ran = done.returncode, done.stdout, shlex.join(argv)
    sys.stdout.write(f"$ {ran}\n{printed}")
    assert returncode == status, (f"{where}: `{shlex.join(words)}` exited with status {returncode}, not {status}:\n"
                                  f"{printed[-3000:]}")
    return printed


def run_shell(block: Block, where: str, shown: bool) -> tuple[str | None, str]:
    """Check every command of a shell block and run those not in ``NOT_RUN``.

    Returns what the run commands printed, or None with the reason when one of them did not run.
    """
    if block.language == "console":
        shown = console_output(block.body)
        assert not shown, (f"{where}: a console block shows output ({shown[0]!r}): put it in an output block after "
                           "it (```text title=\"Output\"), where it is compared with what the commands print")
    printed: list[str] = []
    skipped = ""
    for words, status in commands(block.body, console=block.language == "console"):
        check_command(words, where, status)
        reason = not_run_reason(words)
        if reason is not None:
            skipped = skipped or f"`{shlex.join(words)}` is not run ({reason})"
            continue
        printed.append(run_command(words, where, status, shown))
    return (None, skipped) if skipped else ("".join(printed), "")


def run_page(page: Path) -> None:
    """Run or check every block of ``page``, in order (the working directory is the caller's)."""
    namespace: dict = {"__name__": f"docs_{page.stem}"}
    page_blocks = blocks(page)
    relative = str(page.relative_to(REPO))
    printed: str | None = None  # by the code block just before, when it ran
    why_not = ""  # when it printed None
    ellipses = 0
    for index, block in enumerate(page_blocks):
        where = f"{relative}:{block.line}"
        language = block.language
        before = page_blocks[index - 1] if index else None
        if block.output:
            assert before is not None and block.follows_code and before.language in ("python", *SHELL), (
                f"{where}: an output block (```text title=\"Output\") must come right after the python or shell "
                "block whose output it shows")
            assert printed is not None, f"{where}: cannot compare the shown output: {why_not}"
            ellipses += "..." in block.body
            check_output(block.body, printed, where)
            printed, why_not = None, "the block before is an output block"
            continue
        if language in NOT_CODE:
            assert not (language == "text" and block.follows_code and printed), (
                f"{where}: a text block right after a {before.language} block that prints: if it is that output, "
                "title it Output (```text title=\"Output\") so it is compared; if not, say before it what it is")
            printed, why_not = None, f"the block before is a {language} block"
            continue
        assert language, f"{where}: a fence without a language; mark it python, yaml, bash, text, ..."
        printed, why_not = None, f"the block before is a {language} block"
        shown = index + 1 < len(page_blocks) and page_blocks[index + 1].output
        if language == "python":
            printed = run_python(block.body, namespace, where, block.line)
            why_not = "it is a doctest block, whose output is checked inline"
        elif language == "yaml":
            check_yaml(block.body, where)
        elif language == "toml":
            tomllib.loads(block.body)
        elif language in SHELL:
            printed, why_not = run_shell(block, where, shown)
        else:
            raise AssertionError(f"{where}: no rule for ```{language} blocks in tests/docs/test_doc_blocks.py")
    allowed = len(ELLIPSIS_USES.get(relative, []))
    assert ellipses == allowed, (
        f"{relative}: {ellipses} output block(s) use the `...` wildcard, ELLIPSIS_USES allows {allowed}: show the "
        "real output, or, for values that change from run to run, give the reason in ELLIPSIS_USES")


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
    page.write_text("# t\n\n```python\nx = 1\n```\n\n- item\n\n  ```bash\n  make demo \\\n    test\n  ```\n\n"
                    '  ```text title="Output"\n  done\n  ```\n')
    assert blocks(page) == [(3, "python", "x = 1\n", False, False),
                            (9, "bash", "make demo \\\n  test\n", False, False),
                            (14, "text", "done\n", True, True)]
    assert commands("make demo \\\n  test\n# note\n", console=False) == [(["make", "demo", "test"], 0)]
    assert commands("$ composerjax --help\nusage: ...\n", console=True) == [(["composerjax", "--help"], 0)]
    assert console_output("$ composerjax \\\n  --help\n# note\nusage: ...\n") == ["usage: ..."]
    assert commands("composerjax train bad.yaml   # exit status 2\n", console=False) == [
        (["composerjax", "train", "bad.yaml"], 2)]
    with pytest.raises(AssertionError, match="no target 'dmeo'"):
        check_command(["make", "dmeo"], "here")
    with pytest.raises(AssertionError, match="does not parse"):
        check_command(["composerjax", "trian", "x.yaml"], "here")
    with pytest.raises(AssertionError, match="not a command the docs test knows"):
        check_command(["rm", "-rf", "/"], "here")
    with pytest.raises(AssertionError, match="doctest failed"):
        run_python(">>> 1 + 1\n3\n", {}, "here")
    assert not_run_reason(["make", "demo"]) and not_run_reason(["python", "benchmarks/overhead.py"])
    assert not_run_reason(["composerjax", "explain", "examples/digits_speedup.yaml"]) is None
    assert not_run_reason(["python", "-m", "composerjax", "launch", "-n", "2", "train.py"])
    assert not_run_reason([".venv/bin/python", "benchmarks/reliability.py", "--trials", "8"])


def test_the_harness_compares_shown_output_with_printed_output(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    # Trailing whitespace and blank lines around are ignored; anything else that differs fails, with a diff.
    check_output("a 1  \nb 2\n\n", "\na 1\nb 2\n", "here")
    with pytest.raises(AssertionError, match=r"(?s)here: the shown output is not.*-b 3\n\+b 2"):
        check_output("a 1\nb 3\n", "a 1\nb 2\n", "here")
    with pytest.raises(AssertionError, match="not what the code prints"):
        check_output("a 1\n", "a 1\nb 2\n", "here")  # a missing line is a difference
    check_output("took ... s\nb 2\n", "took 3.2 s\nb 2\n", "here")  # the documented wildcard
    with pytest.raises(AssertionError, match="not what the code prints"):
        check_output("took ... s\nb 3\n", "took 3.2 s\nb 2\n", "here")

    def page(text: str) -> Path:
        path = tmp_path / "docs_page.md"
        path.write_text(text)
        return path

    monkeypatch.setattr(sys.modules[__name__], "REPO", tmp_path)
    fence = "```"

    def block(language: str, body: str) -> str:
        return f"{fence}{language}\n{body}\n{fence}\n\n"

    def output(body: str) -> str:
        return block('text title="Output"', body)

    good = block("python", "print('hi', 1 + 1)") + output("hi 2")
    run_page(page(good))
    with pytest.raises(AssertionError, match=r"docs_page.md:5: the shown output is not what the code prints"):
        run_page(page(good.replace("hi 2", "hi 3")))
    with pytest.raises(AssertionError, match="a text block right after a python block that prints"):
        run_page(page(good.replace(' title="Output"', "")))
    with pytest.raises(AssertionError, match="must come right after"):
        run_page(page(good.replace("\n\n```text", "\n\nSome prose.\n\n```text")))
    with pytest.raises(AssertionError, match="ELLIPSIS_USES allows 0"):
        run_page(page(good.replace("hi 2", "hi ...")))
    monkeypatch.setitem(ELLIPSIS_USES, "docs_page.md", ["the number varies"])
    run_page(page(good.replace("hi 2", "hi ...")))
    with pytest.raises(AssertionError, match=r"2 output block\(s\) use the `...` wildcard, ELLIPSIS_USES allows 1"):
        run_page(page(good.replace("hi 2", "hi ...") + good.replace("hi 2", "... 2")))
    monkeypatch.delitem(ELLIPSIS_USES, "docs_page.md")
    # Shell blocks run; their output is compared the same way, and the exit status is checked.
    shell = block("bash", "python -c \"print('from a shell')\"") + output("from a shell")
    run_page(page(shell))
    with pytest.raises(AssertionError, match="not what the code prints"):
        run_page(page(shell.replace("from a shell\n```", "from the shell\n```")))
    with pytest.raises(AssertionError, match="a text block right after a bash block that prints"):
        run_page(page(shell.replace(' title="Output"', "")))
    with pytest.raises(AssertionError, match="exited with status 3, not 0"):
        run_page(page(block("bash", 'python -c "raise SystemExit(3)"')))
    run_page(page(block("bash", 'python -c "raise SystemExit(3)"   # exit status 3')))
    # composerjax runs in this process, through the console script's main(); stdout and stderr together.
    run_page(page(block("bash", "composerjax traces /no/such/run   # exit status 2")
                  + output("composerjax traces: error: /no/such/run: no such run folder")))
    with pytest.raises(AssertionError, match="a console block shows output"):
        run_page(page(block("console", "$ python -c 'print(1)'\n1")))
    with pytest.raises(AssertionError, match=r"cannot compare the shown output: `pip install x` is not run"):
        run_page(page(block("bash", "pip install x") + output("hi")))

if __name__ == "__main__":  # one page in this process: python test_doc_blocks.py PAGE
    run_page(Path(sys.argv[1]))
