"""The README is the front page: short, and every command it shows runs as far as it can here.

Shell commands are taken from the README's ```bash blocks (comments dropped, backslash
continuations joined). Each is checked cheaply, without running anything heavy:
- `make TARGET`: the target is a rule of the Makefile;
- `python -m MODULE ...` (any python, `.venv/bin/python` included): `python -m MODULE [SUB] --help`
  exits 0 and names every `--flag` the command passes;
- a console script of pyproject.toml (`edge-client`, `cloud-verifier`, `draft-training`, bare or
  under `.venv/bin/`): the same, through the script's entry point.
A program the test does not know fails, so a new kind of command gets a checker (or a place in
SKIPPED, with the reason). Relative links of the README and docs/*.md point at files that exist,
and their anchors at headings there.
"""

from __future__ import annotations

import functools
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
MAX_LINES = 250
HELP_TIMEOUT_S = 60
# programs a README command may name that cannot be checked here without side effects
SKIPPED = {
    "docker": "needs a container engine",
    "podman": "needs a container engine",
    "node": "needs Node and a built client",
    "npm": "needs Node",
    "cd": "a shell builtin",
    "sudo": "changes the machine",
}
_SHELL_BLOCK = re.compile(r"^```(?:bash|sh|shell|console)\s*\n(.*?)^```", re.M | re.S)
_FLAG = re.compile(r"^--[A-Za-z0-9][\w-]*")


def _python() -> str:
    venv = REPO / ".venv" / "bin" / "python"
    return str(venv) if venv.exists() else sys.executable


def shell_commands(markdown: str) -> list[str]:
    """Each command of the text's shell code blocks: comments dropped, continuations joined."""
    commands: list[str] = []
    for block in _SHELL_BLOCK.findall(markdown):
        pending = ""
        for raw in block.splitlines():
            line = raw.rstrip()
            if line.endswith("\\"):
                pending += line[:-1] + " "
                continue
            line = pending + line
            pending = ""
            words = shlex.split(line, comments=True)
            if words:
                commands.append(shlex.join(words))
    return commands


def _console_scripts() -> dict[str, str]:
    """pyproject.toml's [project.scripts] (read by hand: tomllib needs Python 3.11)."""
    text = (REPO / "pyproject.toml").read_text()
    section = re.search(r"^\[project\.scripts\]\n(.*?)(?=^\[|\Z)", text, re.M | re.S)
    assert section, "pyproject.toml has no [project.scripts]"
    return dict(re.findall(r'^"?([\w.-]+)"?\s*=\s*"([^"]+)"', section.group(1), re.M))


def _make_targets() -> set[str]:
    text = (REPO / "Makefile").read_text()
    return {m.group(1) for m in re.finditer(r"^([A-Za-z0-9_.-]+)\s*:(?!=)", text, re.M)}


@functools.cache
def _help(prefix: tuple[str, ...], args: tuple[str, ...]) -> tuple[int, str]:
    """Exit status and output of `<prefix> <args> --help` (prefix: the python argv before args)."""
    proc = subprocess.run(
        [*prefix, *args, "--help"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=HELP_TIMEOUT_S,
    )
    return proc.returncode, proc.stdout + proc.stderr


def _subcommands(help_text: str) -> set[str]:
    """An argparse parser's subcommands, from the `{a,b,c}` of its usage line."""
    found: set[str] = set()
    for group in re.findall(r"\{([\w,-]+)\}", help_text):
        found.update(group.split(","))
    return found


def _check_cli(name: str, prefix: tuple[str, ...], args: list[str]) -> list[str]:
    rc, text = _help(prefix, ())
    if rc != 0:
        return [f"{name} --help exited {rc}: {text.strip()[-300:]}"]
    path: tuple[str, ...] = ()
    if args and not args[0].startswith("-") and args[0] in _subcommands(text):
        path = (args[0],)
        rc, text = _help(prefix, path)
        if rc != 0:
            return [f"{name} {args[0]} --help exited {rc}: {text.strip()[-300:]}"]
    errors = []
    for arg in args[len(path) :]:
        flag = _FLAG.match(arg)
        if flag and not re.search(re.escape(flag.group(0)) + r"(?![\w-])", text):
            errors.append(f"{name} {' '.join(path)}: {flag.group(0)} is not in its --help")
    return errors


def check_command(command: str) -> list[str]:
    """What is wrong with one README command (empty: nothing found)."""
    words = shlex.split(command)
    while words and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", words[0]):
        words = words[1:]  # VAR=value before the program
    if not words:
        return []
    program, args = Path(words[0]).name, words[1:]
    if program == "make":
        targets = [a for a in args if not a.startswith("-") and "=" not in a]
        known = _make_targets()
        return [f"make {t}: no such target in the Makefile" for t in targets if t not in known]
    if re.fullmatch(r"python(3(\.\d+)?)?", program):
        if len(args) < 2 or args[0] != "-m":
            return [f"{command}: only `python -m MODULE` commands are checked"]
        module = args[1]
        prefix = (_python(), "-m", module)
        rc, text = _help(prefix, ())
        if rc != 0 and ("No module named" in text or "Error while finding module" in text):
            return [f"python -m {module}: no such module ({text.strip().splitlines()[-1]})"]
        return _check_cli(f"python -m {module}", prefix, args[2:])
    scripts = _console_scripts()
    if program in scripts:
        module, func = scripts[program].split(":")
        code = f"import sys; from {module} import {func} as main; sys.argv[0] = {program!r}; sys.exit(main())"
        return _check_cli(program, (_python(), "-c", code), args)
    if program in SKIPPED:
        return []
    return [f"{command}: no checker for the program {program!r} (add one, or add it to SKIPPED)"]


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(markdown: str) -> set[str]:
    text = re.sub(r"^```.*?^```", "", markdown, flags=re.M | re.S)
    return {_slug(m) for m in re.findall(r"^#{1,6} (.+)$", text, re.M)}


def link_errors(path: Path) -> list[str]:
    text = path.read_text()
    prose = re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)
    errors = []
    for target in re.findall(r"\]\(([^)\s]+)\)", prose):
        if re.match(r"[a-z]+:", target):
            continue  # http:, https:, mailto:
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        if not dest.exists():
            errors.append(f"{path.name}: link to {target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest.read_text()):
            errors.append(f"{path.name}: link to {target}: no such heading")
    return errors


def test_readme_is_short() -> None:
    lines = README.read_text().count("\n")
    assert lines <= MAX_LINES, f"README.md has {lines} lines; at most {MAX_LINES} (move text to docs/)"


def test_first_commands_are_demo_and_test() -> None:
    # `.ci/run` and the set-up rely on `make test` being the README's test command
    assert shell_commands(README.read_text())[:2] == ["make demo", "make test"]


def test_readme_has_no_dated_figures() -> None:
    # dated measurements belong on docs/results.md
    dates = re.findall(r"\b20\d\d-\d\d-\d\d\b", README.read_text())
    assert not dates, f"dates in README.md: {dates}; measured figures go to docs/results.md"


def test_every_readme_command_checks() -> None:
    commands = shell_commands(README.read_text())
    assert len(commands) >= 10
    errors = [e for c in commands for e in check_command(c)]
    assert not errors, "\n".join(errors)


def test_python_imports_resolve() -> None:
    # the README's ```python blocks: every `from X import a, b` names what the package has
    imports = []
    for block in re.findall(r"^```python\s*\n(.*?)^```", README.read_text(), re.M | re.S):
        imports += re.findall(r"^from [\w.]+ import [\w, ]+$", block, re.M)
    assert imports
    proc = subprocess.run(
        [_python(), "-c", "\n".join(imports)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=HELP_TIMEOUT_S,
    )
    assert proc.returncode == 0, proc.stderr


def test_links_resolve() -> None:
    pages = [README, *sorted((REPO / "docs").glob("*.md"))]
    errors = [e for p in pages for e in link_errors(p)]
    assert not errors, "\n".join(errors)


@pytest.mark.parametrize(
    ("command", "expected"),
    [
        ("python -m no_such_module_of_treespec --flag", "no such module"),
        (".venv/bin/python -m shared.model_store list --no-such-flag", "--no-such-flag"),
        ("make no-such-target", "no such target"),
        ("edge-client generate --no-such-flag x", "--no-such-flag is not in its --help"),
        ("curl https://example.com", "no checker"),
    ],
)
def test_check_command_reports(command: str, expected: str) -> None:
    errors = check_command(command)
    assert any(expected in e for e in errors), errors


def test_shell_commands_parses_blocks() -> None:
    text = "x\n```bash\nmake demo   # a comment\n# only a comment\nfoo --a \\\n    --b 'c d'\n```\n"
    assert shell_commands(text) == ["make demo", "foo --a --b 'c d'"]
