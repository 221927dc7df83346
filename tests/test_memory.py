"""Export memory: the projection from the configs, and the refusal before loading when it exceeds
what the machine has available."""

import shutil
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from lifetime import watch_drafter_exports
from tiny_models import write_tiny_drafter, write_tiny_target

from eagle_export.cli import main
from eagle_export.errors import EagleExportError
from eagle_export.export.export import EXPORT_PEAK_FIXED_BYTES, check_export_fits, weight_bytes
from eagle_export.models.checkpoint import load_drafter, load_target
from eagle_export.speculation.tree import TreeShape


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("pair")
    return write_tiny_target(root / "t", "qwen3"), write_tiny_drafter(root / "d", "3", seed=1, head_dim=16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_weight_bytes_from_the_configs_match_the_loaded_pair(pair, dtype):
    target = load_target(pair[0], dtype=dtype)
    drafter = load_drafter(pair[1], target=target, dtype=dtype)
    nbytes = lambda tensors: sum(p.numel() * p.element_size() for p in tensors)
    loaded = nbytes({id(p): p for m in (target, drafter) for p in m.parameters()}.values())  # the shared table once
    projected, target_graph, drafter_graph = weight_bytes(target.config, drafter.config, dtype)
    assert 0.97 * loaded <= projected <= loaded  # norm gains and biases are left out
    assert 0.97 * nbytes(target.parameters()) <= target_graph <= nbytes(target.parameters())
    graph = nbytes(drafter.parameters())  # with the shared table
    assert 0.97 * graph <= drafter_graph <= graph


def test_the_projection_follows_the_stages(pair, monkeypatch):
    """`export` and a build's export stage (the same `export_pair`): the larger of the target's stage (the
    pair + the exporter's copies of a one-file target graph) and the drafter's (its graph and the
    exporter's copies of it; the target freed, which the export tests hold)."""
    import eagle_export.export.export as export_module
    from eagle_export.models.config import DrafterConfig, TargetConfig, read_config_json

    target_cfg, drafter_cfg = TargetConfig.from_hf(read_config_json(pair[0])), DrafterConfig.from_hf(read_config_json(pair[1]))
    gib, fixed, copies = 2**30, export_module.EXPORT_PEAK_FIXED_BYTES, export_module.EXPORT_PEAK_GRAPH_COPIES
    table = target_cfg.vocab_size * target_cfg.hidden_size * 2  # an external graph's largest tensor, read alone
    for (w, t, d), peak in [
        ((16 * gib, 15 * gib, 2 * gib - gib // 4), 16 * gib + table),  # 8B: the drafter's 4 x 1.75 GiB is less
        ((int(1.2 * gib), gib, gib // 2), int(1.2 * gib) + copies * gib),  # both one file
        ((gib, gib // 8, gib), (1 + copies) * gib)]:  # a drafter graph larger than the target's
        monkeypatch.setattr(export_module, "weight_bytes", lambda *a, sizes=(w, t, d): sizes)
        assert export_module.projected_peak(target_cfg, drafter_cfg, torch.float16) == peak + fixed


def test_a_pair_larger_than_available_memory_is_refused_before_loading(pair, monkeypatch):
    import eagle_export.export.export as export_module

    needed = check_export_fits(*pair, torch.float32, available=1 << 40)
    assert needed > EXPORT_PEAK_FIXED_BYTES
    assert check_export_fits(*pair, torch.float32, available=1 << 20) == needed  # tiny: never refused
    monkeypatch.setattr(export_module, "weight_bytes", lambda *a: (3 << 30, 2 << 30, 1 << 30))  # a 3 GiB pair from here on
    needed = check_export_fits(*pair, torch.float32, available=1 << 40)
    with pytest.raises(EagleExportError, match=r"needs about .* GiB .* available; in fp16 it needs") as e:
        check_export_fits(*pair, torch.float32, available=needed - 1)
    assert "--dtype fp16" in e.value.fix

    def no_loading(*args, **kwargs):
        raise AssertionError("loaded before the memory check")

    monkeypatch.setattr(export_module, "available_memory_bytes", lambda: 1 << 20)
    monkeypatch.setattr(export_module, "load_pair", no_loading)
    result = CliRunner().invoke(main, ["export", "--target", str(pair[0]), "--draft", str(pair[1]), "--dtype", "fp16",
                                       "-o", str(pair[0].parent / "out")])
    assert result.exit_code == 2 and "needs about" in result.output and "Traceback" not in result.output


def test_external_weights_stream_through_the_passes_and_the_save(tmp_path, pair, monkeypatch):
    """A graph whose weights sit in an external file (what the exporter writes above 2 GiB): each
    becomes a tensor read from the file on demand, the ONNX pipeline runs on it, and the save writes
    one data file; the result computes what the original does."""
    import numpy as np
    import onnx_ir as ir

    import eagle_export.export.export as export_module
    from eagle_export.export.export import export_drafter, save_model, streamed
    from eagle_export.models import contract as C
    from eagle_export.passes import onnx_pipeline
    from eagle_export.runtime.backends import ort_session, run_onnx

    monkeypatch.setattr(export_module, "EXTERNAL_DATA_THRESHOLD", 0)
    target = load_target(pair[0])
    drafter = load_drafter(pair[1], target=target)
    export_drafter(drafter, 2, False, tmp_path / "drafter.onnx")
    model = streamed(ir.load(tmp_path / "drafter.onnx"))
    lazy = [v.const_value for v in model.graph.initializers.values() if isinstance(v.const_value, ir.LazyTensor)]
    assert sum(t.nbytes for t in lazy) >= 0.99 * sum(v.const_value.nbytes for v in model.graph.initializers.values())
    (tmp_path / "again").mkdir()
    spec = C.drafter_graph(drafter.config, TreeShape.chain(2), False)
    save_model(onnx_pipeline(spec)(model).model, tmp_path / "again" / "drafter.onnx")
    assert sorted(p.name for p in (tmp_path / "again").iterdir()) == ["drafter.onnx", "drafter.onnx.data"]
    spec = C.drafter_graph(drafter.config, TreeShape.chain(2), False)
    g = torch.Generator().manual_seed(0)
    cache = torch.randn(1, 2, drafter.config.num_kv_heads, 5, drafter.config.head_dim, generator=g)
    feeds = spec.feeds((torch.randint(0, 320, (2, 3), generator=g), torch.randn(2, 3, 192, generator=g),
                        torch.tensor([3, 1]), cache, cache, torch.tensor([5, 2])))
    before, after = (run_onnx(ort_session(d / "drafter.onnx"), feeds) for d in (tmp_path, tmp_path / "again"))
    for name in before:
        np.testing.assert_array_equal(before[name].numpy(), after[name].numpy())


def test_a_constant_the_exporter_wrote_to_its_own_file_is_read_into_the_saved_graph(tmp_path, monkeypatch):
    """Above 2 GB torch's exporter writes every tensor to a file of its own beside the raw graph, a
    Constant node's value too; the save writes only initializers to the data file, so the constant is
    read into the graph: the saved graph runs once the exporter's directory is gone."""
    import numpy as np
    import onnx
    import onnx_ir as ir
    from onnx import TensorProto, helper

    import eagle_export.export.export as export_module
    from eagle_export.export.export import save_model, streamed
    from eagle_export.runtime.backends import ort_session

    raw = tmp_path / "raw"
    raw.mkdir()
    constant, weight = np.array([1, 2, 3], np.float32), np.array([4, 5, 6], np.float32)

    def external(name, array):
        (raw / name).write_bytes(array.tobytes())
        tensor = TensorProto(name=name, data_type=TensorProto.FLOAT, dims=array.shape)
        tensor.data_location = TensorProto.EXTERNAL
        tensor.external_data.add(key="location", value=name)
        return tensor

    graph = helper.make_graph(
        [helper.make_node("Constant", [], ["c"], value=external("c_attr_value", constant)),
         helper.make_node("Add", ["x", "c"], ["s"]), helper.make_node("Mul", ["s", "w"], ["y"])],
        "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3])], initializer=[external("w", weight)])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8), raw / "g.onnx")
    monkeypatch.setattr(export_module, "EXTERNAL_DATA_THRESHOLD", 0)  # as a graph over 2 GB is saved
    (tmp_path / "out").mkdir()
    save_model(streamed(ir.load(raw / "g.onnx")), tmp_path / "out" / "g.onnx")
    shutil.rmtree(raw)
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["g.onnx", "g.onnx.data"]
    y = ort_session(tmp_path / "out" / "g.onnx").run(None, {"x": np.ones(3, np.float32)})[0]
    np.testing.assert_array_equal(y, (1 + constant) * weight)


def test_a_single_file_graph_is_written_tensor_by_tensor_with_the_bytes_onnx_ir_writes(tmp_path, pair, monkeypatch):
    """save_single_file writes what ir.save writes, byte for byte (graph hashes unchanged), but serializes
    the model only as a skeleton whose initializers hold no bytes, then each initializer on its own: no
    proto of the whole model, nor its serialized copy, is held beside the IR's weights."""
    import onnx_ir as ir

    from eagle_export.export.export import export_drafter, export_target, save_single_file
    from eagle_export.export.loader import load_pair

    target, drafter = load_pair(*pair, torch.float16)
    export_target(target, tmp_path / "target.onnx", True)
    export_drafter(drafter, TreeShape.from_branching([2, 2]), True, tmp_path / "drafter.onnx")
    for name in ("target", "drafter"):
        model = ir.load(tmp_path / f"{name}.onnx")
        ir.save(model, tmp_path / f"{name}-ir.onnx")
        serialized = ir.serde.serialize_model
        weights_seen = []
        monkeypatch.setattr(ir.serde, "serialize_model", lambda m: weights_seen.append(
            sum(v.const_value.nbytes for v in m.graph.initializers.values())) or serialized(m))
        save_single_file(model, tmp_path / f"{name}-streamed.onnx")
        monkeypatch.setattr(ir.serde, "serialize_model", serialized)
        assert weights_seen == [0]
        streamed_bytes = (tmp_path / f"{name}-streamed.onnx").read_bytes()
        assert streamed_bytes == (tmp_path / f"{name}-ir.onnx").read_bytes()
        assert streamed_bytes == (tmp_path / f"{name}.onnx").read_bytes()  # what export wrote
        assert sum(v.const_value.nbytes for v in model.graph.initializers.values()) > 10_000  # the weights restored
        assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(name)) == \
            [f"{name}-ir.onnx", f"{name}-streamed.onnx", f"{name}.onnx"]  # no spool file left


def test_export_frees_the_target_before_the_drafter_is_exported(tmp_path, pair, monkeypatch):
    """The drafter's export runs beside the drafter and the embedding table it shares, not the whole target."""
    import eagle_export.export.export as export_module

    alive = watch_drafter_exports(monkeypatch, export_module)
    summary = export_module.export_models(*pair, 2, "fp32", tmp_path / "out", sampling=True)
    assert alive == [(False, False, True)] * 2  # target and its layers gone, the shared table alive, for both drafters
    assert {"target", "drafter", "drafter_sampling"} <= set(summary)


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads the process's mappings (Linux)")
def test_checkpoint_tensors_are_read_into_memory_of_their_own_not_views_of_the_mapped_file(pair):
    """A view of the mapped file would keep the whole file mapped, and every page read resident, while
    the model lives (fused q/k/v and gate/up included); the values are the file's."""
    from safetensors.torch import load

    file = pair[0] / "model.safetensors"
    stored = load(file.read_bytes())  # the reference: parsed from bytes, nothing mapped
    target = load_target(pair[0], dtype=next(iter(stored.values())).dtype)  # the file's dtype: no cast copies
    assert str(file) not in Path("/proc/self/maps").read_text()
    from eagle_export.models.checkpoint import load_state_dict

    state = load_state_dict(pair[0])
    assert str(file) not in Path("/proc/self/maps").read_text()
    assert state.keys() == stored.keys() and all(torch.equal(state[k], stored[k]) for k in stored)
    assert target.embed_tokens.weight.dtype == stored["model.embed_tokens.weight"].dtype
