"""The README's code blocks, run or checked as written.

Every fenced block of README.md is one of:

- a Python block with no mark: run as written, in a fresh folder whose `outputs/multi30k-de-en` (where the main job
  leaves its model) holds a tiny model and tokenizer saved with `save_pretrained`. A block marked
  "*Continues the block above.*" runs in the namespace of the block before it;
- a block marked "*Needs ...*" (the main job's model, a GPU or the Hub) or "*Runs the whole suite ...*": not run
  here. Each `vaswani-*` command it calls must be a console script of pyproject.toml whose `--help` lists every flag
  it passes; an `accelerate launch` line must name an existing config, flags accelerate knows and a `-m` module of
  those scripts; any other shell command must be one that `.ci/run` runs; a Python block must compile;
- the citation (`bibtex`).

Anything else fails the test, so that no README block goes unchecked. The links of the README and of docs/ must point
at existing files and headings.
"""

import importlib.util
import itertools
import json
import os
import re
import shlex
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from helpers import ROOT, tiny_config

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: pytest depends on tomli there
    import tomli as tomllib

README = ROOT / "README.md"
CI_RUN = ROOT / ".ci" / "run"
TEST_COMMAND = "python -m pytest -q -n 2 --dist loadfile"  # the README's, which `.ci/run` runs
MODEL_PATH = "outputs/multi30k-de-en"  # where the main job leaves its model and the README's snippets load it from
NEEDS = re.compile(r"^\*Needs (.+)\.\*$")
NEEDED = ("main job", "GPU", "Hub")  # what a "Needs" mark may name: each is out of reach of the test suite
SUITE = re.compile(r"^\*Runs the whole suite\b.*\*$")
CONTINUES = "*Continues the block above.*"
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
       "OMP_NUM_THREADS": "1"}


def code_blocks(path: Path) -> list[dict]:
    """The fenced blocks of a Markdown file: language, code, 1-based line of the opening fence, and the mark (the
    last non-empty line of text before the block)."""
    blocks, lines, fence, prose = [], path.read_text(encoding="utf-8").splitlines(), None, []
    for number, line in enumerate(lines, 1):
        if fence is None and line.startswith("```"):
            fence = {"language": line[3:].strip(), "line": number, "code": [],
                     "mark": next((p.strip() for p in reversed(prose) if p.strip()), "")}
        elif fence is not None and line.startswith("```"):
            blocks.append({**fence, "code": "\n".join(fence["code"]) + "\n"})
            fence, prose = None, []
        elif fence is not None:
            fence["code"].append(line)
        else:
            prose.append(line)
    assert fence is None, f"{path}: the block opened at line {fence['line']} is not closed"
    return blocks


def shell_commands(code: str) -> list[list[str]]:
    """The commands of a shell script as token lists: continuation lines joined; comments, redirections and leading
    VAR=value assignments removed; `&&`, `||`, `;` and `|` chains split; `python -m pip` read as `pip`."""
    commands = []
    for line in code.replace("\\\n", " ").splitlines():
        lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        command: list[str] = []
        for token in [*lexer, ";"]:
            if token not in ("&&", "||", ";", "|", "&"):
                command.append(token)
                continue
            command = command[:next((i for i, t in enumerate(command) if t in ("<", ">", ">>")), len(command))]
            while command and re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", command[0]):
                command.pop(0)
            if command:
                commands.append(["pip", *command[3:]] if command[:3] == ["python", "-m", "pip"] else command)
            command = []
    return commands


def console_scripts() -> dict[str, str]:
    """pyproject.toml's console scripts: name -> "module:function"."""
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]


def classify(block: dict) -> str:
    """"run", "continue", "check" or "citation"; fails for a block the test would leave unchecked."""
    where = f"README.md line {block['line']}"
    if block["language"] == "bibtex":
        return "citation"
    needs = NEEDS.match(block["mark"])
    if needs:
        assert any(word in needs.group(1) for word in NEEDED), f"{where}: a Needs mark names none of {NEEDED}"
    if needs or SUITE.match(block["mark"]):
        assert block["language"] in ("bash", "python"), f"{where}: a marked block must be bash or python"
        return "check"
    assert block["language"] == "python", (
        f"{where}: a {block['language'] or 'plain'} block must be marked '*Needs ...*' (the main job's model, a GPU or "
        f"the Hub) or run as a Python block")
    return "continue" if block["mark"] == CONTINUES else "run"


@pytest.fixture(scope="module")
def blocks() -> list[dict]:
    found = code_blocks(README)
    assert found, "README.md has no code blocks"
    for block in found:
        block["kind"] = classify(block)
    return found


def test_readme_is_short_and_starts_with_the_two_commands(blocks):
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 200, f"README.md has {len(lines)} lines"
    setup = next(b for b in blocks if "pip install torch==2.13.0" in b["code"] and "vaswani-train" in b["code"])
    tests = next(b for b in blocks if b["code"].strip() == TEST_COMMAND)
    assert setup["line"] + setup["code"].count("\n") < 40 and tests["line"] + 1 < 40, "the two commands come first"
    assert TEST_COMMAND.split() in shell_commands(CI_RUN.read_text()), "CI runs the README's test command"


def test_every_block_is_covered(blocks):
    kinds = [block["kind"] for block in blocks]
    assert kinds[0] == "check" and "run" in kinds and "continue" in kinds and "citation" in kinds
    for previous, block in itertools.pairwise(blocks):
        if block["kind"] == "continue":
            assert previous["kind"] in ("run", "continue"), f"README.md line {block['line']} continues no Python block"
    for block in blocks:
        if block["kind"] == "citation":
            assert block["code"].lstrip().startswith("@") and block["code"].count("{") == block["code"].count("}")
        if block["language"] == "python":
            compile(block["code"], f"README.md:{block['line']}", "exec")


HELP_SCRIPT = textwrap.dedent(
    """
    import contextlib, importlib, io, json, sys

    scripts, wanted = json.loads(sys.argv[1]), json.loads(sys.argv[2])
    helps = {}
    for key in wanted:
        words = key.split()
        output = io.StringIO()
        sys.argv = [*words, "--help"]  # accelerate's help lists the options of the hardware named in sys.argv only
        if words[0] == "accelerate":
            from accelerate.commands.launch import launch_command_parser

            helps[key] = launch_command_parser().format_help()
            continue
        module, function = scripts[words[0]].split(":")
        with contextlib.redirect_stdout(output), contextlib.redirect_stderr(output):
            try:
                getattr(importlib.import_module(module), function)()
            except SystemExit:
                pass
        helps[key] = output.getvalue()
    print("HELP=" + json.dumps(helps))
    """
)


def test_commands_and_flags_exist(blocks, tmp_path):
    """Each command line of the README: the command exists and its --help lists every flag the line passes."""
    scripts = console_scripts()
    modules = {spec.split(":")[0]: name for name, spec in scripts.items()}
    ci_commands = shell_commands(CI_RUN.read_text())
    uses = []  # (README line, help key, flags)
    for block in blocks:
        if block["kind"] != "check" or block["language"] != "bash":
            continue
        where = f"README.md line {block['line']}"
        for tokens in shell_commands(block["code"]):
            if tokens[0].startswith("vaswani-"):
                assert tokens[0] in scripts, f"{where}: {tokens[0]} is not a console script of pyproject.toml"
                sub = [tokens[1]] if len(tokens) > 1 and not tokens[1].startswith("-") else []
                uses.append((where, " ".join([tokens[0], *sub]), [t.split("=")[0] for t in tokens if t[:2] == "--"]))
            elif tokens[:2] == ["accelerate", "launch"]:
                assert "-m" in tokens, f"{where}: accelerate launch runs a command's module with -m"
                at = tokens.index("-m")
                assert tokens[at + 1] in modules, f"{where}: -m {tokens[at + 1]} is no console script's module"
                source = Path(importlib.util.find_spec(tokens[at + 1]).origin).read_text(encoding="utf-8")
                assert 'if __name__ == "__main__":' in source, f"{where}: -m {tokens[at + 1]} would run nothing"
                config = tokens[tokens.index("--config_file") + 1]
                assert (ROOT / config).is_file(), f"{where}: {config} does not exist"
                uses.append((where, "accelerate launch", [t for t in tokens[2:at] if t[:2] == "--"]))
                uses.append((where, modules[tokens[at + 1]], [t.split("=")[0] for t in tokens[at + 2:]
                                                              if t[:2] == "--"]))
            elif tokens == ["hf", "auth", "login"]:
                assert "Hub" in block["mark"], f"{where}: hf auth login in a block not marked as needing the Hub"
            else:
                assert tokens in ci_commands, f"{where}: {shlex.join(tokens)} is neither a command of the project " \
                                              f"nor one that .ci/run runs"
    assert any(key == "vaswani-train" for _, key, _ in uses)
    wanted = sorted({key for _, key, _ in uses})
    done = subprocess.run([sys.executable, "-c", HELP_SCRIPT, json.dumps(scripts), json.dumps(wanted)],
                          cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0 and "HELP=" in done.stdout, done.stdout[-2000:] + done.stderr[-4000:]
    helps = json.loads(done.stdout.split("HELP=", 1)[1])
    for where, key, flags in uses:
        listed = set(re.findall(r"--[A-Za-z0-9][A-Za-z0-9_-]*", helps[key]))
        assert len(listed) > 1, f"{where}: `{key} --help` printed no flags:\n{helps[key][-2000:]}"
        missing = [flag for flag in flags if flag not in listed]
        assert not missing, f"{where}: `{key} --help` does not list {missing}"


RUN_SCRIPT = textwrap.dedent(
    """
    import json, sys

    namespace = None
    for line, kind, code in json.load(open(sys.argv[1], encoding="utf-8")):
        if kind == "run":
            namespace = {"__name__": "__main__"}
        exec(compile(code, "README.md:" + str(line), "exec"), namespace)
        print("BLOCK DONE", line, flush=True)
    """
)


@pytest.fixture
def main_job_folder(tmp_path, tiny_tokenizer):
    """A folder whose outputs/multi30k-de-en holds a tiny model and its tokenizer, as the main job leaves them."""
    from vaswani_hf import VaswaniForConditionalGeneration

    model = VaswaniForConditionalGeneration(tiny_config(vocab_size=len(tiny_tokenizer))).eval()
    model.generation_config.max_length = 16  # an untrained model rarely ends a sentence: bound its beam search
    model.save_pretrained(tmp_path / MODEL_PATH)
    tiny_tokenizer.save_pretrained(tmp_path / MODEL_PATH)
    return tmp_path


def test_python_blocks_run_as_written(blocks, main_job_folder):
    runnable = [(b["line"], b["kind"], b["code"]) for b in blocks if b["kind"] in ("run", "continue")]
    assert all(MODEL_PATH in code for _, kind, code in runnable if kind == "run"), \
        f"runnable blocks load the model from {MODEL_PATH}, where the test puts one"
    (main_job_folder / "blocks.json").write_text(json.dumps(runnable), encoding="utf-8")
    done = subprocess.run([sys.executable, "-c", RUN_SCRIPT, "blocks.json"], cwd=main_job_folder, env=ENV,
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    assert done.stdout.count("BLOCK DONE") == len(runnable)
    assert (main_job_folder / "outputs" / "fine-tuned" / "model.safetensors").is_file(), "the fine-tune saved a model"


def slug(heading: str) -> str:
    """GitHub's anchor of a Markdown heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_links_point_at_existing_files_and_headings():
    for page in [README, *sorted((ROOT / "docs").glob("*.md"))]:
        text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.DOTALL)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+://", target):
                continue
            file, _, anchor = target.partition("#")
            path = (page.parent / file).resolve() if file else page
            assert path.is_file(), f"{page.name}: link to {target}, which does not exist"
            if anchor:
                target_text = re.sub(r"```.*?```", "", path.read_text(encoding="utf-8"), flags=re.DOTALL)
                headings = {slug(h) for h in re.findall(r"^#+ (.+)$", target_text, flags=re.MULTILINE)}
                assert anchor in headings, f"{page.name}: no heading #{anchor} in {path.name}"


def test_the_results_page_is_a_reference_with_commits_only_in_its_results_table():
    """docs/results.md holds what the current code does: at most 250 lines, and a commit hash only in the rows of the
    table under "Results" (which commit each row ran), never in the prose around it."""
    lines = (ROOT / "docs" / "results.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 250, f"docs/results.md has {len(lines)} lines"
    section = None
    for number, line in enumerate(lines, 1):
        if line.startswith("## "):
            section = line[3:].strip()
        hashes = [word for word in re.findall(r"\b[0-9a-f]{7,40}\b", line)
                  if re.search(r"[a-f]", word) and re.search(r"[0-9]", word)]
        if hashes:
            assert section == "Results" and line.startswith("|"), (
                f"docs/results.md:{number}: commit {hashes[0]} outside the results table: {line[:120]}")
