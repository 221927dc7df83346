"""A decoding call's launches through the exact kernels (scripts/launch_count.py), counted on the CPU: at
batch 1 on a GPU each launch is a fixed cost of microseconds, and a torch op between two kernels breaks
their programmatic overlap (PDL). (a) A target decoder layer launches its Triton kernels alone: two
projections with their norms and activation in the prologue, two with the residual in the epilogue,
the fused RoPE and the attention, and no torch op; (b) a drafter step of the unrolled chain adds at most
15 torch ops (its draft's softmax and pick, the embedding and vocabulary map, the attention's input,
key lists and keys), its positions, RoPE and step masks made once a call. Planted: RoPE computed again at
every step (what the drafter did before) adds its six ops a step and fails (b)."""

import importlib.util
from pathlib import Path

import pytest

pytest.importorskip("triton", reason="the kernels' tests need triton (pip install '.[test]')")

spec = importlib.util.spec_from_file_location("launch_count", Path(__file__).parents[1] / "scripts" / "launch_count.py")
launch_count = importlib.util.module_from_spec(spec)
spec.loader.exec_module(launch_count)

pytestmark = pytest.mark.usefixtures("no_grad")
STEP_OPS = 15  # a chain drafter step's torch ops, at most


def counted(made: dict) -> dict:
    return {name.split(" ")[0].rstrip(","): launch_count.count(call) for name, call in made.items() if "verify" not in name}


def rope_ops(seen) -> int:
    return sum(n for (_, site), n in seen.ops.items() if "rope_cos_sin" in site)


@pytest.fixture(scope="module")
def calls():
    """The plain step and the drafter call of a 1-layer target and a K=2 chain, and of 2 layers and K=3."""
    return [launch_count.calls(*launch_count.graphs(layers, depth)) for layers, depth in ((1, 2), (2, 3))]


@pytest.fixture(scope="module")
def launched(calls):
    return [counted(made) for made in calls]


def test_a_target_layer_launches_its_six_kernels_and_no_torch_op(launched):
    one, two = (c["plain"] for c in launched)
    added = two.kernels - one.kernels
    assert dict(added) == {"_linear_kernel": 4, "_rope_kernel": 1, "_attention_split_kernel": 1}
    assert two.ops == one.ops and not one.kernels - two.kernels


def test_a_drafter_step_adds_at_most_its_own_few_torch_ops(launched):
    shallow, deep = (c["drafter"] for c in launched)
    assert 0 < sum(deep.ops.values()) - sum(shallow.ops.values()) <= STEP_OPS
    assert sum(deep.kernels.values()) > sum(shallow.kernels.values())  # (the step's kernels are counted)
    assert rope_ops(deep) == rope_ops(shallow) > 0  # (once a call)


def test_planted_rope_at_every_drafter_step_fails(calls, monkeypatch):
    from eagle_export.models.drafter import Drafter

    step = Drafter.step
    monkeypatch.setattr(Drafter, "step", lambda self, *args, rope=None, **kwargs: step(self, *args, **kwargs))
    shallow, deep = (launch_count.count(made[next(n for n in made if n.startswith("drafter"))], warm=False) for made in calls)
    assert sum(deep.ops.values()) - sum(shallow.ops.values()) > STEP_OPS and rope_ops(deep) > rope_ops(shallow)
