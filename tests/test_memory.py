"""Export memory: the projection from the configs, and the refusal before loading when it exceeds
what the machine has available."""

import pytest
import torch
from click.testing import CliRunner

from eagle_export.checkpoint import load_drafter, load_target
from eagle_export.cli import main
from eagle_export.errors import EagleExportError
from eagle_export.export import EXPORT_PEAK_FIXED_BYTES, check_export_fits, weight_bytes
from tiny_models import write_tiny_drafter, write_tiny_target


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("pair")
    return write_tiny_target(root / "t", "qwen3"), write_tiny_drafter(root / "d", "3", seed=1, head_dim=16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_weight_bytes_from_the_configs_match_the_loaded_pair(pair, dtype):
    target = load_target(pair[0], dtype=dtype)
    drafter = load_drafter(pair[1], target=target, dtype=dtype)
    tensors = {id(p): p for m in (target, drafter) for p in m.parameters()}  # the shared table once
    loaded = sum(p.numel() * p.element_size() for p in tensors.values())
    projected = weight_bytes(target.config, drafter.config, dtype)
    assert 0.97 * loaded <= projected <= loaded  # norm gains and biases are left out


def test_a_pair_larger_than_available_memory_is_refused_before_loading(pair, monkeypatch):
    import eagle_export.export as export_module

    needed = check_export_fits(*pair, torch.float32, available=1 << 40)
    assert needed > EXPORT_PEAK_FIXED_BYTES
    with pytest.raises(EagleExportError, match=r"needs about .* GiB .* available; in fp16 it needs") as e:
        check_export_fits(*pair, torch.float32, available=needed - 1)
    assert "--dtype fp16" in e.value.fix

    def no_loading(*args, **kwargs):
        raise AssertionError("loaded before the memory check")

    monkeypatch.setattr(export_module, "available_memory_bytes", lambda: 1 << 20)
    monkeypatch.setattr(export_module, "load_target", no_loading)
    result = CliRunner().invoke(main, ["export", "--target", str(pair[0]), "--draft", str(pair[1]), "--dtype", "fp16",
                                       "-o", str(pair[0].parent / "out")])
    assert result.exit_code == 2 and "needs about" in result.output and "Traceback" not in result.output
