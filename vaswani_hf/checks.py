"""The library's checks of inputs and outputs, and `CheckError`, the one error type of bad input in the library and
the commands: an output folder or file can be written and destroys no input (`check_output_dir`, `check_output_file`,
`check_output_not_in_inputs`), a JSON file parses (`read_json`), a model folder is whole and self-consistent
(`check_model_folder`: its config with every field, a generation config that agrees with it, complete safetensors
weights of the config's names and shapes, its code files where they are to run (`check_model_code`), a tokenizer that
matches (`check_tokenizer_matches`)); and of a folder's weights,
the tensors that hold NaN or infinite values (`nonfinite_weights`) and the fingerprint that names the weights a
`metrics.json` describes (`weights_fingerprint`).

`CheckError` is a `ValueError`, as transformers raises for bad input; its message names the path or flag at fault,
what is wrong and what to do.

It also holds how the library writes its outputs: `replace_file_atomically` (a file) and `swap_in_folder` (a folder)
never leave half an output under its final name, and `follow_umask` gives what they write through `tempfile` or
safetensors (0600 files, 0700 folders) the modes `open()` and `mkdir()` give under the user's umask, as transformers'
own JSON files have.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import threading
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

__all__ = ["CheckError", "check_model_code", "check_model_folder", "check_output_dir", "check_output_file",
           "check_output_not_in_inputs", "check_tokenizer_matches", "current_umask", "follow_umask",
           "nonfinite_weights", "read_json", "safetensors_problem", "weight_files", "weights_fingerprint",
           "weights_problems"]


class CheckError(ValueError):
    """An input or output a command cannot use; the message names the path, what is wrong, and what to do."""


_UMASK_LOCK = threading.Lock()


def current_umask() -> int:
    """The process's umask: from /proc/self/status where Linux gives it, else set and restored at once (under a lock,
    since `os.umask` has no read-only form)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    with _UMASK_LOCK:
        mask = os.umask(0o022)
        os.umask(mask)
    return mask


def follow_umask(path: str | os.PathLike, *, recursive: bool = True) -> None:
    """Give `path` the mode that `open()` (0666) or `mkdir()` (0777) would have given it under the user's umask; for a
    folder also every file and folder in it (`recursive`), or only the files directly in it.

    For what a command has just written through `tempfile` (0600 files, 0700 folders) or safetensors (0600), so that
    its outputs are shared as the user's other files are. Links are left alone.
    """
    path = Path(path)
    mask = current_umask()
    if path.is_symlink():
        return
    if path.is_dir():
        os.chmod(path, 0o777 & ~mask)
        for child in path.iterdir():
            if child.is_symlink():
                continue
            if child.is_dir():
                if recursive:
                    follow_umask(child)
            else:
                os.chmod(child, 0o666 & ~mask)
    elif path.exists():
        os.chmod(path, 0o666 & ~mask)


def replace_file_atomically(path: str | os.PathLike, write: Callable[[str], None]) -> Path:
    """`write(tmp)` into a hidden temporary file beside `path` (".<name>.*.tmp"), give it the mode `open()` would
    under the user's umask, then rename it to `path`: a failure or a kill in the middle leaves the old file as it was.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(tmp)
        follow_umask(tmp)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def swap_in_folder(staging: str | os.PathLike, target: str | os.PathLike) -> Path:
    """Put the complete folder `staging` (made beside `target`, e.g. by `tempfile.mkdtemp`) in place of `target`,
    with the modes of the user's umask. An existing `target` is moved aside first and removed only once `staging` is in
    place, so a kill at any moment leaves one whole folder (the old one, aside, in the worst case).
    """
    staging, target = Path(staging), Path(target)
    follow_umask(staging)  # mkdtemp makes it 0700, safetensors its weights 0600
    if target.exists():
        old = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}.old-"))
        os.replace(target, old / target.name)
        os.replace(staging, target)
        shutil.rmtree(old)
    else:
        os.replace(staging, target)
    return target


def read_json(path: str | os.PathLike, *, what: str = "") -> Any:
    """The parsed JSON of `path`, with an error naming the file (json's own names no file).

    Raises:
        CheckError: the file is missing, unreadable, not UTF-8, or not valid JSON (truncated, edited by hand).
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise CheckError(f"{path}: no such file{f' ({what})' if what else ''}.") from None
    except UnicodeDecodeError as error:
        raise CheckError(f"{path}: not UTF-8 text ({error}); the file is damaged. Copy or save it again.") from None
    except OSError as error:
        raise CheckError(f"{path}: cannot be read ({error.strerror or error}).") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        raise CheckError(f"{path}: not valid JSON ({error.msg} at line {error.lineno}, column {error.colno}); the file "
                         f"is truncated or damaged. Copy or save it again.") from None


def _resolved(path: str | os.PathLike) -> Path:
    return Path(os.path.abspath(os.path.realpath(os.fspath(path))))


def _within(inner: Path, outer: Path) -> bool:
    return inner == outer or outer in inner.parents


def check_output_not_in_inputs(output: str | os.PathLike, inputs: Iterable[str | os.PathLike | None], *,
                               output_flag: str = "--output_dir", input_flag: str = "--model_dir",
                               allow_inside: bool = False) -> None:
    """Refuse an output folder that is, contains or lies inside one of the `inputs` (replacing or filling it would
    destroy what is read: checkpoints, metrics, translations). Symbolic links are followed.

    `allow_inside`: an output inside an input folder is accepted (the training scripts' own `<output_dir>/hub`).

    Raises:
        CheckError: naming both paths and what to do.
    """
    out = _resolved(output)
    for source in inputs:
        if source is None:
            continue
        src = _resolved(source)
        if out == src:
            why = "is the same folder as"
        elif _within(src, out):
            why = "contains"
        elif _within(out, src) and not allow_inside:
            why = "lies inside"
        else:
            continue
        example = Path(source).resolve().parent / (Path(source).resolve().name + "-export")
        raise CheckError(f"{output_flag} {output} {why} {input_flag} {source}: writing it would replace or mix with "
                         f"the input (its weights, checkpoints, metrics and translations). Choose an output folder "
                         f"outside {source}, e.g. {example}.")


def _nearest_existing(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _check_can_create_in(path: Path, flag: str) -> None:
    parent = _nearest_existing(path.parent)
    if not parent.is_dir():
        raise CheckError(f"{flag} {path}: {parent} is a file, not a folder, so {path} cannot be created there.")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise CheckError(f"{flag} {path}: the folder {parent} is not writable; choose another place or fix its "
                         f"permissions.")
    if parent != path.parent:  # folders to create: some file systems (/proc, /sys) refuse what os.access allows
        try:
            os.rmdir(tempfile.mkdtemp(dir=parent, prefix=".vaswani-check-"))
        except OSError as error:
            raise CheckError(f"{flag} {path}: no folder can be created in {parent} ({error.strerror or error}); "
                             f"choose another place.") from None


def check_output_file(path: str | os.PathLike, *, flag: str = "--output") -> None:
    """Refuse, before any work, an output file that cannot be written: a folder, a read-only file, or a parent folder
    that is missing-and-uncreatable or not writable. (Written files go to a temporary file beside it first, so the
    folder must be writable too.)"""
    path = Path(path)
    if path.is_dir():
        raise CheckError(f"{flag} {path} is a folder; give a file name (e.g. {path / 'out.txt'}).")
    if path.exists() and not os.access(path, os.W_OK):
        raise CheckError(f"{flag} {path} is read-only; choose another file or make it writable.")
    _check_can_create_in(path, flag)


def check_output_dir(path: str | os.PathLike, *, flag: str = "--output_dir") -> None:
    """Refuse, before any work, an output folder that cannot be written: a file, a read-only folder, or a parent
    that is not writable."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise CheckError(f"{flag} {path} is a file, not a folder; choose a folder name.")
    if path.is_dir():
        if not os.access(path, os.W_OK | os.X_OK):
            raise CheckError(f"{flag} {path} is not writable; choose another folder or fix its permissions.")
        return
    _check_can_create_in(path, flag)


def safetensors_problem(path: str | os.PathLike) -> str | None:
    """Why `path` is not a complete safetensors file (missing, truncated, bad header), or None if it is complete.

    `safetensors.safe_open` reads the header and checks that it describes exactly the bytes in the file; its error is
    turned into a message that names the file. Tensor data is not read (safetensors has no checksum).
    """
    from safetensors import SafetensorError, safe_open

    path = Path(path)
    if not path.is_file():
        return f"{path.name} is missing"
    try:
        with safe_open(str(path), framework="pt"):
            pass
    except SafetensorError as error:
        detail = str(error).removeprefix("Error while deserializing header: ")
        # safetensors' words for a file shorter (or longer) than its header says
        if any(words in detail for words in ("header too small", "invalid header length", "not fully covered")):
            return f"{path.name} is truncated or damaged ({path.stat().st_size} bytes; {detail})"
        return f"{path.name} has an unreadable header (not a safetensors file, or corrupted: {detail})"
    except OSError as error:
        return f"{path.name} cannot be read ({error.strerror or error})"
    return None


def weight_files(folder: str | os.PathLike) -> list[Path]:
    """The safetensors files of a model folder: `model.safetensors`, or the shards its index lists (sorted); empty
    when there are neither (or the index is unreadable)."""
    folder = Path(folder)
    if (folder / "model.safetensors").is_file():
        return [folder / "model.safetensors"]
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            return [folder / shard for shard in sorted(set(read_json(index)["weight_map"].values()))]
        except (CheckError, KeyError, TypeError, AttributeError):
            return []
    return []


def nonfinite_weights(folder: str | os.PathLike) -> list[str]:
    """Names of the floating-point tensors of a model folder's safetensors weights that hold NaN or infinite values
    (a run that diverged saves them; nothing in loading refuses them). Reads every tensor, one at a time."""
    import torch
    from safetensors import safe_open

    bad = []
    for path in weight_files(folder):
        with safe_open(str(path), framework="pt") as weights:
            for name in weights.keys():
                tensor = weights.get_tensor(name)
                if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
                    bad.append(name)
    return bad


def weights_fingerprint(folder: str | os.PathLike) -> str | None:
    """"sha256:<hex>" of a model folder's safetensors weights (every file, in order), or None without weights: what a
    run's `metrics.json` records of the weights it scored, so that an export never pairs them with other weights."""
    files = weight_files(folder)
    if not files:
        return None
    digest = hashlib.sha256()
    for path in files:
        with open(path, "rb") as handle:
            while chunk := handle.read(1 << 22):
                digest.update(chunk)
    return "sha256:" + digest.hexdigest()


def weights_problems(folder: Path) -> list[str]:
    """Problems of the safetensors weights of a model folder (one file, or shards listed by an index)."""
    index = folder / "model.safetensors.index.json"
    if not (folder / "model.safetensors").is_file() and index.is_file():
        try:
            shards = sorted(set(read_json(index)["weight_map"].values()))
        except (CheckError, KeyError, TypeError, AttributeError):
            return [f"{index.name} is unreadable"]
        return [problem for shard in shards if (problem := safetensors_problem(folder / shard))]
    problem = safetensors_problem(folder / "model.safetensors")
    return [problem] if problem else []


def check_model_folder(folder: str | os.PathLike, *, need_tokenizer: bool = True,
                       trust_remote_code: bool = False) -> None:
    """The one check of a saved `vaswani` model folder that every command runs before loading it (vaswani-translate,
    vaswani-evaluate, vaswani-demo and its Space, vaswani-publish, vaswani-convert-ct2, vaswani-average, training from
    --model_name_or_path).

    Checks, in order: the folder and its config.json exist; every `*.json` file in it parses (the error names the
    file); config.json is a JSON object of a `vaswani` model that holds every field a save writes
    (`check_config_fields`: a default never stands in for a missing d_model) and whose every field is valid
    (`VaswaniConfig` validation, naming the file); generation_config.json, where there is one, agrees with it
    (`check_generation_file`: setting types, num_beams >= 1, length_penalty_style "hf" or "gnmt", special token ids
    inside the vocabulary and equal to the config's); the weights are complete safetensors (never
    `pytorch_model.bin`) with the config's names and shapes and no NaN or infinite value; with `trust_remote_code`,
    the model code files that config.json's auto_map names (and those they import) are there and are Python that
    defines the named classes; with `need_tokenizer`, the tokenizer (`check_tokenizer_matches`).

    Raises:
        CheckError: naming the file at fault, what is wrong and what to do.
    """
    from .configuration_vaswani import VaswaniConfig
    from .inputs_vaswani import check_config_fields, check_generation_file

    folder = Path(folder)
    config_path = folder / "config.json"
    if not folder.is_dir() or not config_path.is_file():
        raise CheckError(f"{folder} is not a saved model folder (no config.json); pass the --output_dir of a training "
                         f"run, one of its checkpoint-<step> folders, or an exported folder.")
    parsed = {path.name: read_json(path) for path in sorted(folder.glob("*.json"))}
    config = parsed["config.json"]
    if not isinstance(config, dict):
        raise CheckError(f"{config_path}: expected a JSON object of the model's settings, got "
                         f"{type(config).__name__}; the file is damaged. Copy the folder again.")
    model_type = config.get("model_type")
    if model_type != "vaswani":
        architectures = config.get("architectures")
        named = ", ".join(map(str, architectures)) if isinstance(architectures, list) else ""
        raise CheckError(
            f"{config_path}: model_type is {model_type!r}{f' ({named})' if named else ''}, not "
            f"'vaswani'. This command runs models trained by this project; load other models with their own classes.")
    try:
        check_config_fields(config, str(config_path))
        vaswani_config = VaswaniConfig.from_dict(dict(config))
    except CheckError:
        raise
    except ValueError as error:
        raise CheckError(f"{config_path}: {str(error).removeprefix(f'{config_path}: ').removeprefix('config.json: ')}"
                         ) from None
    generation_path = folder / "generation_config.json"
    if "generation_config.json" in parsed:
        generation = parsed["generation_config.json"]
        if not isinstance(generation, dict):
            raise CheckError(f"{generation_path}: expected a JSON object of generation settings, got "
                             f"{type(generation).__name__}. Write it anew: model.generation_config.save_pretrained("
                             f"folder).")
        try:
            check_generation_file(generation, str(generation_path), config)
        except ValueError as error:
            raise CheckError(str(error)) from None
    weights = weights_problems(folder)
    if weights:
        if not (folder / "model.safetensors").exists() and (folder / "pytorch_model.bin").exists():
            raise CheckError(
                f"{folder}: the weights are only in pytorch_model.bin, a pickle that can run code when loaded; this "
                f"project reads weights from model.safetensors only. Re-save the model with save_pretrained() "
                f"(safetensors is the default), loading the pickle only if you trust where it came from.")
        raise CheckError(f"{folder}: the weights cannot be used ({'; '.join(weights)}). The save did not finish or "
                         f"the file was damaged; copy it again or use another checkpoint.")
    _check_weights_fit_config(folder, vaswani_config)
    nonfinite = nonfinite_weights(folder)
    if nonfinite:  # from_pretrained refuses them too, but with a ValueError the commands would print as a traceback
        more = f" (and {len(nonfinite) - 1} more)" if len(nonfinite) > 1 else ""
        raise CheckError(f"{folder}: weight {nonfinite[0]}{more} in {', '.join(p.name for p in weight_files(folder))} "
                         f"holds NaN or infinite values. The file is corrupted, or the training run that wrote it "
                         f"diverged; use an earlier checkpoint.")
    if trust_remote_code:
        check_model_code(folder, config.get("auto_map"))
    if need_tokenizer:
        check_tokenizer_matches(folder, vaswani_config, trust_remote_code=trust_remote_code)


def _check_weights_fit_config(folder: Path, config) -> None:
    """The weights' names and shapes (headers only) against the model `config` builds, on the meta device
    (`loading_vaswani.check_weights_fit`). The demo's Space ships this module without the model code: there the
    model's own `from_pretrained` runs the same check."""
    try:
        import torch

        from .loading_vaswani import check_weights_fit
        from .modeling_vaswani import VaswaniForConditionalGeneration
    except ImportError:
        return
    with torch.device("meta"):
        model = VaswaniForConditionalGeneration(config)
    try:
        check_weights_fit(model, folder)
    except (OSError, ValueError) as error:
        raise CheckError(str(error)) from None


def check_model_code(folder: str | os.PathLike, auto_map) -> None:
    """With `trust_remote_code=True` transformers runs the model code saved in the folder: each module that
    config.json's `auto_map` names, and the modules they import relatively, must be there, be whole (not empty, ending
    in a newline as every saved code file does) and be Python that defines the classes named and the names the other
    modules import from it (a truncated file would fail inside transformers' import, or define too little).

    Raises:
        CheckError: no auto_map, or a missing, empty or cut-off file, a file that is not Python, a name not defined;
            naming the file.
    """
    import ast

    folder = Path(folder)
    if not isinstance(auto_map, dict) or not auto_map:
        raise CheckError(f"{folder / 'config.json'}: no auto_map naming the model's code files, so it cannot load with "
                         f"--trust_remote_code. Re-save the model with vaswani_hf installed (save_pretrained writes "
                         f"auto_map and the code files), or load it without --trust_remote_code.")
    wanted: dict[str, set[str]] = {}  # module -> the names auto_map or the other code files take from it
    for reference in auto_map.values():
        for entry in reference if isinstance(reference, list) else [reference]:
            if isinstance(entry, str) and "." in entry:
                module, name = entry.split("--")[-1].rsplit(".", 1)
                wanted.setdefault(module, set()).add(name)
    trees = {}
    pending = list(wanted)
    while pending:
        module = pending.pop()
        if module in trees:
            continue
        path = folder / f"{module}.py"
        if not path.is_file():
            raise CheckError(f"{path}: no such file; the model's code (config.json's auto_map) needs it with "
                             f"--trust_remote_code. Copy the folder again with its code files.")
        source = path.read_bytes()
        if not source.endswith(b"\n"):
            raise CheckError(f"{path}: {'empty' if not source else 'cut off (it does not end with a newline)'}; the "
                             f"file is truncated or damaged. Copy the folder again with its code files.")
        try:
            trees[module] = tree = ast.parse(source, filename=str(path))
        except (SyntaxError, ValueError) as error:
            where = f" at line {error.lineno}" if getattr(error, "lineno", None) else ""
            raise CheckError(f"{path}: not valid Python{where} ({getattr(error, 'msg', error)}); the file is truncated "
                             f"or damaged. Copy the folder again with its code files.") from None
        for node in _statements(tree.body):  # the neighbours this module imports, and what it takes from each
            if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module:
                neighbour = node.module.split(".")[0]
                wanted.setdefault(neighbour, set()).update(alias.name for alias in node.names if alias.name != "*")
                pending.append(neighbour)
    for module, tree in trees.items():
        missing = sorted(wanted.get(module, set()) - _top_level_names(tree.body))
        if missing:
            raise CheckError(f"{folder / f'{module}.py'}: defines no {', '.join(missing)}, which config.json's "
                             f"auto_map or the other code files take from it; the file is truncated or from another "
                             f"model. Copy the folder again with its code files.")


def _statements(body: list):
    """Every statement of `body` and of the blocks nested in it (functions, classes, branches), expressions skipped:
    where imports can be."""
    for node in body:
        yield node
        for block in ("body", "orelse", "finalbody", "handlers", "cases"):
            inner = getattr(node, block, None)
            if isinstance(inner, list):
                yield from _statements(inner)


def _top_level_names(body: list) -> set[str]:
    """The names a module's statements `body` define at its top level (inside `if` and `try` blocks too)."""
    import ast

    names: set[str] = set()
    for node in body:
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(alias.asname or alias.name).split(".")[0] for alias in node.names}
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {leaf.id for target in targets for leaf in ast.walk(target) if isinstance(leaf, ast.Name)}
        elif isinstance(node, (ast.If, ast.Try, ast.With)):
            blocks = [node.body, getattr(node, "orelse", []), getattr(node, "finalbody", [])]
            blocks += [handler.body for handler in getattr(node, "handlers", [])]
            names |= set().union(*(_top_level_names(block) for block in blocks))
    return names


def check_tokenizer_matches(folder: str | os.PathLike, config, *, trust_remote_code: bool = False) -> None:
    """Refuse a tokenizer that is not whole or does not belong to the model's config: it would translate garbage
    without a word (every id means another token), or stop in transformers' messages about padding tokens.

    Checks tokenizer.json and tokenizer_config.json exist (the second holds the special tokens: without it the
    tokenizer has no padding, start or end token) and are JSON objects, the tokenizer loads, has exactly `vocab_size`
    entries, and its padding, start and end token ids are the config's.

    Raises:
        CheckError: naming the file at fault.
    """
    folder = Path(folder)
    path = folder / "tokenizer.json"
    if not path.is_file():
        raise CheckError(f"{folder}: no tokenizer.json beside the model. Save the tokenizer with the model "
                         f"(tokenizer.save_pretrained(folder)); vaswani-train does so in --output_dir.")
    settings_path = folder / "tokenizer_config.json"
    if not settings_path.is_file():
        raise CheckError(f"{settings_path}: no such file; it names the tokenizer's padding, start and end tokens, and "
                         f"without it the tokenizer has none. Save the tokenizer with the model "
                         f"(tokenizer.save_pretrained(folder)), or copy the folder again.")
    for file in (path, settings_path):
        if not isinstance(read_json(file), dict):
            raise CheckError(f"{file}: expected a JSON object, got another JSON value; the file is damaged. Save the "
                             f"tokenizer with the model again (tokenizer.save_pretrained(folder)).")
    try:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=trust_remote_code)
    except Exception as error:  # tokenizers raises a bare Exception for a malformed model section
        raise CheckError(f"{path}: the tokenizer cannot be loaded ({type(error).__name__}: {error}); the file is "
                         f"damaged. Copy it again with the model, or save the tokenizer beside it again.") from None
    if len(tokenizer) != config.vocab_size:
        raise CheckError(f"{path}: the tokenizer has {len(tokenizer)} entries but the model's vocabulary "
                         f"(config.json vocab_size) has {config.vocab_size}: this tokenizer does not belong to this "
                         f"model. Put the tokenizer saved with the model beside it.")
    for name in ("pad_token_id", "bos_token_id", "eos_token_id"):
        ours, theirs = getattr(config, name), getattr(tokenizer, name, None)
        if ours is not None and ours != theirs:
            raise CheckError(f"{settings_path}: the tokenizer's {name} is {theirs} but config.json says {ours}: this "
                             f"tokenizer does not belong to this model. Put the tokenizer saved with the model beside "
                             f"it.")
