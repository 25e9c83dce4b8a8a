import re
import tomllib

import pytest

from app.config.sources import build_parser, dump_toml, make_config, parse_config
from app.runtime.errors import UserError
from conftest import REPO


def test_defaults_follow_the_resnet34_recipe():
    config, _ = parse_config([])
    assert config.model.arch == "resnet34"
    assert config.train.batch_size == 256 and config.optim.lr == 0.1
    assert config.logging.loggers == ["console"]


def test_flags_beat_the_file_which_beats_defaults(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('[train]\nepochs = 7\nbatch_size = 32\n[optim]\nlr = 0.2\n')
    config, _ = parse_config(["--config", str(path), "--epochs", "3", "-a", "resnet18"])
    assert config.train.epochs == 3  # flag over file
    assert config.train.batch_size == 32  # file over default
    assert config.optim.lr == 0.2
    assert config.model.arch == "resnet18"  # flag over default
    assert config.optim.momentum == 0.9  # default


def test_pytorch_examples_flag_names():
    config, _ = parse_config(["-a", "resnet50", "-b", "64", "--wd", "5e-5", "-j", "2", "-p", "5",
                              "--momentum", "0.8", "-e", "--seed", "3"])
    assert (config.model.arch, config.train.batch_size, config.optim.weight_decay) == \
        ("resnet50", 64, 5e-5)
    assert (config.data.workers, config.train.print_freq, config.optim.momentum) == (2, 5, 0.8)
    assert config.run.evaluate is True and config.train.seed == 3


def test_classes_is_a_count_or_a_list_of_wnids():
    assert parse_config(["--classes", "5"])[0].data.classes == 5
    assert parse_config(["--classes", "n01440764,n01443537"])[0].data.classes == \
        ["n01440764", "n01443537"]


def test_help_says_batch_size_is_per_device():
    assert "PER DEVICE" in build_parser().format_help()


@pytest.mark.parametrize("text, fragment", [
    ("[optim]\nlrr = 0.1\n", "unknown key `optim.lrr`"),
    ("[optimiser]\nlr = 0.1\n", "unknown section [optimiser]"),
    ("[train]\nepochs = 'ten'\n", "train.epochs: expected a whole number"),
    ("[optim]\nschedule = 'linear'\n", "must be one of cosine, step"),
    ("[train]\nepochs = 0\n", "train.epochs must be at least 1"),
    ("[augment]\nra_reps = 0\n", "augment.ra_reps must be at least 1"),
    ("[augment]\nrandom_erase = 1.5\n", "augment.random_erase must be in [0, 1]"),
    ("[augment]\nmixup_alpha = -0.2\n", "augment.mixup_alpha must be at least 0"),
    ("[train]\nepochs = \n", "line 2"),
])
def test_bad_config_files_name_file_and_key(tmp_path, text, fragment):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(UserError) as error:
        parse_config(["--config", str(path)])
    assert fragment in str(error.value)
    assert "\n" not in str(error.value)


def test_bad_flag_value_names_the_flag():
    with pytest.raises(UserError, match="flag --lr: optim.lr: expected a number"):
        parse_config(["--lr", "fast"])


def test_missing_config_file_is_a_user_error(tmp_path):
    with pytest.raises(UserError, match="run config not found"):
        parse_config(["--config", str(tmp_path / "nope.toml")])


def test_resolved_config_round_trips_through_toml(tmp_path):
    """runs/<run>/config.toml passed back with --config repeats the run."""
    config = make_config({("data", "classes"): ["n01440764"], ("optim", "lr"): 0.3,
                          ("train", "amp"): "off"})
    path = tmp_path / "config.toml"
    path.write_text(dump_toml(config))
    assert parse_config(["--config", str(path)])[0] == config
    assert tomllib.loads(path.read_text())["optim"]["lr"] == 0.3


def test_every_flag_is_named_after_its_config_key():
    """--<key> for every parameter (the run's name carries its section: --run-name), so a
    config file's key and its flag never disagree; short pytorch/examples aliases remain."""
    import dataclasses
    from app.config import Config
    parser = build_parser()
    options = {action.dest: action.option_strings for action in parser._actions}
    for section in dataclasses.fields(Config):
        for f in dataclasses.fields(getattr(Config(), section.name)):
            expected = "--run-name" if (section.name, f.name) == ("run", "name") else \
                "--" + f.name.replace("_", "-")
            assert expected in options[f"{section.name}.{f.name}"], (section.name, f.name)
    assert parse_config(["--sync-timeout", "60"])[0].parallel.sync_timeout == 60.0
    assert parse_config(["--logger", "wandb"])[0].logging.loggers == ["wandb"]  # alias


def test_a_renamed_key_says_its_new_name(tmp_path):
    path = tmp_path / "old.toml"
    path.write_text("[parallel]\ntimeout_s = 60\n")
    with pytest.raises(UserError, match="unknown key `parallel.timeout_s`; it is now "
                                        "`parallel.sync_timeout`"):
        parse_config(["--config", str(path)])


@pytest.mark.parametrize("flags, fragment", [
    (["--keep-checkpoints", "0"], "run.keep_checkpoints must be at least 1, got 0"),
    (["--max-bad-fraction", "1.5"], "data.max_bad_fraction must be in [0, 1], got 1.5"),
    (["--momentum", "1"], "optim.momentum must be in [0, 1), got 1.0"),
    (["--sync-timeout", "0"], "parallel.sync_timeout must be positive"),
    # the rules shared with the Python API, in the driver's words there
    (["--replicas-as", "threads", "--compile", "on"], "--compile on: torch.compile is not "
     "thread-safe, so threads train eagerly; use --replicas-as processes to compile"),
])
def test_ranges_and_rules_are_checked_in_the_flags_words(flags, fragment):
    with pytest.raises(UserError, match=re.escape(fragment)):
        parse_config(flags)


def test_auto_augment_flags_have_torchvisions_names_in_the_augment_section(tmp_path):
    config, _ = parse_config([])
    assert (config.augment.auto_augment, config.augment.ra_magnitude) == ("off", 9)
    config, _ = parse_config(["--auto-augment", "ta_wide", "--ra-magnitude", "12"])
    assert (config.augment.auto_augment, config.augment.ra_magnitude) == ("ta_wide", 12)
    sections = list(config.to_dict())
    assert sections.index("augment") == sections.index("data") + 1
    path = tmp_path / "run.toml"
    path.write_text('[augment]\nauto_augment = "imagenet"\n')
    assert parse_config(["--config", str(path)])[0].augment.auto_augment == "imagenet"
    with pytest.raises(UserError, match="must be one of off, ta_wide, ra, imagenet"):
        path.write_text('[augment]\nauto_augment = "augmix"\n')
        parse_config(["--config", str(path)])
    with pytest.raises(UserError, match="augment.ra_magnitude must be in"):
        parse_config(["--ra-magnitude", "31"])


def test_the_imagenette_rows_cpu_config_is_its_gpu_configs_twin():
    """configs/imagenette_128_5_cpu.toml promises the GPU config's recipe with only what a
    CPU needs changed (loader processes, the console's print rate, fp32 as its runs were
    measured): a recipe change made to one file and not the other would make the CPU's
    measured top-1 a figure of another recipe."""
    gpu, cpu = (
        tomllib.loads(dump_toml(parse_config(["--config", str(REPO / "configs" / name)])[0]))
        for name in ("imagenette_128_5.toml", "imagenette_128_5_cpu.toml"))
    differing = {(section, key) for section in gpu for key in gpu[section]
                 if gpu[section][key] != cpu[section][key]}
    assert differing == {("data", "workers"), ("train", "print_freq"), ("train", "amp")}
    assert (gpu["train"]["amp"], cpu["train"]["amp"]) == ("auto", "off")
    assert (gpu["model"]["arch"], gpu["optim"]["optimizer"], gpu["train"]["batch_size"]) == (
        "xse_resnext_mini", "ranger", 32)
