"""What `vaswani-publish --space` writes beside a published model so that its folder also runs as a Hugging Face Space:
the vaswani-demo page (training/demo.py, copied as it is), the vaswani_hf modules it uses, `app.py` and
`requirements.txt`, and the Space metadata of the model card.
"""

from __future__ import annotations

from importlib import resources

# What `vaswani-publish --space` writes beside the model --------------------------------------------------------------

SPACE_PACKAGE = "vaswani_demo"  # the page and the vaswani_hf modules it uses, copied into the Space folder
SPACE_APP = '''"""A Hugging Face Space: the vaswani-demo page of the model in this folder (vaswani-publish --space).

The model loads from its own code files (trust_remote_code=True); the page's code is in {package}/.
"""

import os
import sys

from {package}.page import main

if __name__ == "__main__":
    sys.exit(main(["--model", os.path.dirname(os.path.abspath(__file__)), "--trust_remote_code",
                   "--source_lang", {source_lang!r}]))
'''


def space_requirements() -> list[str]:
    """The Space's requirements.txt lines: the project's own dependencies and its `demo` extra's, without the
    browser-test driver (playwright)."""
    from importlib.metadata import packages_distributions, requires

    from packaging.requirements import Requirement

    project = packages_distributions()["vaswani_hf"][0]
    lines = []
    for line in requires(project) or []:
        requirement = Requirement(line)
        if requirement.name == "playwright":
            continue
        if requirement.marker is None or requirement.marker.evaluate({"extra": "demo"}):
            requirement.marker = None
            lines.append(str(requirement))
    return lines


def space_files(source_lang: str = "de") -> dict[str, str]:
    """The files a Space needs beside a published model, by path relative to the folder: `app.py` (runs this page
    for the folder's model, loaded with `trust_remote_code=True`), `requirements.txt`, and `vaswani_demo/` holding this
    module as `page.py` with the `vaswani_hf` modules the page's core uses, in their folders: `checks.py` with the
    `configuration_vaswani.py` and `inputs_vaswani.py` its model-folder check reads, `decoding/translate.py`,
    `pictures/attention.py`, `pictures/positions.py` and `pictures/demo.py` (they import only each other, torch,
    transformers, matplotlib and Pillow; each folder gets an `__init__.py` of its own that imports nothing), so the
    Space needs no vaswani_hf."""
    from pathlib import Path

    from vaswani_hf import checks, configuration_vaswani, inputs_vaswani
    from vaswani_hf.decoding import translate
    from vaswani_hf.pictures import attention, positions
    from vaswani_hf.pictures import demo as core

    package_doc = '"""The vaswani-demo page and the vaswani_hf modules it uses."""\n'
    page = resources.files("vaswani_training").joinpath("demo.py").read_text(encoding="utf-8")  # the command's file
    files = {f"{SPACE_PACKAGE}/__init__.py": package_doc, f"{SPACE_PACKAGE}/page.py": page}
    for module in (checks, configuration_vaswani, inputs_vaswani, translate, attention, positions, core):
        # vaswani_hf.decoding.translate -> vaswani_demo/decoding/translate.py, beside an __init__.py of its own
        *folders, name = module.__name__.split(".")[1:]
        for depth in range(1, len(folders) + 1):
            files.setdefault(f"{SPACE_PACKAGE}/{'/'.join(folders[:depth])}/__init__.py", package_doc)
        files[f"{SPACE_PACKAGE}/{'/'.join([*folders, name])}.py"] = Path(module.__file__).read_text(encoding="utf-8")
    files["app.py"] = SPACE_APP.format(package=SPACE_PACKAGE, source_lang=source_lang)
    files["requirements.txt"] = "\n".join(space_requirements()) + "\n"
    return files


def space_card(readme: str) -> str:
    """The model card `readme` with the metadata a Space reads added to its YAML header (`sdk: gradio`, the
    installed gradio's version, `app_file: app.py`)."""
    from importlib.metadata import PackageNotFoundError, version

    lines = ["sdk: gradio", "app_file: app.py"]
    try:
        lines.insert(1, f"sdk_version: {version('gradio')}")
    except PackageNotFoundError:  # the Hub then picks its default gradio
        pass
    header = "\n".join(lines) + "\n"
    return "---\n" + header + readme[4:] if readme.startswith("---\n") else "---\n" + header + "---\n" + readme
