"""transformers' own common tests (`tests/test_modeling_common.py`, ...) from the source distribution of the
installed transformers version, fetched from the package registry with pip and unpacked into a cache.

The sdist ships the top-level test mixins but not the modules they import relatively: `tests/generation/test_utils.py`
(GenerationTesterMixin), `tests/exporters/test_export.py` (ExportTesterMixin, the base of ModelTesterMixin) and
`tests/utils/test_configuration_utils.py` (`config_common_kwargs`, used by `ConfigTester.check_config_arguments_init`).
Where the unpacked tree lacks one, a module that skips is written in its place (`MISSING_MODULES`): each mixin brings
one test that skips with the reason, and any use of `config_common_kwargs` skips the test that uses it. The reasons
hold for MarianMT and BART as for this model: none of those tests can run from the sdist. Pointing
VASWANI_TRANSFORMERS_TESTS at the `tests/` folder of a transformers git checkout of the same version runs the real
modules instead.

Run as a script (`python tests/_transformers_sdist.py`, as `.ci/run` does) to fetch now; exits non-zero on failure.

Environment:
    VASWANI_TRANSFORMERS_TESTS: a transformers `tests/` folder to use instead of the sdist (nothing is fetched).
    VASWANI_TRANSFORMERS_CACHE: where sdists are cached (default ~/.cache/vaswani-hf/transformers-tests).
"""

from __future__ import annotations

import hashlib
import importlib
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

PACKAGE = "transformers_common_tests"
_HOW_TO_RUN = ("set VASWANI_TRANSFORMERS_TESTS to the tests/ folder of a transformers git checkout of the installed "
               "version to run them")


def _mixin_module(mixin: str, test: str, reason: str) -> str:
    """A module whose `mixin` brings one test, `test`, that skips with `reason`."""
    return (f"import unittest\n\n\nclass {mixin}:\n    def {test}(self):\n"
            f"        raise unittest.SkipTest({reason!r})\n")


def _unavailable_value_module(name: str, reason: str) -> str:
    """A module whose `name` skips, with `reason`, whatever test reads, copies or iterates it."""
    return ("import unittest\n\n\nclass Unavailable:\n"
            "    def __init__(self, reason):\n        self.reason = reason\n\n"
            "    def __getattr__(self, attribute):\n        raise unittest.SkipTest(self.reason)\n\n"
            "    def __deepcopy__(self, memo):\n        raise unittest.SkipTest(self.reason)\n\n"
            "    def __iter__(self):\n        raise unittest.SkipTest(self.reason)\n\n\n"
            f"{name} = Unavailable({reason!r})\n")


# The modules the sdist lacks, written as skips whose reasons hold for every model.
MISSING_MODULES = {
    "exporters/test_export.py": _mixin_module(
        "ExportTesterMixin", "test_export_tester_mixin",
        "transformers' sdist does not ship tests/exporters/test_export.py: ExportTesterMixin's torch.export tests "
        "cannot run from it, for MarianMT and BART as for any model (tests/test_compile_export.py exports this "
        "one); " + _HOW_TO_RUN),
    "generation/test_utils.py": _mixin_module(
        "GenerationTesterMixin", "test_generation_tester_mixin",
        "transformers' sdist does not ship tests/generation/test_utils.py: GenerationTesterMixin's tests cannot run "
        "from it, for MarianMT and BART as for any model (tests/test_generation_common.py checks the same "
        "behaviours on this one); " + _HOW_TO_RUN),
    "utils/test_configuration_utils.py": _unavailable_value_module(
        "config_common_kwargs",
        "transformers' sdist does not ship tests/utils/test_configuration_utils.py: without its config_common_kwargs, "
        "ConfigTester.check_config_arguments_init cannot run from it, for MarianMT and BART as for any model; "
        + _HOW_TO_RUN),
}
# A file in the built package naming the MISSING_MODULES it was built with: a package built with others is rebuilt.
_BUILD_STAMP = ".vaswani_build"


def cache_root() -> Path:
    return Path(os.environ.get("VASWANI_TRANSFORMERS_CACHE",
                               Path.home() / ".cache" / "vaswani-hf" / "transformers-tests"))


def _fetch_sdist(version: str, into: Path, timeout: int) -> Path:
    """`pip download` the sdist of transformers==version into `into`; returns the archive path."""
    into.mkdir(parents=True, exist_ok=True)
    found = sorted(into.glob(f"transformers-{version}.tar.gz"))
    if found:
        return found[0]
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
               "--timeout", "15", "--retries", "1", "--disable-pip-version-check", "-d", str(into),
               f"transformers=={version}"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    found = sorted(into.glob(f"transformers-{version}.tar.gz"))
    if result.returncode or not found:
        tail = (result.stderr or result.stdout).strip().splitlines()[-3:]
        raise RuntimeError(f"pip could not download the transformers {version} sdist: " + " | ".join(tail))
    return found[0]


def _build_id() -> str:
    return hashlib.sha256(repr(sorted(MISSING_MODULES.items())).encode()).hexdigest()


def _build_package(tests_dir: Path, target: Path) -> None:
    """Copy `tests_dir`'s top-level test modules into package `target`, with `MISSING_MODULES` where it lacks them."""
    staging = Path(tempfile.mkdtemp(dir=target.parent))
    try:
        for module in tests_dir.glob("*.py"):
            shutil.copy2(module, staging / module.name)
        for package in {relative.split("/")[0] for relative in MISSING_MODULES}:  # what a source checkout has
            if (tests_dir / package).is_dir():
                shutil.copytree(tests_dir / package, staging / package, dirs_exist_ok=True,
                                ignore=shutil.ignore_patterns("__pycache__"))
        (staging / "__init__.py").touch()
        for relative, text in MISSING_MODULES.items():
            path = staging / relative
            path.parent.mkdir(parents=True, exist_ok=True)
            (path.parent / "__init__.py").touch()
            if not path.exists():
                path.write_text(text)
        (staging / _BUILD_STAMP).write_text(_build_id())
        if target.exists():
            shutil.rmtree(target)
        staging.rename(target)
    finally:
        if staging.exists():
            shutil.rmtree(staging)


def prepare(timeout: int = 300) -> Path:
    """A folder on which `import transformers_common_tests.test_modeling_common` works, for the installed version.

    Raises RuntimeError (with the reason) when the sdist cannot be fetched, e.g. on an offline machine."""
    import transformers

    version = transformers.__version__
    local = os.environ.get("VASWANI_TRANSFORMERS_TESTS")
    root = cache_root() / version
    target_parent = root / ("local" if local else "sdist")
    target = target_parent / PACKAGE
    if local:
        target_parent.mkdir(parents=True, exist_ok=True)
        _build_package(Path(local), target)
        return target_parent
    stamp = target / _BUILD_STAMP
    if (target / "test_modeling_common.py").exists() and stamp.exists() and stamp.read_text() == _build_id():
        return target_parent
    archive = _fetch_sdist(version, root, timeout)
    with tempfile.TemporaryDirectory(dir=root) as tmp:
        with tarfile.open(archive) as tar:
            members = [m for m in tar.getmembers() if m.name.startswith(f"transformers-{version}/tests/")
                       and (m.isfile() or m.isdir())]
            try:
                tar.extractall(tmp, members=members, filter="data")
            except TypeError:  # Python without extraction filters (< 3.10.12 / 3.11.4)
                tar.extractall(tmp, members=members)
        tests_dir = Path(tmp) / f"transformers-{version}" / "tests"
        if not (tests_dir / "test_modeling_common.py").exists():
            raise RuntimeError(f"the transformers {version} sdist has no tests/test_modeling_common.py")
        target_parent.mkdir(parents=True, exist_ok=True)
        _build_package(tests_dir, target)
    return target_parent


def import_common(module: str):
    """`transformers_common_tests.<module>` from `prepare()`'s folder."""
    folder = str(prepare())
    if folder not in sys.path:
        sys.path.insert(0, folder)
    return importlib.import_module(f"{PACKAGE}.{module}")


if __name__ == "__main__":
    try:
        print(prepare())
    except (RuntimeError, OSError, subprocess.SubprocessError) as error:
        sys.exit(f"transformers common tests not available: {error}")
