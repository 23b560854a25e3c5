"""Tests for vaswani_hf.bleu and the local sacreBLEU evaluate module (offline)."""

import json
import os
import subprocess
import sys

import pytest
import sacrebleu

from vaswani_hf.bleu import compute_bleu, load_bleu_metric, moses_lc_tokenize
from vaswani_hf.data import multi30k_file, read_lines
from vaswani_hf.metrics import SACREBLEU_LOCAL_PATH

HYPS = ["hello there general kenobi", "on our way to ankh morpork"]
REFS = [["hello there general kenobi", "hello there !"], ["goodbye ankh morpork", "ankh morpork"]]


@pytest.fixture(scope="module")
def test_refs():
    return read_lines(multi30k_file("test", "en"))


@pytest.fixture(scope="module")
def test_tok_refs():
    return read_lines(multi30k_file("test", "en", tokenized_lowercased=True))


def test_references_against_themselves_is_100(test_refs):
    out = compute_bleu(test_refs, test_refs, multi30k_file("test", "en", tokenized_lowercased=True))
    assert out["bleu"] == pytest.approx(100.0)
    # raw references through lowercase+Moses normalize+tokenize reproduce the official tok/ files exactly
    assert out["tok_bleu"] == pytest.approx(100.0)
    assert out["signature"] == f"nrefs:1|case:mixed|eff:no|tok:13a|smooth:exp|version:{sacrebleu.__version__}"
    assert out["tok_signature"].startswith("lc+moses-norm+moses-tok(en)|multi-bleu|nrefs:1|")


def test_moses_pipeline_matches_official_tok_files(test_refs, test_tok_refs):
    assert moses_lc_tokenize(test_refs[:200], "en") == test_tok_refs[:200]
    de = read_lines(multi30k_file("test", "de"))[:200]
    assert moses_lc_tokenize(de, "de") == read_lines(multi30k_file("test", "de", tokenized_lowercased=True))[:200]


def test_known_hypothesis_equals_sacrebleu(test_refs, test_tok_refs):
    # a degraded system: drop every 4th word, swap case of the first word
    hyps = [" ".join(w for j, w in enumerate(r.split()) if j % 4 != 3) for r in test_refs]
    hyps = [h[:1].swapcase() + h[1:] for h in hyps]
    out = compute_bleu(hyps, test_refs, test_tok_refs)
    expected = sacrebleu.corpus_bleu(hyps, [test_refs])
    assert out["bleu"] == pytest.approx(expected.score, abs=1e-9)
    assert 20 < out["bleu"] < 90 and out["counts"] == expected.counts and out["bp"] == pytest.approx(expected.bp)
    tok_expected = sacrebleu.corpus_bleu(
        moses_lc_tokenize(hyps, "en"), [test_tok_refs], tokenize="none", smooth_method="none", force=True
    )
    assert out["tok_bleu"] == pytest.approx(tok_expected.score, abs=1e-9)
    assert out["tok_bleu"] > out["bleu"]  # lowercasing forgives the case errors
    approx = compute_bleu(hyps, None, test_tok_refs, tokenized_method="13a")
    assert set(approx) == {"tok_bleu", "tok_signature"} and approx["tok_signature"].startswith("approx:")
    assert abs(approx["tok_bleu"] - out["tok_bleu"]) < 2.0


def test_multi_reference_and_file_refs(tmp_path):
    out = compute_bleu(HYPS, REFS)
    assert out["bleu"] == pytest.approx(39.76353643835252)  # the number in evaluate's sacrebleu docs (39.8)
    assert out["signature"].startswith("nrefs:2|")
    p = tmp_path / "ref.en"
    p.write_text("hello there general kenobi\ngoodbye ankh morpork\n", encoding="utf-8")
    assert compute_bleu(HYPS, p)["bleu"] == pytest.approx(sacrebleu.corpus_bleu(HYPS, [[r[0] for r in REFS]]).score)


def test_errors():
    with pytest.raises(ValueError, match="2 hypotheses but 1 references"):
        compute_bleu(HYPS, ["only one"])
    with pytest.raises(ValueError, match="not a single string"):
        compute_bleu("hello", ["hello"])
    with pytest.raises(ValueError, match=r"hypotheses\[1\] must be a str.*batch_decode"):
        compute_bleu(["a", [1, 2]], ["a", "b"])
    with pytest.raises(ValueError, match="and/or"):
        compute_bleu(HYPS)
    with pytest.raises(ValueError, match=r"references\[1\] must be a list of 2 strings"):
        compute_bleu(HYPS, [["a", "b"], ["c"]])
    with pytest.raises(ValueError, match="is not a file"):
        compute_bleu(HYPS, "no/such/file.en")
    with pytest.raises(ValueError, match="tokenized_method"):
        compute_bleu(HYPS, None, ["a", "b"], tokenized_method="multi-bleu")


def test_local_evaluate_metric_in_process():
    metric = load_bleu_metric(keep_in_memory=True)
    res = metric.compute(predictions=HYPS, references=REFS)
    assert res["score"] == pytest.approx(39.76353643835252)
    assert res["signature"].startswith("nrefs:2|case:mixed|eff:no|tok:13a")
    assert metric.compute(predictions=["a b c d"], references=["a b c d"])["score"] == pytest.approx(100.0)
    with pytest.raises(ValueError, match="same number of references"):
        metric.compute(predictions=HYPS, references=[["a", "b"], ["c"]])


def test_local_evaluate_metric_offline_subprocess(tmp_path):
    """evaluate.load(<folder>) with the Hub switched off and a fresh HF cache (nothing pre-downloaded)."""
    code = (
        "import evaluate, json, sys\n"
        f"m = evaluate.load({str(SACREBLEU_LOCAL_PATH)!r})\n"
        f"print(json.dumps(m.compute(predictions={HYPS!r}, references={REFS!r})))\n"
    )
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", HF_EVALUATE_OFFLINE="1",
               HF_HOME=str(tmp_path / "hf"), HF_DATASETS_CACHE=str(tmp_path / "hf" / "datasets"))
    r = subprocess.run([sys.executable, "-c", code], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert res["score"] == pytest.approx(39.76353643835252)
