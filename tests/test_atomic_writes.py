"""Output files are written atomically (training/lib/output_dir.py): a failure or a kill in the middle of a write leaves
the previous file as it was, never half a file, and the new file follows the user's umask. And every place in
vaswani_hf/ and training/ that writes a file is one we have checked.

(Training faults, run for real, are in tests/test_resume.py.)
"""

import ast
import json
import os
import signal
import stat
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from helpers import ROOT

from vaswani_training.lib.output_dir import write_json_atomic, write_lines_atomic


def leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.endswith(".tmp"))


def test_a_failing_json_write_leaves_the_old_file(tmp_path):
    target = tmp_path / "metrics.json"
    write_json_atomic(target, {"bleu": 27.3})
    with pytest.raises(TypeError, match="not JSON serializable"):
        # json.dump has written '{"bleu": 1.0, "broken": ' to the temporary file when it fails
        write_json_atomic(target, {"bleu": 1.0, "broken": object()})
    assert json.loads(target.read_text()) == {"bleu": 27.3}
    assert leftovers(tmp_path) == []


def test_a_failing_lines_write_leaves_the_old_file(tmp_path):
    target = tmp_path / "translations.txt"
    write_lines_atomic(target, ["old 1", "old 2"])

    def lines():
        for i in range(10_000):
            yield f"new {i}"
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        write_lines_atomic(target, lines())
    assert target.read_text() == "old 1\nold 2\n"
    assert leftovers(tmp_path) == []
    write_lines_atomic(target, ["new"])  # and the next write goes through
    assert target.read_text() == "new\n"


KILLED_WRITER = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    sys.path.insert(0, sys.argv[3])
    from vaswani_training.lib.output_dir import write_lines_atomic

    def lines():
        for i in range(50_000):
            yield f"new translation {i}"
        Path(sys.argv[2]).touch()  # half written: tell the test, then wait for the kill
        time.sleep(600)

    write_lines_atomic(sys.argv[1], lines())
    """
)


def test_a_kill_in_the_middle_of_a_write_leaves_the_old_file(tmp_path):
    target = tmp_path / "test_translations.txt"
    write_lines_atomic(target, ["old"] * 3)
    flag = tmp_path / "half-written"
    script = tmp_path / "writer.py"
    script.write_text(KILLED_WRITER)
    process = subprocess.Popen([sys.executable, str(script), str(target), str(flag), str(ROOT)],
                               env=dict(os.environ, OMP_NUM_THREADS="1"))
    deadline = time.monotonic() + 600
    while not flag.exists():
        assert process.poll() is None, "the writer ended early"
        assert time.monotonic() < deadline
        time.sleep(0.01)
    process.send_signal(signal.SIGKILL)
    process.wait(timeout=60)
    assert target.read_text() == "old\nold\nold\n"
    # The half-written temporary file is hidden beside it (".test_translations.txt.*.tmp"), never at the target name.
    (tmp,) = leftovers(tmp_path)
    assert tmp.startswith(".test_translations.txt.") and (tmp_path / tmp).stat().st_size > 0


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_atomic_writes_follow_the_umask(tmp_path, umask):
    from vaswani_training.lib.output_dir import write_json_atomic, write_lines_atomic

    previous = os.umask(umask)
    try:
        write_json_atomic(tmp_path / "metrics.json", {"bleu": 1.0})
        write_lines_atomic(tmp_path / "test_translations.txt", ["a"])
    finally:
        os.umask(previous)
    for name in ("metrics.json", "test_translations.txt"):
        assert stat.S_IMODE((tmp_path / name).stat().st_mode) == 0o666 & ~umask


# Every file write in the package and the commands, and why it is safe -----------------------------------------------

WRITE_CALLS = {"write_text", "write_bytes", "savefig", "save_file", "dump", "writelines", "save_pretrained", "save",
               "save_model", "save_state", "to_csv", "to_json", "copyfile", "copy2", "copytree"}
# (file, enclosing function, call) -> why the write cannot leave a half-written output under its final name.
CHECKED_WRITES = {
    ("training/ablate.py", "main", "write_text"): "into replace_file_atomically's temporary file",
    ("training/ablate.py", "run_row", "open"): "the row's training log, streamed while it runs; the row's result, "
                                               "table3_row.json, is written atomically after it",
    ("training/lib/output_dir.py", "_write_atomic.write_text", "open"): "into replace_file_atomically's temporary file",
    ("training/lib/output_dir.py", "write_json_atomic.write", "dump"): "the atomic helper",
    ("training/lib/output_dir.py", "write_lines_atomic", "writelines"): "the atomic helper",
    ("training/lib/prepare.py", "get_tokenizer", "save_pretrained"): "into a mkdtemp folder, then swap_in_folder",
    ("vaswani_hf/decoding/ct2.py", "convert_to_ct2", "write_text"): "decoding.json, into the staging folder, then "
                                                                    "swap_in_folder",
    ("vaswani_hf/data/caches.py", "write_manifest", "write_text"): "into the same mkdtemp folder, last, before it is "
                                                                    "renamed into the cache",
    ("training/lib/publishing.py", "write_hub_folder", "save_pretrained"): "into a mkdtemp folder, then os.replace",
    ("training/lib/publishing.py", "write_hub_folder", "write_text"): "into the same mkdtemp folder",
    ("training/train_no_trainer.py", "save_checkpoint", "save_pretrained"): "into .tmp-checkpoint-<step>, renamed",
    ("training/train_no_trainer.py", "save_checkpoint", "save_state"): "into the same .tmp-checkpoint-<step>",
    ("training/train_no_trainer.py", "_run.save_model_hook", "save_pretrained"): "called by save_state into the tmp "
                                                                                "checkpoint folder",
    ("vaswani_hf/averaging.py", "_atomic_copy", "copyfile"): "temporary file, then os.replace",
    ("vaswani_hf/averaging.py", "_write_model_folder", "save_file"): "through replace_file_atomically, into a "
                                                                      "temporary folder "
                                                                      "renamed when complete (or the run's folder)",
    ("vaswani_hf/averaging.py", "_write_model_folder", "write_text"): "through replace_file_atomically, as above",
    ("vaswani_hf/decoding/ct2.py", "convert_to_ct2", "save"): "into a staging folder, then os.replace",
    ("vaswani_hf/pictures/attention.py", "save_figure", "savefig"): "through replace_file_atomically",
    ("training/synthetic.py", "_write_jsonl", "open"): "into replace_file_atomically's temporary file",
    ("training/synthetic.py", "_write_text", "open"): "into two nested replace_file_atomically temporary files",
    # The final model folder of a training run is written by transformers (save_model / save_pretrained), file by
    # file. A kill during that save can leave a truncated model.safetensors: from_pretrained and the commands then
    # refuse it with a clear error (tests/test_loading.py), and the checkpoint-<step> folders still hold the run.
    # The lock file holds only the pid of the run holding it; the lock itself is the open file's flock.
    ("training/lib/output_dir.py", "RunLock.acquire", "open"): "a lock file; its content is informational",
    ("training/train.py", "_train", "save_model"): "transformers' model folder; truncation is detected on load",
    ("training/train.py", "_train", "save_pretrained"): "the tokenizer beside it; as above",
    ("training/train_no_trainer.py", "_run", "save_pretrained"): "transformers' model folder; as above",
}


def write_sites() -> set[tuple[str, str, str]]:
    """(file, enclosing function, call) of every call in vaswani_hf/ and training/ that writes a file."""
    found = set()
    for path in sorted([*(ROOT / "vaswani_hf").rglob("*.py"), *(ROOT / "training").rglob("*.py")]):
        relative = str(path.relative_to(ROOT))

        def visit(node, scope):
            for child in ast.iter_child_nodes(node):
                if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    visit(child, [*scope, child.name])
                    continue
                if isinstance(child, ast.Call):
                    func = child.func
                    name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
                    if name in ("open", "fdopen"):
                        modes = [*child.args[1:2], *(k.value for k in child.keywords if k.arg == "mode")]
                        mode = modes[0].value if modes and isinstance(modes[0], ast.Constant) else "r"
                        name = name if any(c in mode for c in "wax+") else None
                    if name in WRITE_CALLS or name in ("open", "fdopen"):
                        found.add((relative, ".".join(scope) or "<module>", name))
                visit(child, scope)

        visit(ast.parse(path.read_text(encoding="utf-8")), [])
    return found


def test_every_file_write_is_atomic_or_checked():
    unchecked = sorted(write_sites() - set(CHECKED_WRITES))
    assert not unchecked, (
        "New file writes: write outputs with vaswani_training.lib.output_dir.write_json_atomic / write_lines_atomic "
        "(or a temporary file/folder and os.replace), then add them to CHECKED_WRITES with the reason: "
        + repr(unchecked))
    # The commands' outputs go through the atomic helpers.
    for command in ("translate.py", "evaluate_bleu.py"):
        text = (ROOT / "training" / command).read_text()
        assert "write_lines_atomic(" in text or "write_json_atomic(" in text, command
