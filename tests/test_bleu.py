"""Tests for vaswani_hf.bleu and the local sacreBLEU evaluate module (offline)."""

import json
import math
import os
import subprocess
import sys
from collections import Counter

import pytest
import sacrebleu
from helpers import evaluate_cli, write

from vaswani_hf.bleu import (
    SACREBLEU_LOCAL_PATH,
    compute_bleu,
    load_bleu_metric,
    moses_lc_tokenize,
    paper_bleu,
    paper_tokenize,
)
from vaswani_hf.data import multi30k_file, read_lines

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
    assert out["tok_signature"].startswith("lc+moses-norm+moses-tok(en)|multi-bleu|nrefs:1|case:lc|")
    assert out["paper_bleu"] == pytest.approx(100.0)
    assert out["paper_signature"] == (f"moses-tok(en)|multi-bleu|nrefs:1|case:mixed|eff:no|tok:none|smooth:none|"
                                      f"version:{sacrebleu.__version__}")


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
    with pytest.raises(ValueError, match="2 hypotheses but 1 references"):
        paper_bleu(HYPS, ["only one"], target_lang="de")
    for lang in ("", "de en", "../de", 7):
        with pytest.raises(ValueError, match="target_lang must be a language code"):
            paper_bleu(HYPS, HYPS, target_lang=lang)
    assert set(compute_bleu(HYPS, REFS, with_paper_bleu=False)) == {
        "bleu", "signature", "counts", "totals", "precisions", "bp", "sys_len", "ref_len"}


# The paper's BLEU (tensor2tensor's get_ende_bleu.sh) ------------------------------------------------------------------

DE_REFS = ["Die US-amerikanische Mannschaft isst Rot-Weiß-Essen.", "Ein Hund läuft."]
DE_HYPS = ["Die amerikanische Mannschaft isst Rot-Weiß-Essen.", "Ein Hund rennt."]
AT = "##AT##-##AT##"


def by_hand(counts, totals, sys_len, ref_len) -> float:
    """multi-bleu.perl's formula: geometric mean of the 4 clipped precisions times the brevity penalty."""
    bp = 1.0 if sys_len >= ref_len else math.exp(1 - ref_len / sys_len)
    return 100 * bp * math.exp(sum(math.log(c / t) for c, t in zip(counts, totals)) / 4)


def multi_bleu(hyp_lines: list[str], ref_lines: list[str]) -> float:
    """multi-bleu.perl with one reference, written out: whitespace tokens, clipped n-gram counts, no smoothing."""
    matched, total, sys_len, ref_len = [0] * 4, [0] * 4, 0, 0
    for hyp, ref in zip(hyp_lines, ref_lines, strict=True):
        h, r = hyp.split(), ref.split()
        sys_len, ref_len = sys_len + len(h), ref_len + len(r)
        for n in range(1, 5):
            hc = Counter(tuple(h[i:i + n]) for i in range(len(h) - n + 1))
            rc = Counter(tuple(r[i:i + n]) for i in range(len(r) - n + 1))
            total[n - 1] += sum(hc.values())
            matched[n - 1] += sum(min(k, rc[g]) for g, k in hc.items())
    return 0.0 if 0 in matched else by_hand(matched, total, sys_len, ref_len)


def test_compound_splitting_as_get_ende_bleu_sh():
    assert paper_tokenize(DE_REFS, "de") == [
        f"Die US {AT} amerikanische Mannschaft isst Rot {AT} Weiß {AT} Essen .", "Ein Hund läuft ."]
    assert paper_tokenize(DE_REFS, "de", compound_splitting=False) == [
        "Die US-amerikanische Mannschaft isst Rot-Weiß-Essen .", "Ein Hund läuft ."]
    # perl's s{(\S)-(\S)}{...}g does not overlap its matches: a one-letter middle part keeps its second hyphen
    # (checked with perl 5); a hyphen with a space on either side stays, also one Moses put a space before.
    assert paper_tokenize(['a-b-c -x x- E-Mail-Adresse "Ja"-Wort'], "de") == [
        f"a {AT} b-c -x x- E {AT} Mail {AT} Adresse &quot; Ja &quot; -Wort"]


def test_paper_bleu_splits_german_compounds_by_hand():
    # Split: hyp 1 "Die amerikanische Mannschaft isst Rot @ Weiß @ Essen ." (10 tokens, @ = ##AT##-##AT##) against
    # "Die US @ amerikanische Mannschaft isst Rot @ Weiß @ Essen ." (12): every unigram matches (10/10), every
    # n-gram but the one starting at "Die" (8/9, 7/8, 6/7). Hyp 2 "Ein Hund rennt ." against "Ein Hund läuft .":
    # 3/4, 1/3 ("Ein Hund"), 0/2, 0/1. Lengths 14 against 16.
    out = paper_bleu(DE_HYPS, DE_REFS, target_lang="de")
    assert (out["counts"], out["totals"], out["sys_len"], out["ref_len"]) == ([13, 9, 7, 6], [14, 12, 10, 8], 14, 16)
    assert out["bp"] == pytest.approx(math.exp(-1 / 7))
    assert out["bleu"] == pytest.approx(by_hand([13, 9, 7, 6], [14, 12, 10, 8], 14, 16)) == pytest.approx(67.4088475)
    assert out["signature"] == (f"moses-tok(de)+compound-split(##AT##)|multi-bleu|nrefs:1|case:mixed|eff:no|"
                                f"tok:none|smooth:none|version:{sacrebleu.__version__}")
    # Unsplit: "US-amerikanische" and "Rot-Weiß-Essen" are single tokens; hyp 1 matches 5/6, 3/5, 2/4, 1/3 of its
    # n-grams; 10 tokens against 10, no brevity penalty.
    plain = paper_bleu(DE_HYPS, DE_REFS, target_lang="de", compound_splitting=False)
    assert (plain["counts"], plain["totals"], plain["bp"]) == ([8, 4, 2, 1], [10, 8, 6, 4], 1.0)
    assert plain["bleu"] == pytest.approx(by_hand([8, 4, 2, 1], [10, 8, 6, 4], 10, 10)) == pytest.approx(42.7287006)
    assert plain["signature"].startswith("moses-tok(de)|multi-bleu|nrefs:1|case:mixed|")
    # compute_bleu gives the split form for a German target; "de-AT" is German too
    scores = compute_bleu(DE_HYPS, DE_REFS, target_lang="de")
    assert scores["paper_bleu"] == out["bleu"] and scores["paper_signature"] == out["signature"]
    assert scores["bleu"] == pytest.approx(plain["bleu"])  # sacreBLEU's 13a splits no hyphen between letters either
    assert paper_bleu(DE_HYPS, DE_REFS, target_lang="de-AT")["bleu"] == out["bleu"]


def test_paper_bleu_is_case_sensitive():
    # "die" no longer matches "Die": one unigram fewer; the n-grams from "Die" matched nothing anyway.
    hyps = ["die" + DE_HYPS[0][3:], DE_HYPS[1]]
    assert paper_bleu(hyps, DE_REFS, target_lang="de")["bleu"] == pytest.approx(
        by_hand([12, 9, 7, 6], [14, 12, 10, 8], 14, 16))
    lowered = paper_bleu([h.lower() for h in DE_HYPS], DE_REFS, target_lang="de")["bleu"]
    assert lowered < 40.0 < paper_bleu(DE_HYPS, DE_REFS, target_lang="de")["bleu"]


def test_paper_bleu_french_is_plain_tokenized_by_hand():
    # Moses -l fr splits the elided article ("L&apos; homme") and keeps "Saint-Denis" whole: 6 tokens each side;
    # the hypothesis matches 5/6, 3/5, 2/4, 1/3 of its n-grams.
    hyps, refs = ["L'homme arrive à Paris."], ["L'homme arrive à Saint-Denis."]
    assert paper_tokenize(refs, "fr") == ["L&apos; homme arrive à Saint-Denis ."]
    out = paper_bleu(hyps, refs, target_lang="fr")
    assert (out["counts"], out["totals"]) == ([5, 3, 2, 1], [6, 5, 4, 3])
    assert out["bleu"] == pytest.approx(by_hand([5, 3, 2, 1], [6, 5, 4, 3], 6, 6)) == pytest.approx(53.7284966)
    assert out["signature"].startswith("moses-tok(fr)|multi-bleu|") and "compound" not in out["signature"]
    # split on request, the reference gains two tokens (the hypothesis has no compound): a brevity penalty
    split = paper_bleu(hyps, refs, target_lang="fr", compound_splitting=True)
    assert (split["ref_len"], split["bp"]) == (8, pytest.approx(math.exp(1 - 8 / 6)))


def test_paper_bleu_equals_multi_bleu_on_pre_tokenized_multi30k():
    refs = read_lines(multi30k_file("test", "de"))
    hyps = [" ".join(w for j, w in enumerate(r.split()) if j % 4 != 3) for r in refs]
    hyps = [h[:1].swapcase() + h[1:] for h in hyps]
    out = paper_bleu(hyps, refs, target_lang="de")
    tok_hyps, tok_refs = paper_tokenize(hyps, "de"), paper_tokenize(refs, "de")
    assert sum(line.count(AT) for line in tok_refs) >= 60  # test2016 has 61 German lines with a hyphenated word
    assert out["bleu"] == pytest.approx(multi_bleu(tok_hyps, tok_refs), abs=1e-9)
    assert out["bleu"] == pytest.approx(sacrebleu.corpus_bleu(tok_hyps, [tok_refs], tokenize="none",
                                                              smooth_method="none", force=True).score, abs=1e-9)
    plain = paper_bleu(hyps, refs, target_lang="de", compound_splitting=False)["bleu"]
    assert 20 < plain < 90 and out["bleu"] != pytest.approx(plain, abs=0.01)
    # several references per segment: multi-bleu's closest reference length, clipping by the most frequent
    multi = compute_bleu(HYPS, REFS, target_lang="en")
    assert multi["paper_signature"].startswith("moses-tok(en)|multi-bleu|nrefs:2|case:mixed|")
    assert multi["paper_bleu"] == pytest.approx(multi["bleu"])  # no punctuation to tokenize differently


def test_evaluate_command_prints_and_writes_the_papers_bleu(model_folder, tmp_path, capsys, monkeypatch):
    import vaswani_hf.decoding.translate

    prefix = tmp_path / "test"
    write(prefix.with_suffix(".en"), "The US team eats red-and-white food.\nA dog runs.\n")
    write(prefix.with_suffix(".de"), "\n".join(DE_REFS) + "\n")
    monkeypatch.setattr(vaswani_hf.decoding.translate, "translate_sentences", lambda *args, **kwargs: list(DE_HYPS))
    output = tmp_path / "scores.json"
    assert evaluate_cli("--model", model_folder, "--test_file", prefix, "--source_lang", "en", "--target_lang", "de",
                        "--output", output) == 0
    scores = json.loads(output.read_text())
    assert scores["test_paper_bleu"] == 67.41 and scores["test_bleu"] == 42.73  # the values by hand above
    assert scores["test_paper_bleu_signature"].startswith("moses-tok(de)+compound-split(##AT##)|multi-bleu|nrefs:1|")
    printed = capsys.readouterr().out
    assert "test_paper_bleu: 67.41\n" in printed
    assert f"test_paper_bleu_signature: {scores['test_paper_bleu_signature']}\n" in printed


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
