"""Shared fixtures: a tiny VaswaniConfig/model and a tiny joint BPE trained on the fly (no network, no files).

`make_tiny_config(**overrides)` is importable (`from conftest import make_tiny_config`) for parametrized variants.
"""

import json
import os
from pathlib import Path

import pytest
import torch

from vaswani_hf import VaswaniConfig, VaswaniForConditionalGeneration, train_joint_bpe

# The tiny models are far too small to gain from intra-op threads, and on a shared machine with few cores the
# threads' spinning makes each forward ~100x slower.
torch.set_num_threads(1)

TINY = dict(
    vocab_size=99,
    d_model=32,
    encoder_layers=2,
    decoder_layers=2,
    num_heads=4,
    d_ff=37,
    max_position_embeddings=64,
)

GERMAN = [
    "Ein Mann fährt mit dem Fahrrad durch die Stadt.",
    "Zwei Hunde spielen im Schnee.",
    "Eine Frau liest ein Buch im Park.",
    "Kinder spielen Fußball auf einer Wiese.",
    "Ein Mädchen trinkt Wasser aus einer Flasche.",
    "Der Koch schneidet Gemüse in der Küche.",
    "Ein älterer Mann sitzt auf einer Bank.",
    "Eine Gruppe von Menschen wartet auf den Bus.",
    "Ein Junge springt in einen See.",
    "Zwei Frauen unterhalten sich vor einem Café.",
    "Ein Hund läuft am Strand entlang.",
    "Ein Musiker spielt Gitarre auf der Straße.",
    "Die Sonne scheint über den Bergen.",
    "Ein Arbeiter repariert das Dach eines Hauses.",
    "Ein Baby schläft in seinem Bett.",
    "Viele Menschen gehen über den Markt.",
    "Ein Mann in einem roten Hemd klettert einen Felsen hinauf.",
    "Eine Katze sitzt auf dem Fenster.",
    "Zwei Männer tragen eine schwere Kiste.",
    "Ein Mädchen malt ein Bild mit bunten Farben.",
]
ENGLISH = [
    "A man rides his bike through the city.",
    "Two dogs are playing in the snow.",
    "A woman reads a book in the park.",
    "Children play soccer on a meadow.",
    "A girl drinks water from a bottle.",
    "The cook cuts vegetables in the kitchen.",
    "An older man sits on a bench.",
    "A group of people waits for the bus.",
    "A boy jumps into a lake.",
    "Two women talk in front of a café.",
    "A dog runs along the beach.",
    "A musician plays guitar on the street.",
    "The sun shines over the mountains.",
    "A worker repairs the roof of a house.",
    "A baby sleeps in its bed.",
    "Many people walk across the market.",
    "A man in a red shirt climbs up a rock.",
    "A cat sits on the window.",
    "Two men carry a heavy box.",
    "A girl paints a picture with bright colors.",
]


def make_tiny_config(**overrides) -> VaswaniConfig:
    """The tiny test configuration (vocab 99, d_model 32, 2+2 layers, 4 heads, d_ff 37), with `overrides`."""
    return VaswaniConfig(**{**TINY, **overrides})


def make_tiny_model(seed: int = 0, **overrides) -> VaswaniForConditionalGeneration:
    """A freshly initialized tiny model in eval mode; the same `seed` gives the same weights."""
    torch.manual_seed(seed)
    return VaswaniForConditionalGeneration(make_tiny_config(**overrides)).eval()


def padded_batch(seed: int = 0, batch: int = 3, length: int = 9, vocab: int = 99):
    """Source ids `(batch, length)` ending in </s> (id 2), row i right-padded (id 0) by 2 * i positions; the mask."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, vocab, (batch, length), generator=generator)
    mask = torch.ones(batch, length, dtype=torch.long)
    for row in range(batch):
        n = length - 2 * row
        ids[row, n - 1] = 2
        ids[row, n:] = 0
        mask[row, n:] = 0
    return ids, mask


@pytest.fixture
def tiny_config() -> VaswaniConfig:
    return make_tiny_config()


@pytest.fixture
def tiny_model() -> VaswaniForConditionalGeneration:
    return make_tiny_model()


@pytest.fixture(scope="session")
def parallel_text() -> tuple[list[str], list[str]]:
    return list(GERMAN), list(ENGLISH)


@pytest.fixture(scope="session")
def tiny_tokenizer(parallel_text):
    """A joint BPE learned from the 20 German and 20 English sentences above (a few hundred tokens)."""
    german, english = parallel_text
    return train_joint_bpe([german, english], vocab_size=420, min_frequency=1)


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
ISA_MODULES = ("test_real_tokens.py", "test_speed_paths.py")


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
    if _too_few_transformers_tests() and exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter):
    if any(_transformers_outcomes.values()) or _too_few_transformers_tests():
        counts = ", ".join(f"{n} {outcome}" for outcome, n in _transformers_outcomes.items())
        terminalreporter.write_line(f"transformers' common tests ({TRANSFORMERS_TESTS[:-2]}): {counts}")
    if _too_few_transformers_tests():
        terminalreporter.write_line(f"FAILED: {_too_few_transformers_tests()}", red=True, bold=True)


def exits_with(call, *patterns) -> str:
    """Run a command's main(); it must stop with SystemExit whose message matches every regex pattern. Returns the
    message."""
    import re

    with pytest.raises(SystemExit) as error:
        call()
    message = str(error.value.code)
    for pattern in patterns:
        assert re.search(pattern, message), f"{pattern!r} not in {message!r}"
    return message


def write_jsonl(path: Path, pairs) -> str:
    """Write (German, English) `pairs` as JSON lines of {"translation": {"de": ..., "en": ...}}; returns the path."""
    path.write_text("".join(json.dumps({"translation": {"de": de, "en": en}}, ensure_ascii=False) + "\n"
                            for de, en in pairs), encoding="utf-8")
    return str(path)
