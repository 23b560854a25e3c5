"""Fixtures and pytest hooks. What test modules import (the tiny model, sentences, the commands in-process) is in
`helpers.py`."""

import os

import pytest
import torch
from helpers import ENGLISH, GERMAN, PLANTED_TOKEN, save_model_folder, train_cli

from vaswani_hf import train_joint_bpe

# The tiny models are far too small to gain from intra-op threads, and on a shared machine with few cores the
# threads' spinning makes each forward ~100x slower.
torch.set_num_threads(1)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    """A test module must leave torch's thread count at 1: the tests after it in its process compare results
    bitwise with runs in other processes, and another thread count rounds differently."""
    result = yield
    if nextitem is None or nextitem.module is not item.module:
        threads = torch.get_num_threads()
        if threads != 1:
            torch.set_num_threads(1)
            raise AssertionError(f"{item.module.__name__} left torch's thread count at {threads}, not 1")
    return result


@pytest.fixture(scope="session")
def parallel_text() -> tuple[list[str], list[str]]:
    return list(GERMAN), list(ENGLISH)


@pytest.fixture(scope="session")
def tiny_tokenizer(parallel_text):
    """A joint BPE learned from the 20 German and 20 English sentences of `helpers` (a few hundred tokens)."""
    german, english = parallel_text
    return train_joint_bpe([german, english], vocab_size=420, min_frequency=1)


@pytest.fixture
def model_folder(tmp_path, tiny_tokenizer):
    """A complete saved tiny model with its tokenizer (`helpers.save_model_folder`), in this test's own folder."""
    return save_model_folder(tmp_path / "model", tiny_tokenizer)


@pytest.fixture(scope="session")
def train_cache(tmp_path_factory):
    """The `--cache_dir` the tiny runs share (their joint BPE is learned once)."""
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory, train_cache):
    """A tiny run (`helpers.train_cli`) with the dashed `--max-steps 3`, a checkpoint every step, averaging of the last
    2, and a planted Hub token (no push): its folder and metrics. Tests copy the folder before they change it."""
    out = tmp_path_factory.mktemp("run")
    metrics = train_cli(out, train_cache, "--max-steps", "3", "--save_steps", "1", "--average_last", "2",
                        "--hub_token", PLANTED_TOKEN)
    return out, metrics


def pytest_configure(config):
    # Marks of transformers' common test mixins (tests/test_transformers_common.py), registered as transformers'
    # own conftest does, so that pytest does not warn about them.
    for mark in ("slow", "accelerate_tests", "flash_attn_test", "flash_attn_3_test", "flash_attn_4_test",
                 "torch_compile_test"):
        config.addinivalue_line("markers", f"{mark}: a mark of transformers' common tests")
    config.addinivalue_line("markers", "isa: depends on the kernels the CPU's instruction set picks (int8 and bf16 "
                                       "products, oneDNN or BLAS); `.ci/run` runs these again with AVX2 forced")


# Modules whose every test depends on the instruction set (bf16 autocast, oneDNN against BLAS), marked `isa` here;
# other such tests carry the mark in their own module.
ISA_MODULES = ("test_kernels.py",)


@pytest.hookimpl(tryfirst=True)  # before `-m` selects by marks
def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.path.name in ISA_MODULES:
            item.add_marker(pytest.mark.isa)


def _dev_requirements() -> list[str]:
    """The distributions the project's `dev` extra installs, with those of the project's own extras it includes."""
    from importlib.metadata import packages_distributions, requires

    from packaging.requirements import Requirement

    project = packages_distributions()["vaswani_hf"][0]
    requirements = [Requirement(line) for line in requires(project) or []]
    names, extras, seen = [], ["dev"], {"dev"}
    while extras:
        extra = extras.pop()
        for requirement in requirements:
            if requirement.marker is None or not requirement.marker.evaluate({"extra": extra}):
                continue
            if requirement.name.lower().replace("_", "-") == project.lower().replace("_", "-"):
                extras += sorted(requirement.extras - seen)
                seen |= requirement.extras
            else:
                names.append(requirement.name)
    return names


def pytest_sessionstart(session):
    """With VASWANI_REQUIRE_DEV=1 (`.ci/run`), every dev dependency must import: a broken or missing install fails the
    run here instead of turning the tests that need it into `importorskip` skips."""
    import importlib
    from importlib.metadata import packages_distributions

    if os.environ.get("VASWANI_REQUIRE_DEV") != "1":
        return
    modules = {}
    for module, distributions in packages_distributions().items():
        for distribution in distributions:
            modules.setdefault(distribution.lower().replace("_", "-"), []).append(module)
    broken = []
    for name in _dev_requirements():
        key = name.lower().replace("_", "-")
        # the module named as its distribution where there is one (matplotlib, not also pylab and mpl_toolkits)
        names = [m for m in modules.get(key, []) if m.lower() == key.replace("-", "_")] or modules.get(key, [])
        if not names:
            broken.append(f"{name}: not installed")
        for module in names:
            try:
                importlib.import_module(module)
            except Exception as error:  # noqa: BLE001 - whatever breaks the import breaks the tests that need it
                broken.append(f"{name}: import {module} failed ({type(error).__name__}: {error})")
    if broken:
        raise pytest.UsageError("VASWANI_REQUIRE_DEV=1 and dev dependencies (the dev extra) do not import:\n  "
                                + "\n  ".join(broken))


# transformers' own common tests (tests/test_transformers_common.py): how many ran, printed after the run; with
# VASWANI_MIN_TRANSFORMERS_TESTS set (`.ci/run`), fewer passed than that fails the run.
TRANSFORMERS_TESTS = "tests/test_transformers_common.py::VaswaniModelTest::"
_transformers_outcomes = {"passed": 0, "skipped": 0, "failed": 0}


def pytest_runtest_logreport(report):
    if type(report) is not pytest.TestReport or not report.nodeid.startswith(TRANSFORMERS_TESTS):
        return  # a subtest's report is not a test's
    if report.when == "call" or report.outcome != "passed":
        _transformers_outcomes[report.outcome] += 1


def _too_few_transformers_tests() -> str | None:
    least = os.environ.get("VASWANI_MIN_TRANSFORMERS_TESTS")
    if least is not None and _transformers_outcomes["passed"] < int(least):
        return f"fewer than VASWANI_MIN_TRANSFORMERS_TESTS={least} of transformers' common tests passed"
    return None


def pytest_sessionfinish(session, exitstatus):
    if hasattr(session.config, "workerinput"):
        return  # a pytest-xdist worker sees only its share; the controller counts every worker's reports
    if _too_few_transformers_tests() and exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter):
    if any(_transformers_outcomes.values()) or _too_few_transformers_tests():
        counts = ", ".join(f"{n} {outcome}" for outcome, n in _transformers_outcomes.items())
        terminalreporter.write_line(f"transformers' common tests ({TRANSFORMERS_TESTS[:-2]}): {counts}")
    if _too_few_transformers_tests():
        terminalreporter.write_line(f"FAILED: {_too_few_transformers_tests()}", red=True, bold=True)
