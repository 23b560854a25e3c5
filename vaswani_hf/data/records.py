"""The check of one parallel record, for every reader of parallel data (`reading`, `datasets`, `checking`): a
`{"translation": {source_lang: str, target_lang: str}}` object, or a `CheckError` naming the record.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from ..checks import CheckError

__all__ = ["translation_pair"]


def _example(source_lang: str, target_lang: str) -> str:
    return f'{{"translation": {{"{source_lang}": "...", "{target_lang}": "..."}}}}'


def _shown(record: Any) -> str:
    try:
        text = json.dumps(record, ensure_ascii=False, default=str)
    except (TypeError, ValueError):
        text = repr(record)
    return text if len(text) <= 80 else text[:77] + "..."


def translation_pair(record: Any, source_lang: str, target_lang: str, where: str) -> tuple[str, str]:
    """The `(source, target)` sentences of one record, stripped: the one check of a record, for every reader.

    `where` names the record in messages ("FILE:LINE", "Hub dataset 'x' split 'train' row 3").

    Raises:
        CheckError: the record is not an object with a 'translation' object (e.g. `{"de": ..., "en": ...}` or
            `{"text": ...}`); a language is missing from it (lists the codes present) or null; a sentence is not a
            string.
    """
    translation = record.get("translation") if isinstance(record, Mapping) else None
    if not isinstance(translation, Mapping):
        # a dataset's rows hold every column of the split, null where a record has no such key
        keys = ""
        if isinstance(record, Mapping):
            keys = f" (keys: {', '.join(str(k) for k, v in record.items() if v is not None) or 'none'})"
        raise CheckError(f"{where}: expected an object with a 'translation' object, e.g. "
                         f"{_example(source_lang, target_lang)}; got {_shown(record)}{keys}. Convert the data to such "
                         f"records (JSON lines).")
    for lang in (source_lang, target_lang):
        if translation.get(lang) is None:
            present = sorted(str(code) for code, text in translation.items() if text is not None)
            raise CheckError(f"{where}: language {lang!r} not in this record's 'translation' (missing or null); codes "
                             f"present: {', '.join(present) or '(none)'}. Pass --source_lang/--target_lang "
                             f"(source_lang/target_lang) from these, or fix the record.")
        if not isinstance(translation[lang], str):
            raise CheckError(f"{where}: translation[{lang!r}] must be a string, got "
                             f"{type(translation[lang]).__name__} ({_shown(translation[lang])}).")
    return translation[source_lang].strip(), translation[target_lang].strip()
