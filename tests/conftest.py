import gc
import os

import pytest

# Triton reads TRITON_INTERPRET when it is imported: set before any test module imports it, so the
# kernels' tests (test_kernels.py, exact mode) run on the CPU interpreter. An explicit value wins:
# scripts/gpu_exact.sh runs them on a GPU with TRITON_INTERPRET=0. Nothing else in the suite uses Triton.
os.environ.setdefault("TRITON_INTERPRET", "1")
# The interpreter runs tl.dot as numpy's matmul: on a shared 2-core machine BLAS threads spinning
# against other processes made it 2x slower (the suite's torch code runs on torch's own threads).
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
# Under pytest-xdist (`-n 2`, the README's command) each worker is one process on one core: torch's
# own second thread would spin against the other worker. Set before torch is imported; subprocesses a
# test starts inherit it.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")


# What a test costs, to order the files: a test marked slow takes ~20-100 s on 2 cores, the others
# ~0.5 s on average (1242 tests, 67 slow, 2026-11-28).
SLOW_S, TEST_S = 30.0, 0.5


def pytest_configure(config):
    """`--dist loadfile` hands each worker a whole file, in the order the collection gives (with
    xdist's own reordering off: it puts the files with most tests first, so the files of few slow
    tests (the "Your own target" file, the hostile caches, the wheel) came last, where one of them
    could keep one worker busy after the other had finished). The costliest files go first instead,
    and the many cheap files fill in behind them: on one run's test times, each varied +-40% 300
    times, the later worker ended a median 28 s (90th percentile 70 s) after the even split in
    xdist's order, 3 s (5 s) in this one (times at load ~5, ~2.6x an idle VM's)."""
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def pytest_collection_finish(session):
    """Every test module is imported now (torch, transformers, onnx, Triton: ~620k objects in each xdist
    worker) and lives to the end, so those objects are moved out of the collector's reach (`gc.freeze`).
    A full collection (one per pair load, export and build, `release_freed_memory`, besides Python's
    own) walked them all: 0.4-0.8 s each on the 2-core VM, test_build.py's 101 took 67 s, 12 s once
    frozen. What the tests make afterwards is collected as before; a cycle among the frozen objects that
    became garbage later would never be freed (the collection first frees those that already are)."""
    gc.collect()
    gc.freeze()


def pytest_collection_modifyitems(items):
    """Under xdist: the files in the order of their estimated cost, costliest first; each file's
    tests in their own order. (A plain run keeps pytest's order.)"""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return
    cost = {}
    for item in items:
        cost[item.path] = cost.get(item.path, 0.0) + (SLOW_S if item.get_closest_marker("slow") else TEST_S)
    items.sort(key=lambda item: -cost[item.path])


@pytest.fixture(scope="session")
def sample_target():
    """The sample target's Hugging Face directory (SmolLM2-135M-Instruct), converted once per cache."""
    from eagle_export.data.sample import sample_target_dir

    return sample_target_dir()


@pytest.fixture(scope="module")
def one_torch_thread():
    """Tiny models on shared 2-core machines: a second torch thread spins against other processes
    (3-60x slower there). Modules opt in with `pytestmark = pytest.mark.usefixtures(...)`."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def no_grad():
    """Autograd off for a module's tests (they run models for their outputs only). A fixture, not a
    call at import: set at collection, it switched autograd off for every test of the session."""
    import torch

    with torch.no_grad():
        yield


@pytest.fixture(scope="session", autouse=True)
def private_conformance_cache(tmp_path_factory):
    """Builds remember conformance results in the user cache; the suite's in-process builds keep their
    own, so such a test never reuses a result another run left (builds in a subprocess, test_wheel's
    and the interrupted build's, use the user cache as a user's command would)."""
    from eagle_export.builder import conformance

    patch = pytest.MonkeyPatch()
    folder = tmp_path_factory.mktemp("conformance-cache")
    patch.setattr(conformance, "cache_dir", lambda: folder)
    yield folder
    patch.undo()
