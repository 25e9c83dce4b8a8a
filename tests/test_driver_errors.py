"""Every user mistake: one line on stderr naming what is wrong, exit code 2, no traceback."""

import pytest

from app.launch.hints import continuing_argv
from app.launch.run import main
from app.runtime.cli import run_cli
from conftest import REPO, TINY_TRAIN_FLAGS, run_driver


def fail(capsys, *argv) -> str:
    code = run_cli(main, list(argv))
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert err and err[-1].startswith("error: ")
    assert not [line for line in err if line.startswith("error: ") and line != err[-1]]
    return err[-1]


def edit(path, fn):
    lines = path.read_text().splitlines()
    path.write_text("\n".join(fn(lines)) + "\n")


def test_missing_catalog(capsys, tmp_path):
    message = fail(capsys, "--catalog", str(tmp_path / "datasets.toml"))
    assert "datasets.toml: dataset catalog not found" in message


def test_malformed_catalog_names_the_line(capsys, tmp_path):
    path = tmp_path / "datasets.toml"
    path.write_text('default = "x"\n[datasets.x]\nurl = "/data"\nseed = = 3\n')
    message = fail(capsys, "--catalog", str(path))
    assert "invalid TOML" in message and "line 4" in message


def test_unknown_dataset_lists_the_known(capsys):
    message = fail(capsys, "--catalog", str(REPO / "datasets.toml"), "--dataset", "imagenet21k")
    assert "unknown dataset 'imagenet21k'" in message
    assert "sample, sample_tiny, sample_bench, imagenet_local, imagenet_s3" in message


def test_missing_root(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("IMAGENET_ROOT", str(tmp_path / "no-imagenet-here"))
    message = fail(capsys, "--catalog", str(REPO / "datasets.toml"), "--dataset",
                   "imagenet_local")
    assert "no-imagenet-here not found; set IMAGENET_ROOT" in message


def test_missing_table(capsys, tiny_copy, catalog_for):
    (tiny_copy / "LOC_synset_mapping.txt").unlink()
    message = fail(capsys, "--catalog", str(catalog_for(tiny_copy)))
    assert "table LOC_synset_mapping.txt not found" in message


def test_csv_without_expected_columns(capsys, tiny_copy, catalog_for):
    edit(tiny_copy / "LOC_val_solution.csv", lambda lines: ["id,prediction"] + lines[1:])
    message = fail(capsys, "--catalog", str(catalog_for(tiny_copy)))
    assert "LOC_val_solution.csv: expected columns ImageId,PredictionString" in message


def test_wnid_not_in_mapping(capsys, tiny_copy, catalog_for):
    edit(tiny_copy / "LOC_val_solution.csv",
         lambda lines: lines[:2] + ["ILSVRC2012_val_00000999,n12345678 1 1 5 5 "] + lines[2:])
    message = fail(capsys, "--catalog", str(catalog_for(tiny_copy)))
    assert "LOC_val_solution.csv line 3: wnid 'n12345678' is not in" in message


def test_image_id_escaping_the_root(capsys, tiny_copy, catalog_for):
    edit(tiny_copy / "LOC_val_solution.csv",
         lambda lines: lines[:1] + ["../../../../etc/passwd,n01440764 1 1 5 5 "] + lines[1:])
    message = fail(capsys, "--catalog", str(catalog_for(tiny_copy)))
    assert "line 2: ImageId '../../../../etc/passwd'" in message and "escape" in message


def test_empty_selection(capsys, tiny_sample, catalog_for):
    message = fail(capsys, "--catalog", str(catalog_for(tiny_sample)), "--classes", "99")
    assert "classes = 99, but" in message and "lists only 10" in message


def test_bad_config_key(capsys, tmp_path):
    config = tmp_path / "run.toml"
    config.write_text("[train]\nepoch = 3\n")
    message = fail(capsys, "--config", str(config))
    assert "run.toml: unknown key `train.epoch`" in message


def test_unknown_logger_is_rejected_before_training(capsys):
    message = fail(capsys, "--catalog", str(REPO / "datasets.toml"), "--logger", "console,tb")
    assert ("flag --loggers: logging.loggers: must be one of console, tensorboard, wandb, got "
            "'tb'") in message


def test_jsonl_is_not_a_choice_because_it_is_always_written(capsys):
    message = fail(capsys, "--catalog", str(REPO / "datasets.toml"), "--logger", "jsonl")
    assert "must be one of console, tensorboard, wandb, got 'jsonl'" in message


def test_wandb_without_credentials_online_says_what_to_do(tmp_path, tiny_sample, catalog_for):
    env = {"WANDB_MODE": "online", "WANDB_API_KEY": "", "WANDB_DIR": str(tmp_path),
           "HOME": str(tmp_path), "WANDB_CONFIG_DIR": str(tmp_path)}
    result = run_driver("--catalog", str(catalog_for(tiny_sample)), *TINY_TRAIN_FLAGS,
                        "--epochs", "1", "--logger", "wandb", cwd=tmp_path, env=env)
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    assert "wandb could not start the run" in result.stderr and "WANDB_MODE=offline" in \
        result.stderr


def test_resume_from_a_missing_checkpoint(capsys, tmp_path):
    message = fail(capsys, "--catalog", str(REPO / "datasets.toml"), "--resume",
                   str(tmp_path / "last.pt"))
    assert "no such checkpoint file" in message


def test_resume_from_a_checkpoint_of_another_model(capsys, tmp_path, tiny_sample, catalog_for):
    catalog = str(catalog_for(tiny_sample))
    flags = [*TINY_TRAIN_FLAGS, "--catalog", catalog, "--output-dir", str(tmp_path / "runs"),
             "--epochs", "1", "--run-name", "one"]
    assert run_cli(main, flags) == 0
    capsys.readouterr()
    message = fail(capsys, *flags, "-a", "resnet18", "--resume", "auto", "--epochs", "2")
    assert "does not fit this model" in message


@pytest.mark.parametrize("args, fragment", [
    (["--catalog", "missing.toml"], "missing.toml: dataset catalog not found"),
    (["--dataset", "nope"], "unknown dataset 'nope'"),
    # refused by the config's validation, before a GPU is looked up or a process started
    (["--devices", "cuda:0,cpu", "--sync", "ps"], "--devices cuda:0,cpu mixes CPU and CUDA"),
])
def test_a_real_driver_process_exits_2_without_traceback(tmp_path, args, fragment):
    if "--catalog" not in args:
        args = ["--catalog", str(REPO / "datasets.toml"), *args]
    result = run_driver(*args, cwd=tmp_path, timeout=120)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith("error: ")
    assert fragment in result.stderr


def test_the_command_that_continues_a_run_names_resume_and_run_name_once():
    argv = ["bin/driver.py", "--resume", "runs/a/checkpoints/last.pt", "-b", "8",
            "--run-name=a", "--resume=auto"]
    assert continuing_argv(argv, "a") == ["bin/driver.py", "-b", "8", "--resume", "auto",
                                          "--run-name", "a"]
