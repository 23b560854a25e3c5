"""Publishing (training/publish.py, model_card.md): the Hub-ready folder holds exactly the Hub files, loads as
remote code where vaswani_hf cannot be imported and translates as the original; uploads (from training with
--push_to_hub, and from `vaswani-publish --push_to_hub`) go to a stand-in for the Hub on 127.0.0.1 that keeps the
Hub's rules (tests/hub_standin.py: weights through LFS, existing repositories, pull requests, private repositories,
failures midway, downloads by repo id); the real Hub is never contacted."""

import hashlib
import json
import os
import re
import shutil
import stat
import textwrap
from pathlib import Path

import pytest
import torch
import yaml
from helpers import (
    ROOT,
    assert_loaded_as_remote_code,
    copy_run,
    exits_with,
    listing,
    printed_result,
    remote_code_script,
    run_without_vaswani_hf,
    tiny_model,
    write_parallel,
)
from hub_standin import StandInHub
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import AutoModelForSeq2SeqLM

import vaswani_hf
from vaswani_hf import VaswaniForConditionalGeneration
from vaswani_hf.checks import CheckError
from vaswani_training.lib.publishing import HUB_CODE_FILES, push_folder, write_hub_folder
from vaswani_training.publish import main as publish_main

HUB_FILES = {"README.md", "config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
             "tokenizer_config.json", *HUB_CODE_FILES}
SENTENCES = ["Ein Mann fährt mit dem Fahrrad.", "Zwei Hunde spielen im Schnee vor einem Haus."]


@pytest.fixture(scope="module")
def hub():
    import huggingface_hub.constants

    server = StandInHub()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)  # CI sets HF_HUB_OFFLINE=1
        # The stand-in serves LFS, not hf_xet's storage protocol: uploads take huggingface_hub's path without hf_xet.
        patch.setattr(huggingface_hub.constants, "HF_HUB_DISABLE_XET", True)
        patch.setenv("NO_PROXY", "127.0.0.1")
        patch.setenv("HF_ENDPOINT", server.url)
        yield server
    server.close()


@pytest.fixture(scope="module")
def trained(tmp_path_factory, hub):
    """A tiny run on the shipped Multi30k that ends with --push_to_hub (to the stand-in)."""
    from vaswani_training.train import main

    out = tmp_path_factory.mktemp("run")
    main(["--preset", "tiny", "--output_dir", str(out), "--cache_dir", str(tmp_path_factory.mktemp("cache")),
          "--max_train_samples", "200", "--max_test_samples", "4", "--max_steps", "2", "--eval_strategy", "no",
          "--num_samples", "0", "--cpu_bf16", "no", "--disable_tqdm", "true", "--report_to", "none",
          "--length_penalty", "0.6", "--push_to_hub", "--hub_model_id", "someone/vaswani-tiny", "--hub_token",
          "hf_stand_in_token"])
    return out


@pytest.fixture(scope="module")
def published(trained, tmp_path_factory):
    folder = tmp_path_factory.mktemp("publish") / "vaswani-tiny"
    assert publish_main(["--model_dir", str(trained), "--output_dir", str(folder),
                        "--hub_model_id", "someone/vaswani-tiny"]) == 0
    return folder


def front_matter(readme: str) -> dict:
    assert readme.startswith("---\n")
    return yaml.safe_load(readme.split("---")[1])


def test_the_folder_holds_exactly_the_hub_files(published, trained):
    assert {p.name for p in published.iterdir()} == HUB_FILES
    package = Path(vaswani_hf.__file__).parent
    for name in HUB_CODE_FILES:
        assert (published / name).read_text() == (package / name).read_text()
    config = json.loads((published / "config.json").read_text())
    assert config["auto_map"] == {"AutoConfig": "configuration_vaswani.VaswaniConfig",
                                  "AutoModel": "modeling_vaswani.VaswaniModel",
                                  "AutoModelForSeq2SeqLM": "modeling_vaswani.VaswaniForConditionalGeneration"}
    with safe_open(str(published / "model.safetensors"), framework="pt") as weights:
        shapes = {key: weights.get_slice(key).get_shape() for key in weights.keys()}
    embeddings = [key for key, shape in shapes.items() if shape == [config["vocab_size"], config["d_model"]]]
    assert len(embeddings) == 1, f"one shared embedding tensor, found {embeddings}"
    generation = json.loads((published / "generation_config.json").read_text())
    assert generation["num_beams"] == 4 and generation["length_penalty"] == 0.6
    assert not list(published.parent.glob(".*tmp*")), "no temporary folder left"


def test_model_card_carries_the_runs_metrics_and_usage(published, trained):
    metrics = json.loads((trained / "metrics.json").read_text())
    readme = (published / "README.md").read_text(encoding="utf-8")
    meta = front_matter(readme)
    assert meta["language"] == ["de", "en"] and meta["datasets"] == ["multi30k"] and meta["metrics"] == ["bleu"]
    assert meta["license"] == "other" and meta["license_link"] == "https://github.com/multi30k/dataset"
    assert {"translation", "transformer", "vaswani"} <= set(meta["tags"])
    assert meta["pipeline_tag"] == "translation" and meta["library_name"] == "transformers"
    (entry,) = meta["model-index"]
    assert entry["name"] == "vaswani-tiny"
    (result,) = entry["results"]
    assert result["task"]["type"] == "translation" and result["dataset"]["split"] == "test"
    values = {m["name"]: (m["value"], m["config"]) for m in result["metrics"]}
    assert values == {"SacreBLEU (detokenized)": (metrics["test_bleu"], metrics["test_bleu_signature"]),
                      "BLEU (lowercased, tokenized references)": (metrics["test_tok_bleu"],
                                                                  metrics["test_tok_bleu_signature"])}
    assert 'repo = "someone/vaswani-tiny"' in readme and "trust_remote_code=True" in readme
    assert f"**{metrics['test_bleu']}**" in readme and metrics["test_bleu_signature"] in readme
    assert "non-commercial research and educational use" in readme and "elliott-etal-2016-multi30k" in readme
    assert "vaswani2017attention" in readme and 'pipeline("translation")' in readme


# Run by `run_without_vaswani_hf` from the folder's parent; then it runs the usage snippet of the README.
REMOTE_SCRIPT = remote_code_script(
    """
    sentences = json.loads(sys.argv[2])
    batch = tokenizer(sentences, return_tensors="pt", padding=True)
    with torch.no_grad():
        ids = model.generate(**batch, max_new_tokens=batch["input_ids"].shape[1] + 50)
    result.update(ids=ids.tolist(), tokenizer_class=type(tokenizer).__name__)
    snippet = open(folder + "/README.md", encoding="utf-8").read().split("```python")[1].split("```")[0]
    snippet = snippet.replace('repo = "someone/vaswani-tiny"', "repo = " + repr(folder))
    print("SNIPPET=", end="")
    exec(compile(snippet, "README.md", "exec"), {})
    """
)


def test_the_folder_loads_as_remote_code_and_translates_as_the_original(published, trained, tmp_path):
    from transformers import AutoTokenizer


    original = VaswaniForConditionalGeneration.from_pretrained(trained).eval()
    tokenizer = AutoTokenizer.from_pretrained(trained)
    batch = tokenizer(SENTENCES, return_tensors="pt", padding=True)
    with torch.no_grad():
        expected = original.generate(**batch, max_new_tokens=batch["input_ids"].shape[1] + 50)
    example = tokenizer(["Zwei Hunde spielen im Schnee."], return_tensors="pt")
    with torch.no_grad():
        example_ids = original.generate(**example, max_new_tokens=example["input_ids"].shape[1] + 50)

    completed = run_without_vaswani_hf(REMOTE_SCRIPT, published, json.dumps(SENTENCES), cwd=published.parent,
                                       hf_home=tmp_path / "hf_home", timeout=600)
    result = printed_result(completed)
    assert_loaded_as_remote_code(result)
    assert result["ids"] == expected.tolist()
    printed = completed.stdout.split("SNIPPET=")[1].split("RESULT=")[0].strip()
    assert printed == str(tokenizer.batch_decode(example_ids, skip_special_tokens=True))


# Loads by repo id through the stand-in, run by `run_without_vaswani_hf` as above, with an empty cache.
REMOTE_REPO_SCRIPT = textwrap.dedent(
    """
    import json, sys

    repo, sentences = sys.argv[1], json.loads(sys.argv[2])
    import torch
    from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

    model = AutoModelForSeq2SeqLM.from_pretrained(repo, trust_remote_code=True).eval()
    tokenizer = AutoTokenizer.from_pretrained(repo)
    batch = tokenizer(sentences, return_tensors="pt", padding=True)
    with torch.no_grad():
        ids = model.generate(**batch, max_new_tokens=batch["input_ids"].shape[1] + 50)
    print("RESULT=" + json.dumps({"ids": ids.tolist(), "class": type(model).__module__ + "." + type(model).__name__,
                                  "vaswani_hf": sorted(m for m in sys.modules if m.startswith("vaswani_hf"))}))
    """
)


def test_remote_code_loads_by_repo_id_through_the_hub(trained, hub, tmp_path):
    from transformers import AutoTokenizer


    repo_id = "someone/vaswani-tiny"  # pushed by the training run
    original = VaswaniForConditionalGeneration.from_pretrained(trained).eval()
    batch = AutoTokenizer.from_pretrained(trained)(SENTENCES, return_tensors="pt", padding=True)
    with torch.no_grad():
        expected = original.generate(**batch, max_new_tokens=batch["input_ids"].shape[1] + 50)

    start = len(hub.requests)
    completed = run_without_vaswani_hf(REMOTE_REPO_SCRIPT, repo_id, json.dumps(SENTENCES), cwd=tmp_path,
                                       hf_home=tmp_path / "hf_home", timeout=600, HF_ENDPOINT=hub.url,
                                       HF_HUB_CACHE=str(tmp_path / "hub_cache"), HF_HUB_OFFLINE="0")
    result = printed_result(completed)
    assert result["vaswani_hf"] == [] and result["class"].startswith("transformers_modules.")
    assert result["class"].endswith("modeling_vaswani.VaswaniForConditionalGeneration")
    assert result["ids"] == expected.tolist()
    served = [(server, method, path) for server, method, path, _ in hub.requests[start:]]
    head = hub.repos[repo_id].refs["main"]
    resolved = {path.rsplit("/", 1)[1] for server, _, path in served
                if server == "hub" and re.fullmatch(rf"/{repo_id}/resolve/(main|{head})/[^/]+", path)}
    assert {"config.json", "model.safetensors", "tokenizer.json", *HUB_CODE_FILES} <= resolved
    assert ("storage", "GET", f"/{sha256(trained / 'hub' / 'model.safetensors')}") in served, "weights from storage"
    assert not hub.unexpected


def test_translation_pipeline_with_vaswani_hf_imported(published):
    """In a process that imported vaswani_hf (which registers the task transformers 5 removed)."""
    from transformers import AutoTokenizer, pipeline

    model = AutoModelForSeq2SeqLM.from_pretrained(published).eval()
    tokenizer = AutoTokenizer.from_pretrained(published)
    assert type(model).__module__ == "vaswani_hf.modeling_vaswani"
    translator = pipeline("translation", model=model, tokenizer=tokenizer)
    batch = tokenizer(SENTENCES[:1], return_tensors="pt")
    with torch.no_grad():
        ids = model.generate(**batch, max_new_tokens=12)
    assert translator(SENTENCES[0], max_new_tokens=12)[0]["translation_text"] == tokenizer.decode(
        ids[0], skip_special_tokens=True).strip()


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def hub_tree(folder: Path) -> dict[str, bytes]:
    """What a repository holds after `folder` is pushed to it: its files and the Hub's initial .gitattributes."""
    from hub_standin import GITATTRIBUTES

    return {".gitattributes": GITATTRIBUTES, **{p.name: p.read_bytes() for p in folder.iterdir()}}


def test_training_push_uploads_the_weights_through_lfs(trained, hub):
    folder = trained / "hub"
    assert {p.name for p in folder.iterdir()} == HUB_FILES
    assert {"name": "vaswani-tiny", "organization": "someone"}.items() <= hub.created[0].items()
    assert hub.repos["someone/vaswani-tiny"].private is False
    (commit,) = [c for c in hub.commits if c["repo_id"] == "someone/vaswani-tiny"]
    assert commit["revision"] == "main" and commit["pr"] is None
    assert commit["files"] == {p.name: p.read_bytes() for p in folder.iterdir()}
    assert commit["lfs"] == {"model.safetensors"}, "the weights travel as an LFS pointer, not inside the commit"
    assert hub.tree("someone/vaswani-tiny") == hub_tree(folder)
    oid = sha256(folder / "model.safetensors")
    assert hashlib.sha256(hub.objects[oid]).hexdigest() == oid
    push = hub.requests[:next(i for i, r in enumerate(hub.requests) if "/commit/" in r[2]) + 1]
    steps = [(server, method, path.split("?")[0]) for server, method, path, _ in push]
    assert steps.index(("hub", "POST", "/api/validate-yaml")) < steps.index(
        ("hub", "POST", "/api/models/someone/vaswani-tiny/preupload/main")), "the card's YAML checked first"
    assert [step for step in steps if step[2] != "/api/validate-yaml"] == [
        ("hub", "POST", "/api/repos/create"), ("hub", "POST", "/api/models/someone/vaswani-tiny/preupload/main"),
        ("hub", "POST", "/someone/vaswani-tiny.git/info/lfs/objects/batch"), ("storage", "PUT", f"/upload/{oid}"),
        ("hub", "POST", "/someone/vaswani-tiny.git/info/lfs/objects/verify"),
        ("hub", "POST", "/api/models/someone/vaswani-tiny/commit/main")]
    assert {auth for server, _, _, auth in push if server == "hub"} == {"Bearer hf_stand_in_token"}
    assert [auth for server, _, _, auth in push if server == "storage"] == [None], "no token sent to the storage"
    readme = commit["files"]["README.md"].decode()
    assert front_matter(readme)["model-index"][0]["results"][0]["metrics"][0]["value"] == json.loads(
        (trained / "metrics.json").read_text())["test_bleu"]


def test_the_command_pushes_to_the_given_endpoint(published, trained, tmp_path, hub, monkeypatch):
    monkeypatch.delenv("HF_ENDPOINT")
    folder = tmp_path / "again"
    assert publish_main(["--model_dir", str(trained), "--output_dir", str(folder), "--push_to_hub",
                        "--hub_model_id", "another/name", "--hub_endpoint", hub.url, "--hub_token", "hf_x"]) == 0
    commit = hub.commits[-1]
    assert commit["repo_id"] == "another/name" and set(commit["files"]) == HUB_FILES
    assert commit["lfs"] == {"model.safetensors"}
    assert hub.tree("another/name") == hub_tree(folder)
    assert sha256(published / "model.safetensors") in hub.objects
    assert hub.created[-1]["name"] == "name" and hub.created[-1]["organization"] == "another"
    assert 'repo = "another/name"' in commit["files"]["README.md"].decode()


def test_pushing_to_an_existing_repository_sends_only_what_changed(published, tmp_path, hub):
    from huggingface_hub import HfApi
    from huggingface_hub.errors import HfHubHTTPError

    repo_id, folder = "someone/existing", tmp_path / "folder"
    shutil.copytree(published, folder)
    first = push_folder(folder, repo_id, token="hf_x")
    created, commits = len(hub.created), len(hub.commits)
    puts = sum(r[1] == "PUT" for r in hub.requests)
    assert push_folder(folder, repo_id, token="hf_x") == first, "nothing changed: no commit, the head's URL"
    assert len(hub.commits) == commits and len(hub.created) == created
    with pytest.raises(HfHubHTTPError) as refused:
        HfApi(endpoint=hub.url, token="hf_x").create_repo(repo_id, exist_ok=False)
    assert refused.value.response.status_code == 409
    readme = (folder / "README.md").read_text(encoding="utf-8")
    (folder / "README.md").write_text(readme.replace("trained from scratch", "trained from nothing"), encoding="utf-8")
    second = push_folder(folder, repo_id, token="hf_x")
    assert second != first and hub.commits[-1]["files"].keys() == {"README.md"}, "unchanged files are not sent"
    assert sum(r[1] == "PUT" for r in hub.requests) == puts, "the weights are not uploaded again"
    assert hub.tree(repo_id) == hub_tree(folder)


def test_a_pull_request_commits_to_its_own_ref(published, tmp_path, hub):
    from huggingface_hub import HfApi, hf_hub_download

    repo_id, folder = "someone/reviewed", tmp_path / "folder"
    shutil.copytree(published, folder)
    push_folder(folder, repo_id, token="hf_x")
    (folder / "README.md").write_text("---\nlicense: mit\n---\nProposed card.\n", encoding="utf-8")
    commit = HfApi(endpoint=hub.url, token="hf_x").upload_folder(repo_id=repo_id, folder_path=str(folder),
                                                                 create_pr=True, commit_message="Propose a card")
    assert commit.pr_url == f"{hub.url}/{repo_id}/discussions/1" and commit.pr_revision == "refs/pr/1"
    assert hub.commits[-1]["revision"] == "refs/pr/1" and hub.commits[-1]["files"].keys() == {"README.md"}
    assert hub.tree(repo_id)["README.md"] == (published / "README.md").read_bytes(), "main is unchanged"
    proposed = hf_hub_download(repo_id, "README.md", revision="refs/pr/1", endpoint=hub.url,
                               cache_dir=tmp_path / "cache", token="hf_x")
    assert Path(proposed).read_text(encoding="utf-8") == "---\nlicense: mit\n---\nProposed card.\n"


def test_a_private_repository_answers_its_owner_only(published, trained, tmp_path, hub):
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import RepositoryNotFoundError

    assert publish_main(["--model_dir", str(trained), "--output_dir", str(tmp_path / "private"), "--push_to_hub",
                        "--hub_model_id", "someone/private", "--hub_private_repo", "--hub_token", "hf_owner"]) == 0
    assert hub.created[-1]["visibility"] == "private" and hub.repos["someone/private"].private is True
    for token in (False, "hf_someone_else"):
        with pytest.raises(RepositoryNotFoundError):
            hf_hub_download("someone/private", "config.json", endpoint=hub.url, cache_dir=tmp_path / "c", token=token)
    weights = hf_hub_download("someone/private", "model.safetensors", endpoint=hub.url, cache_dir=tmp_path / "c",
                              token="hf_owner")
    assert sha256(Path(weights)) == sha256(published / "model.safetensors")


@pytest.mark.parametrize("step", ["lfs_put", "commit"])
def test_a_push_that_fails_midway_says_so_and_keeps_the_folder(step, trained, tmp_path, hub, capsys, monkeypatch):
    import huggingface_hub.utils._http

    monkeypatch.setattr(huggingface_hub.utils._http.time, "sleep", lambda seconds: None)  # the client's backoff
    repo_id, folder = f"someone/broken-{step.replace('_', '-')}", tmp_path / "hub-folder"
    with hub.failing(step, 500), pytest.raises(SystemExit) as failed:
        publish_main(["--model_dir", str(trained), "--output_dir", str(folder), "--push_to_hub",
                     "--hub_model_id", repo_id, "--hub_token", "hf_x"])
    message = str(failed.value.code)
    assert message.startswith(f"error: uploading {folder} to {repo_id}") and "500" in message, message
    assert f"{folder} is complete and unchanged: push it again to retry (`HF_ENDPOINT={hub.url} hf upload {repo_id} " \
           f"{folder}`)" in message, message
    assert "Uploaded" not in capsys.readouterr().out
    assert not [c for c in hub.commits if c["repo_id"] == repo_id]
    assert set(hub.tree(repo_id)) == {".gitattributes"}, "nothing published"
    assert {p.name for p in folder.iterdir()} == HUB_FILES
    assert sha256(folder / "model.safetensors") == sha256(trained / "hub" / "model.safetensors")
    posts = [r for r in hub.requests if r[2].startswith(f"/api/models/{repo_id}/commit/")]
    assert len(posts) == (0 if step == "lfs_put" else 1), "no commit after a failed weights upload"
    puts = sum(r[1] == "PUT" for r in hub.requests)
    push_folder(folder, repo_id, token="hf_x")  # the retry
    assert hub.tree(repo_id) == hub_tree(folder)
    assert sum(r[1] == "PUT" for r in hub.requests) == puts + (1 if step == "lfs_put" else 0), (
        "weights stored before the failed commit are not uploaded again")


def test_publishing_errors_are_clear(trained, tmp_path, monkeypatch):
    import huggingface_hub.constants

    with pytest.raises(SystemExit, match="not a saved model folder"):
        publish_main(["--model_dir", str(tmp_path), "--output_dir", str(tmp_path / "x")])
    (tmp_path / "taken").mkdir()
    with pytest.raises(SystemExit, match="exists; pass --force"):
        publish_main(["--model_dir", str(trained), "--output_dir", str(tmp_path / "taken")])
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"model_type": "bart"}))
    with pytest.raises(SystemExit, match="model_type is 'bart', not 'vaswani'"):
        publish_main(["--model_dir", str(other), "--output_dir", str(tmp_path / "y")])
    tiny_model().save_pretrained(tmp_path / "no_tokenizer")
    with pytest.raises(SystemExit, match="no tokenizer.json"):
        publish_main(["--model_dir", str(tmp_path / "no_tokenizer"), "--output_dir", str(tmp_path / "z")])
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(RuntimeError, match="HF_HUB_OFFLINE is set"):
        push_folder(trained / "hub", "someone/x", endpoint="http://127.0.0.1:9")


def test_a_folder_without_metrics_has_no_model_index(trained, tmp_path):
    folder = write_hub_folder(trained, tmp_path / "bare", metrics_file=tmp_path / "missing.json")
    meta = front_matter((folder / "README.md").read_text())
    assert "model-index" not in meta and meta["license"] == "unknown" and "datasets" not in meta


def test_no_trainer_loop_pushes_too(hub, tmp_path):
    from vaswani_training.train_no_trainer import main

    out = tmp_path / "run"
    main(["--preset", "tiny", "--output_dir", str(out), "--cache_dir", str(tmp_path / "cache"), "--max_steps", "1",
          "--max_train_samples", "100", "--max_test_samples", "2", "--num_samples", "0", "--cpu_bf16", "no",
          "--push_to_hub", "--hub_model_id", "someone/no-trainer", "--hub_token", "hf_x"])
    commit = hub.commits[-1]
    assert commit["repo_id"] == "someone/no-trainer"
    assert commit["files"] == {p.name: p.read_bytes() for p in (out / "hub").iterdir()}
    assert set(commit["files"]) == HUB_FILES


def test_a_training_run_whose_push_fails_says_so_and_keeps_its_model(hub, tmp_path):
    from vaswani_training.train_no_trainer import main

    out = tmp_path / "run"
    with hub.failing("commit", 500), pytest.raises(RuntimeError, match=re.escape(
            f"uploading {out / 'hub'} to someone/no-commit ({hub.url}) failed: ")) as failed:
        main(["--preset", "tiny", "--output_dir", str(out), "--cache_dir", str(tmp_path / "cache"), "--max_steps",
              "1", "--max_train_samples", "100", "--max_test_samples", "2", "--num_samples", "0", "--cpu_bf16", "no",
              "--push_to_hub", "--hub_model_id", "someone/no-commit", "--hub_token", "hf_x"])
    assert "stand-in fault: commit answers 500" in str(failed.value)
    assert set(hub.tree("someone/no-commit")) == {".gitattributes"}
    assert {p.name for p in (out / "hub").iterdir()} == HUB_FILES and (out / "metrics.json").is_file()


# The card tells the model's history; publishing never pairs weights with another model's scores ------------------


@pytest.fixture(scope="module")
def fine_tuned(trained, tmp_path_factory):
    """The Multi30k run fine-tuned for 2 updates on two local files."""
    from vaswani_training.train import main

    prefix = write_parallel(tmp_path_factory.mktemp("data"), name="captions-2024")
    out = tmp_path_factory.mktemp("fine-tuned")
    main(["--preset", "tiny", "--output_dir", str(out), "--model_name_or_path", str(trained), "--train_file", prefix,
          "--validation_file", prefix, "--test_file", prefix, "--max_steps", "2", "--eval_strategy", "no",
          "--max_test_samples", "3", "--num_samples", "0", "--cpu_bf16", "no", "--disable_tqdm", "true",
          "--report_to", "none", "--length_penalty", "0.6"])
    return out, prefix


def test_the_card_of_a_fine_tuned_model_tells_its_history(fine_tuned, trained, tmp_path):
    out, prefix = fine_tuned
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["base_model"] == str(trained) and metrics["base_model_local"] is True
    assert metrics["data"] == {"kind": "files", "train": [f"{prefix}.de", f"{prefix}.en"],
                               "validation": [f"{prefix}.de", f"{prefix}.en"], "test": [f"{prefix}.de", f"{prefix}.en"]}
    assert metrics["train_steps"] == 2 and metrics["train_pairs"] == 20
    assert metrics["base_model_history"]["dataset"] == "multi30k" and metrics["base_model_history"]["train_steps"] == 2
    folder = write_hub_folder(out, tmp_path / "card")
    readme = (folder / "README.md").read_text(encoding="utf-8")
    meta = front_matter(readme)
    assert "from scratch" not in readme
    assert (f"fine-tuned from `{trained}` (itself trained for 2 updates on Multi30k) with the paper's\nrecipe, to "
            f"translate German into English on the files `{prefix}.de` and `{prefix}.en`\n(2 updates of "
            f"fine-tuning).") in readme
    assert f"Data: the files `{prefix}.de` and `{prefix}.en`, 20 training pairs." in readme
    assert "datasets" not in meta, "a local file is no Hub dataset id"
    assert "base_model" not in meta, "a local folder is no Hub model id"
    assert meta["license"] == "other", "the base model's Multi30k terms carry over"
    (result,) = meta["model-index"][0]["results"]
    assert result["dataset"]["type"] == "custom" and "captions-2024" in result["dataset"]["name"]


def test_the_card_of_a_model_trained_from_scratch_says_so(published, trained):
    readme = (published / "README.md").read_text(encoding="utf-8")
    assert "trained from scratch with the paper's\nrecipe, to translate German into English on Multi30k" in readme
    assert "fine-tuned" not in readme


def test_a_hub_base_model_and_dataset_go_into_the_metadata(trained):
    from vaswani_training.lib.publishing import card_data_for

    metrics = {"dataset": "wmt14", "data": {"kind": "hub", "name": "wmt14", "config": "de-en"},
               "base_model": "someone/vaswani-base", "base_model_local": False, "test_bleu": 20.0}
    data = card_data_for(metrics, model_name="m", source_lang="de", target_lang="en")
    assert data.base_model == "someone/vaswani-base" and data.datasets == ["wmt14"]


def test_metrics_of_other_weights_are_refused(trained, tmp_path):
    source = tmp_path / "run"
    shutil.copytree(trained, source, ignore=shutil.ignore_patterns("hub"))
    weights = source / "model.safetensors"
    tensors = load_file(weights)
    name = next(iter(tensors))
    tensors[name] = tensors[name] + 0.01  # other weights than metrics.json scored
    save_file(tensors, weights, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=re.escape(f"{source / 'metrics.json'} does not describe the weights in "
                                                   f"{source} (it records the fingerprint of other weights")):
        write_hub_folder(source, tmp_path / "a")
    metrics = json.loads((source / "metrics.json").read_text())
    del metrics["weights_sha256"]  # metrics written before the weights were replaced, without a fingerprint
    (source / "metrics.json").write_text(json.dumps(metrics))
    os.utime(weights, (weights.stat().st_atime, (source / "metrics.json").stat().st_mtime + 60))
    with pytest.raises(ValueError, match=r"\(it is older than the weights\)"):
        write_hub_folder(source, tmp_path / "b")
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_the_hub_folder_follows_the_umask(trained, tmp_path, umask):
    previous = os.umask(umask)
    try:
        folder = write_hub_folder(trained, tmp_path / "hub-folder")
    finally:
        os.umask(previous)
    assert stat.S_IMODE(folder.stat().st_mode) == 0o777 & ~umask
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in folder.iterdir()}
    assert set(modes.values()) == {0o666 & ~umask}, modes


def test_the_template_is_installed_with_the_commands():
    from vaswani_training.lib.publishing import default_template

    assert default_template().read_text(encoding="utf-8") == (ROOT / "model_card.md").read_text(encoding="utf-8")
    assert (ROOT / "training" / "model_card.md").is_symlink(), "one template, at the repository root"


def test_an_unreachable_hub_is_refused_before_any_work(trained, tmp_path, hub, monkeypatch):
    import huggingface_hub.constants

    from vaswani_hf.checks import CheckError
    from vaswani_training.train import main as train_main

    dead = "http://127.0.0.1:9"  # the discard port: nothing listens there
    with pytest.raises(SystemExit, match=re.escape(f"--hub_endpoint {dead}: cannot be reached")):
        publish_main(["--model_dir", str(trained), "--output_dir", str(tmp_path / "x"), "--push_to_hub",
                     "--hub_model_id", "a/b", "--hub_endpoint", dead])
    assert not (tmp_path / "x").exists()
    run = ["--preset", "tiny", "--output_dir", str(tmp_path / "run"), "--max_steps", "1", "--push_to_hub",
           "--hub_model_id", "a/b"]
    with pytest.raises(CheckError, match=re.escape(f"--hub_endpoint {dead}: cannot be reached")):
        train_main([*run, "--hub_endpoint", dead])
    with pytest.raises(CheckError, match=r"--hub_endpoint 'hf.co' is not an http\(s\) URL"):
        train_main([*run, "--hub_endpoint", "hf.co"])
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(CheckError, match="HF_HUB_OFFLINE is set, so nothing could be uploaded"):
        train_main(run)
    assert not (tmp_path / "run").exists(), "refused before training"


# Publishing never replaces the model folder and names a damaged run's files ------------------------------------------


@pytest.mark.parametrize("where", ["same", "inside", "parent"])
def test_publishing_never_replaces_the_model_folder(tiny_run, tmp_path, where):
    from vaswani_training.publish import main as publish_main

    source = copy_run(tiny_run, tmp_path)
    before = listing(source)
    output = {"same": source, "inside": source / "published", "parent": tmp_path}[where]
    exits_with(lambda: publish_main(["--model_dir", str(source), "--output_dir", str(output), "--force"]),
               r"--output_dir .* (is the same folder as|lies inside|contains) --model_dir")
    assert listing(source) == before


def test_truncated_metrics_and_trainer_state_are_named(tiny_run, tmp_path):
    from vaswani_training.plot import plot_learning_curve
    from vaswani_training.publish import main as publish_main

    source = copy_run(tiny_run, tmp_path)
    metrics = source / "metrics.json"
    metrics.write_text(metrics.read_text()[:20])
    exits_with(lambda: publish_main(["--model_dir", str(source), "--output_dir", str(tmp_path / "e")]),
               re.escape(f"{metrics}: not valid JSON"))
    state = source / "checkpoint-3" / "trainer_state.json"
    state.write_text(state.read_text()[:30])
    with pytest.raises(CheckError, match=re.escape(f"{state}: not valid JSON")):
        plot_learning_curve(state, tmp_path / "curve.png")
