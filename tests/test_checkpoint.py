import pytest
import torch

from app.runtime.errors import UserError
from app.training import checkpoint


def test_round_trip_moves_tensors_to_cpu_and_keeps_rng_states(tmp_path):
    torch.manual_seed(3)
    states = checkpoint.rng_states()
    expected = torch.rand(3)
    path = tmp_path / "c.pt"
    checkpoint.save(path, {"model": {"w": torch.ones(2, requires_grad=True)}, "epoch": 4,
                           "rng": states})
    loaded = checkpoint.load(path)
    assert loaded["epoch"] == 4 and loaded["model"]["w"].device.type == "cpu"
    torch.rand(10)
    checkpoint.set_rng_states(loaded["rng"])
    assert torch.equal(torch.rand(3), expected)
    assert not list(tmp_path.glob(".*tmp"))


def test_truncated_checkpoint_is_a_clear_error(tmp_path):
    path = tmp_path / "c.pt"
    checkpoint.save(path, {"model": {"w": torch.randn(1000)}})
    path.write_bytes(path.read_bytes()[:2000])
    with pytest.raises(UserError, match="truncated, corrupt or not an imagenet-dp checkpoint"):
        checkpoint.load(path)


def test_foreign_checkpoint_is_a_clear_error(tmp_path):
    path = tmp_path / "plain.pt"
    torch.save({"state_dict": {}}, path)
    with pytest.raises(UserError, match="not written by imagenet-dp"):
        checkpoint.load(path)


class Payload:
    def __reduce__(self):
        return (print, ("code ran while loading",))


def test_loading_never_runs_pickled_code(tmp_path, capsys):
    path = tmp_path / "evil.pt"
    torch.save({"format": checkpoint.FORMAT, "x": Payload()}, path)
    with pytest.raises(UserError):
        checkpoint.load(path)
    assert "code ran" not in capsys.readouterr().out


def test_unwrap_strips_compile_and_ddp_wrappers():
    model = torch.nn.Linear(2, 2)

    class Wrapper(torch.nn.Module):  # the attribute DDP exposes
        def __init__(self, module):
            super().__init__()
            self.module = module

    assert checkpoint.unwrap(Wrapper(torch.compile(model))) is model


def test_a_checkpoint_folder_save_returns_the_file_it_wrote(tmp_path):
    folder = checkpoint.CheckpointFolder(tmp_path, keep=2)
    paths = [folder.save({"model": {}, "step": step}, step=step) for step in (1, 2, 3)]
    assert [p.name for p in paths] == ["step-000000001.pt", "step-000000002.pt",
                                       "step-000000003.pt"]
    assert not paths[0].exists()  # only the newest two are kept
    assert (tmp_path / "last.pt").samefile(paths[-1])
    assert checkpoint.load(paths[-1])["step"] == 3
