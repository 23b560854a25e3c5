"""What the test modules share: the tiny model and its batches, a few parallel sentences, the copy task, the commands
called in-process, and subprocesses that cannot import vaswani_hf.

Test modules import from here (`from helpers import tiny_model`); `conftest.py` holds only fixtures and pytest hooks.
"""

import gzip
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from vaswani_hf import VaswaniConfig, VaswaniForConditionalGeneration

ROOT = Path(__file__).resolve().parent.parent  # the checkout
PAD, BOS, EOS = 0, 1, 2  # the special ids of every test config; decoder_start_token_id is BOS

# The tiny model -------------------------------------------------------------------------------------------------------

TINY = dict(vocab_size=99, d_model=32, encoder_layers=2, decoder_layers=2, num_heads=4, d_ff=37,
            max_position_embeddings=64)


def tiny_config(**overrides) -> VaswaniConfig:
    """The tiny test configuration (`TINY`: vocabulary 99, d_model 32, 2+2 layers, 4 heads, d_ff 37, a 64-position
    table), with `overrides`."""
    return VaswaniConfig(**{**TINY, **overrides})


def tiny_model(seed: int = 0, **overrides) -> VaswaniForConditionalGeneration:
    """A freshly initialized tiny model (`tiny_config(**overrides)`) in eval mode; the same `seed` gives the same
    weights."""
    torch.manual_seed(seed)
    return VaswaniForConditionalGeneration(tiny_config(**overrides)).eval()


def padded_batch(seed: int = 0, batch: int = 3, length: int = 9, vocab: int = 99):
    """Source ids `(batch, length)` ending in </s>, row i right-padded by 2 * i positions (every row keeps at least its
    </s>); and the attention mask."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, vocab, (batch, length), generator=generator)
    mask = torch.ones(batch, length, dtype=torch.long)
    for row in range(batch):
        n = max(length - 2 * row, 1)
        ids[row, n - 1] = EOS
        ids[row, n:] = PAD
        mask[row, n:] = 0
    return ids, mask


def save_model_folder(folder: Path, tokenizer, seed: int = 0, **overrides) -> Path:
    """A model folder as a run leaves it: `tiny_model(seed, **overrides)` sized to `tokenizer`, saved with it."""
    tiny_model(seed, vocab_size=len(tokenizer), **overrides).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


# Text and files -------------------------------------------------------------------------------------------------------

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


def write(path: Path, data: str | bytes, gz: bool = False) -> Path:
    """Write `data` (text as UTF-8, byte for byte: no newline translation) to `path`, gzip-compressed with `gz`
    (reproducibly: no time stamp), creating its folder."""
    if isinstance(data, str):
        data = data.encode("utf-8")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(gzip.compress(data, mtime=0) if gz else data)
    return path


def write_parallel(folder: Path, german=GERMAN, english=ENGLISH, name: str = "p") -> str:
    """`folder/name.de` and `folder/name.en`, one sentence a line; returns the prefix the commands take."""
    write(folder / f"{name}.de", "\n".join(german) + "\n")
    write(folder / f"{name}.en", "\n".join(english) + "\n")
    return str(folder / name)


def write_jsonl(path: Path, pairs) -> str:
    """Write (German, English) `pairs` as JSON lines of {"translation": {"de": ..., "en": ...}}; returns the path."""
    path.write_text("".join(json.dumps({"translation": {"de": de, "en": en}}, ensure_ascii=False) + "\n"
                            for de, en in pairs), encoding="utf-8")
    return str(path)


def listing(folder: Path) -> dict[str, bytes]:
    """Every file under `folder` by relative path, with its bytes: equal listings mean nothing was touched."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def copy_run(run: tuple[Path, dict], tmp_path: Path) -> Path:
    """A copy of a run's folder (conftest's `tiny_run`) in `tmp_path`, for a test that may change it."""
    return Path(shutil.copytree(run[0], tmp_path / "run"))


# The copy task --------------------------------------------------------------------------------------------------------

COPY_VOCAB = 24  # ids 4..23 are "words"
# The copy models' sizes beside TINY: their trained behaviour (and the tolerances measured on it) depends on them.
COPY_TASK = dict(vocab_size=COPY_VOCAB, d_ff=64, dropout=0.0, max_position_embeddings=128)


def copy_batch(generator: torch.Generator, batch: int = 32, min_len: int = 2, max_len: int = 9):
    """Sources of random words + </s>, right-padded, their mask, and labels = the same sentence (the copy task)."""
    lengths = torch.randint(min_len, max_len + 1, (batch,), generator=generator)
    width = int(lengths.max()) + 1
    ids = torch.full((batch, width), PAD, dtype=torch.long)
    for row, length in enumerate(lengths.tolist()):
        ids[row, :length] = torch.randint(4, COPY_VOCAB, (length,), generator=generator)
        ids[row, length] = EOS
    mask = ids.ne(PAD).long()
    labels = ids.masked_fill(ids.eq(PAD), -100)
    return ids, mask, labels


def trained_copy_model(steps: int = 40, seed: int = 0, **overrides) -> VaswaniForConditionalGeneration:
    """A tiny model (`COPY_TASK`, with `overrides`) trained `steps` Adam steps on the copy task, in eval mode: its
    outputs are sentences of varied length that end in </s>, not noise (a few seconds on one CPU core)."""
    torch.manual_seed(seed)
    model = VaswaniForConditionalGeneration(tiny_config(**{**COPY_TASK, **overrides}))
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(steps):
        ids, mask, labels = copy_batch(generator)
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return model.eval()


def copy_sources(seed: int = 1, batch: int = 6, min_len: int = 2, max_len: int = 9):
    """Copy-task sources `(batch, width)` and their mask, for a trained copy model to translate."""
    ids, mask, _ = copy_batch(torch.Generator().manual_seed(seed), batch, min_len, max_len)
    return ids, mask


# Generation -----------------------------------------------------------------------------------------------------------


def without_padding(row: torch.Tensor) -> list[int]:
    """A generated row's tokens, padding left out."""
    return [t for t in row.tolist() if t != PAD]


def sentences_differing_from_greedy(model, out: torch.Tensor, kwargs: dict, **common) -> int | None:
    """For a beam-search call (`kwargs`, its output `out`), how many sentences' best hypothesis differs from greedy
    search's translation with the same inputs and lengths (`common`): a beam test on inputs where beam search returns
    greedy's tokens shows nothing. `None` for calls that are not beam search."""
    if kwargs.get("num_beams", 1) == 1 or kwargs.get("do_sample"):
        return None
    greedy = model.generate(**{**common, "num_beams": 1, "do_sample": False})
    best = out[:: kwargs.get("num_return_sequences", 1)]
    return sum(without_padding(b) != without_padding(g) for b, g in zip(best, greedy, strict=True))


# The commands, called in-process --------------------------------------------------------------------------------------


def exits_with(call, *patterns) -> str:
    """Run a command's main(); it must stop with SystemExit whose message matches every regex pattern. Returns the
    message."""
    with pytest.raises(SystemExit) as error:
        call()
    message = str(error.value.code)
    for pattern in patterns:
        assert re.search(pattern, message), f"{pattern!r} not in {message!r}"
    return message


# A short quiet run of the tiny preset on 120 Multi30k pairs: no evaluation, samples or bf16.
TINY_RUN = ("--preset", "tiny", "--max_train_samples", "120", "--max_test_samples", "2", "--eval_strategy", "no",
            "--length_penalty", "0.6",
            "--num_samples", "0", "--cpu_bf16", "no", "--disable_tqdm", "true", "--report_to", "none")


PLANTED_TOKEN = "hf_PLANTEDsecretTOKEN0123456789abcdef"  # the Hub token of conftest's `tiny_run`: in none of its files


def train_cli(output_dir: Path, cache_dir: Path, *args) -> dict:
    """`vaswani-train` (training/train.py) with `TINY_RUN`, then `args`, into `output_dir`; returns its metrics."""
    from vaswani_training.train import main

    return main([*TINY_RUN, "--output_dir", str(output_dir), "--cache_dir", str(cache_dir), *map(str, args)])


def translate_cli(*args) -> int:
    """`vaswani-translate` (training/translate.py) with `args`; returns its exit code."""
    from vaswani_training.translate import main

    return main([str(a) for a in args])


def evaluate_cli(*args) -> int:
    """`vaswani-evaluate` (training/evaluate_bleu.py) with `args`; returns its exit code."""
    from vaswani_training.evaluate_bleu import main

    return main([str(a) for a in args])


# Subprocesses ---------------------------------------------------------------------------------------------------------


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on (for a launcher's main process)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# Runs first in every `run_without_vaswani_hf` script: a meta-path finder refuses vaswani_hf (and its submodules) even
# where it is installed (`pip install -e .`), and the checkout leaves sys.path.
HIDE_VASWANI_HF = textwrap.dedent(
    """
    import importlib.abc, os, sys

    class _RefuseVaswaniHF(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "vaswani_hf" or name.startswith("vaswani_hf."):
                raise ImportError("vaswani_hf is hidden in this test")

    sys.meta_path.insert(0, _RefuseVaswaniHF())
    # the checkout itself, not the paths below it: CI's virtual environment lives in the checkout's .venv
    sys.path = [p for p in sys.path if p not in ("", ".") and p.rstrip("/") != os.environ["VASWANI_CHECKOUT"]]
    """
)


def run_without_vaswani_hf(script: str, *args: str, cwd: Path, hf_home: Path, timeout: int = 300,
                           **env: str) -> subprocess.CompletedProcess:
    """Run `script` with `args` in `python -I` (no PYTHONPATH, user site or current folder on sys.path) where vaswani_hf
    cannot be imported (`HIDE_VASWANI_HF`), in `cwd`, with stdin closed (a trust_remote_code prompt ends at once),
    one thread, none of the caller's HF_* settings but an empty `hf_home` and HF_HUB_OFFLINE=1, then `env`. It must
    exit 0; returns the completed process."""
    environment = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "HF_"))}
    environment.update(HF_HOME=str(hf_home), HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1",
                       VASWANI_CHECKOUT=str(ROOT).rstrip("/"))
    environment.update(env)
    completed = subprocess.run([sys.executable, "-I", "-c", HIDE_VASWANI_HF + script, *map(str, args)], cwd=cwd,
                               env=environment, capture_output=True, text=True, timeout=timeout,
                               stdin=subprocess.DEVNULL)
    assert completed.returncode == 0, completed.stderr[-3000:]
    return completed


def printed_result(completed: subprocess.CompletedProcess) -> dict:
    """The JSON object a subprocess script printed after "RESULT=" (its last such line)."""
    return json.loads(completed.stdout.split("RESULT=")[-1])


# The first lines of a `remote_code_script` (its first argument: a model folder): they record whether vaswani_hf imports
# and whether each Auto class refuses the folder without trust_remote_code=True, then load `config`, `base`, `model`
# (eval mode) and `tokenizer` from it as remote code.
LOAD_AS_REMOTE_CODE = textwrap.dedent(
    """
    import json, sys

    folder, result = sys.argv[1], {}
    try:
        import vaswani_hf  # noqa: F401
        result["import_vaswani_hf"] = "succeeded"
    except ImportError:
        result["import_vaswani_hf"] = "failed"

    import torch
    from transformers import AutoConfig, AutoModel, AutoModelForSeq2SeqLM, AutoTokenizer

    for name, auto in (("config", AutoConfig), ("model", AutoModel), ("seq2seq", AutoModelForSeq2SeqLM)):
        try:
            auto.from_pretrained(folder)
            result["refused_" + name] = False
        except Exception as error:  # with no terminal to ask, a ValueError asking for trust_remote_code=True
            result["refused_" + name] = "trust_remote_code" in str(error)

    config = AutoConfig.from_pretrained(folder, trust_remote_code=True)
    base = AutoModel.from_pretrained(folder, trust_remote_code=True).eval()
    model = AutoModelForSeq2SeqLM.from_pretrained(folder, trust_remote_code=True).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=True)
    result.update(classes=[type(x).__module__ + "." + type(x).__name__ for x in (config, base, model)],
                  tied=model.lm_head.weight is model.model.shared.weight)
    """
)


def remote_code_script(lines: str) -> str:
    """`LOAD_AS_REMOTE_CODE`, then a test's own `lines` (with `folder`, `config`, `base`, `model`, `tokenizer`, `torch`
    and the dict `result` at hand), then `result` printed (`printed_result`) with the vaswani_hf modules loaded."""
    return LOAD_AS_REMOTE_CODE + textwrap.dedent(lines) + textwrap.dedent(
        """
        result["loaded_modules"] = sorted(m for m in sys.modules if m.startswith("vaswani_hf"))
        print("RESULT=" + json.dumps(result))
        """
    )


def assert_loaded_as_remote_code(result: dict) -> None:
    """What a `remote_code_script` must report: vaswani_hf not importable and not loaded, the folder refused without
    trust_remote_code=True, then loaded from its own code files, with one embedding matrix for encoder, decoder and
    output projection."""
    assert result["import_vaswani_hf"] == "failed" and result["loaded_modules"] == []
    assert result["refused_config"] is result["refused_model"] is result["refused_seq2seq"] is True
    assert all(c.startswith("transformers_modules.") for c in result["classes"]), result["classes"]
    assert [c.rsplit(".", 2)[1:] for c in result["classes"]] == [
        ["configuration_vaswani", "VaswaniConfig"], ["modeling_vaswani", "VaswaniModel"],
        ["modeling_vaswani", "VaswaniForConditionalGeneration"]]
    assert result["tied"] is True


# A small De->En model that has learned something, for tests that compare decoders on real sentences
# (test_marian_reference, test_quantization): an untrained model repeats one token and never ends.
def multi30k_tokenizer():
    """A 2,000-entry joint BPE of the shipped Multi30k train split."""
    from vaswani_hf import train_joint_bpe
    from vaswani_hf.data import multi30k_file

    return train_joint_bpe([multi30k_file("train", "de"), multi30k_file("train", "en")], vocab_size=2000)


def multi30k_batch(tokenizer, german: list[str], english: list[str] | None = None) -> dict[str, torch.Tensor]:
    """Padded source ids and mask; with `english`, labels padded with -100."""
    batch = dict(tokenizer(german, text_target=english, return_tensors="pt", padding=True, truncation=True,
                           max_length=64))
    if english is not None:
        batch["labels"] = batch["labels"].masked_fill(batch["labels"].eq(tokenizer.pad_token_id), -100)
    return batch


def trained_multi30k_model(tokenizer, steps: int) -> VaswaniForConditionalGeneration:
    """fp32, eval mode, d_model 64, 2+2 layers: `steps` Adam steps of 32 Multi30k De->En pairs (loss ~7.6 at the
    start, ~4 after 200 steps, ~3.4 after 300)."""
    from vaswani_hf.data import multi30k_file, read_lines

    german, english = read_lines(multi30k_file("train", "de"))[:4000], read_lines(multi30k_file("train", "en"))[:4000]
    torch.manual_seed(0)
    model = VaswaniForConditionalGeneration(VaswaniConfig(
        vocab_size=len(tokenizer), d_model=64, encoder_layers=2, decoder_layers=2, num_heads=4, d_ff=128,
        dropout=0.0, max_position_embeddings=128)).train()
    optimizer = torch.optim.Adam(model.parameters(), lr=2e-3)
    generator = torch.Generator().manual_seed(0)
    for _ in range(steps):
        rows = torch.randint(0, len(german), (32,), generator=generator).tolist()
        model(**multi30k_batch(tokenizer, [german[i] for i in rows], [english[i] for i in rows])).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return model.eval()
