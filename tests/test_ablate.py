"""`vaswani-ablate` (training/ablate.py): Table 3's rows at tiny size, each a `vaswani-train` process of its own, scored
on the validation split, resumed row by row."""

import json
import math

import pytest
from helpers import TINY_RUN

from vaswani_training.ablate import PAPER_ROWS, ROWS, main, parse_rows, row_command, table_markdown


def test_rows_are_named_and_each_mirrors_a_row_of_the_paper():
    assert parse_rows("E,base") == ["base", "E"]  # the table's order
    assert parse_rows("all") == list(ROWS) and set(PAPER_ROWS) == set(ROWS)
    with pytest.raises(ValueError, match="unknown row.*B1.*choose from base, A1"):
        parse_rows("base,B1")
    command = row_command("A16", __import__("pathlib").Path("out"), 4, ["--seed", "3"])
    assert command[1:3] == ["-m", "vaswani_training.train"]
    assert command[command.index("--config_overrides") + 1] == "num_heads=16"
    assert "--skip_test" in command and command[command.index("--time_budget_minutes") + 1] == "4"
    assert command[-2:] == ["--seed", "3"]
    ls0 = row_command("LS0", __import__("pathlib").Path("out"), 4, [])
    assert ls0[ls0.index("--label_smoothing_factor") + 1] == "0.0" and "--config_overrides" not in ls0


@pytest.mark.parametrize("argv, message", [
    (["--rows", "Z"], "unknown row"), (["--minutes", "0"], "--minutes must be positive"),
    (["--validation_sentences", "0"], "--validation_sentences must be >= 1"),
])
def test_bad_arguments_are_refused_before_any_run(tmp_path, argv, message):
    with pytest.raises(SystemExit, match=message):
        main(["--output_dir", str(tmp_path / "t3"), *argv])
    assert not (tmp_path / "t3").exists() or not any((tmp_path / "t3").iterdir())


def test_two_rows_at_tiny_size_then_a_third_resumes_without_rerunning_them(tmp_path, train_cache, capsys):
    tiny = [argument for argument in TINY_RUN if argument not in ("--max_test_samples", "2")]
    extra = ["--", *tiny, "--max_steps", "3", "--cache_dir", str(train_cache)]
    out = tmp_path / "t3"
    assert main(["--output_dir", str(out), "--rows", "base,LS0", "--minutes", "5", "--validation_sentences", "6",
                 *extra]) == 0
    rows = json.loads((out / "table3.json").read_text())
    assert [row["row"] for row in rows] == ["base", "LS0"]
    for row in rows:
        assert row["train_steps"] == 3 and row["validation_sentences"] == 6
        assert 1.0 < row["validation_ppl"] < 1e6 and math.isfinite(row["validation_ppl"])
        assert 0.0 <= row["validation_bleu"] <= 100.0 and row["validation_length_ratio"] > 0
        metrics = json.loads((out / row["row"] / "metrics.json").read_text())
        assert metrics["test"] == "not translated (--skip_test)" and "test_bleu" not in metrics
    assert json.loads((out / "LS0" / "metrics.json").read_text())["label_smoothing"] == 0.0
    assert json.loads((out / "base" / "metrics.json").read_text())["label_smoothing"] == 0.1
    table = (out / "table3.md").read_text()
    assert "| base | the cpu preset |" in table and "| (D) LS0 | epsilon_ls = 0.0 |" in table
    assert "- LS0: `vaswani-train --output_dir" in table and (out / "table3.png").stat().st_size > 5_000
    stamps = {name: (out / name / "table3_row.json").stat().st_mtime_ns for name in ("base", "LS0")}
    capsys.readouterr()
    assert main(["--output_dir", str(out), "--rows", "base,LS0,E", "--minutes", "5", "--validation_sentences", "6",
                 *extra]) == 0
    printed = capsys.readouterr().out
    assert "row base: done earlier" in printed and "row LS0: done earlier" in printed and "row E: 3 steps" in printed
    assert {name: (out / name / "table3_row.json").stat().st_mtime_ns for name in ("base", "LS0")} == stamps
    config = json.loads((out / "E" / "config.json").read_text())
    assert config["position_embedding_type"] == "learned"
    assert [row["row"] for row in json.loads((out / "table3.json").read_text())] == ["base", "LS0", "E"]


def test_a_failed_row_names_its_log_and_writes_no_result(tmp_path):
    out = tmp_path / "t3"
    with pytest.raises(SystemExit, match=r"row base: vaswani-train exited with status \d+; see .*base\.log"):
        main(["--output_dir", str(out), "--rows", "base", "--", "--no_such_flag"])
    assert not (out / "base" / "table3_row.json").exists() and not (out / "table3.json").exists()


def test_the_table_sets_each_row_beside_the_papers():
    row = {"row": "A1", "group": "A", "change": "1 head", "parameters": 7_000_000, "train_steps": 500,
           "validation_ppl": 9.5, "validation_bleu": 20.25, "validation_length_ratio": 0.97, "command": "vaswani-train"}
    expected = "| (A) A1 | 1 head | 7,000,000 | 500 | 9.50 | 20.25 | 0.970 | h 1, d_k 512 | 5.29 | 24.9 |"
    assert expected in table_markdown([row])
