"""Programmatic dependent launch (kernels.triton_ops, PDL): a kernel launched with it may start while the
previous one ends, so before its grid-dependency wait it may touch nothing another kernel writes. Checked
on the CPU, on the kernels compiled as a Hopper GPU runs them (the interpreter runs no PDL), without a
GPU: (a) in the TTIR every load, store, atomic or inline asm whose pointer derives from an argument that
is not a constant parameter of the layer comes after the wait, which sits in the kernel's top-level block
(every program waits: a kernel's end then implies its predecessors' end, which the next kernel's wait
relies on); (b) in the PTX (the linear kernel's, with its L2 prefetch, and the rope kernel's; ptxas
assembles both for sm_90) nothing but the prefetch touches memory, and nothing branches, before
`griddepcontrol.wait`. Planted: an activation load moved before the wait, a store before it.
"""

import importlib.util
import inspect
import json
import linecache
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

triton = pytest.importorskip("triton", reason="the kernels' tests need triton (pip install '.[test]')")
tl = triton.language

from eagle_export.kernels import triton_ops as K  # noqa: E402

pytestmark = pytest.mark.skipif(not hasattr(tl.extra.cuda, "gdc_wait"), reason="this Triton has no PDL (gdc_wait)")

from triton.backends.compiler import GPUTarget  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)  # an H100/H200


# Each kernel: its pointer arguments' element types (others bf16), its scalar arguments, and the pointers
# that are the layer's constant parameters (what the kernel may read before the wait).
KERNELS = {
    "_linear_kernel": ({"part": "*fp32", "count": "*i32"}, "M N K K_SPLIT sxm sxk swn swk sym syn srm eps", "w bias gain"),
    "_sum_splits_kernel": ({"part": "*fp32"}, "M N sym srm", "bias"),
    "_rms_norm_kernel": ({}, "M H sx sy eps", "w"),
    "_silu_mul_kernel": ({}, "M width sg su sy", ""),
    "_rope_kernel": ({}, "M T HQ HKV sqb sqh sqt skb skh skt scb sct ssb sst eps", "qw kw"),
    "_attention_split_kernel": ({"index": "*i32", "count": "*i32", "acc_out": "*fp32", "ml_out": "*fp32",
                                 "arrived": "*i32"},
                                "T S N HKV num_splits split_size scale sqb sqh sqt skb skh sks snb snh sns svb svh svs",
                                ""),
    "_attention_combine_kernel": ({"acc_in": "*fp32", "ml_in": "*fp32", "count": "*i32"},
                                  "T HKV num_splits split_size", ""),
    "_argmax_kernel": ({"index": "*i64", "top_out": "*fp32", "index_out": "*i64"}, "M V sx CHUNK", ""),
}
LINEAR = dict(HAS_BIAS=True, HAS_RES=False, NORM=False, HAS_GAIN=False, GATED=False, UPCAST=False, IEEE=False,
              SPLIT=1, RNE=False, FUSED=False, BM=16, BN=64, BK=128, NB=256, PF_LINES=8, PF_STEP=64)
# name -> (kernel, its constexprs, launch options): the linear variants the runtime launches and each other kernel
CASES = {
    "linear split fused residual": ("_linear_kernel", dict(LINEAR, HAS_RES=True, SPLIT=4, FUSED=True, PF_LINES=4),
                                    dict(num_warps=4, num_stages=4)),
    "linear norm": ("_linear_kernel", dict(LINEAR, NORM=True, HAS_GAIN=True), dict(num_warps=4, num_stages=6)),
    "linear gated residual": ("_linear_kernel", dict(LINEAR, GATED=True, HAS_RES=True, HAS_BIAS=False),
                              dict(num_warps=4, num_stages=6)),
    "sum_splits": ("_sum_splits_kernel", dict(HAS_BIAS=True, HAS_RES=True, RNE=False, SPLIT=4, BLOCK=1024), {}),
    "rms_norm": ("_rms_norm_kernel", dict(HAS_WEIGHT=True, RNE=False, R=1, NB=256), {}),
    "silu_mul": ("_silu_mul_kernel", dict(RNE=False, R=1, BLOCK=1024), {}),
    "rope qk-norm": ("_rope_kernel", dict(NORM=True, R=1, D=128, DP=128, RNE=False), dict(enable_fp_fusion=False)),
    "attention split fused": ("_attention_split_kernel", dict(G=4, GP=4, D=128, DP=128, BLOCK=16, SB=16, FUSED=True),
                              dict(num_warps=2, enable_fp_fusion=False)),
    "attention combine": ("_attention_combine_kernel", dict(G=4, GP=4, D=128, DP=128, SB=16), dict(enable_fp_fusion=False)),
    "argmax mapped": ("_argmax_kernel", dict(R=1, BLOCK=1024, MAPPED=True), {}),
}


def compiled(fn, name: str, constexprs: dict, options: dict, until: str = "ttir") -> dict:
    """fn (a JITFunction of KERNELS[name]'s arguments) compiled for TARGET with PDL on, through the
    stages up to `until` ("ttir"; "cubin" runs ptxas) -> {stage: text}. Triton's own pipeline, without
    its on-disk cache (each call compiles)."""
    from triton._C.libtriton import ir
    from triton.compiler.compiler import ASTSource, make_backend

    pointers, scalars, _ = KERNELS[name]
    floats = {"eps", "scale"}
    constexprs = dict(constexprs, PDL=True)
    signature = {arg: ("constexpr" if arg in constexprs else "fp32" if arg in floats else "i32" if arg in scalars.split()
                       else pointers.get(arg, "*bf16")) for arg in fn.arg_names}
    backend = make_backend(TARGET)
    source = ASTSource(fn, signature, constexprs)
    opts = backend.parse_options(dict(options, launch_pdl=True, **source.parse_options()))
    context = ir.context()
    ir.load_dialects(context)
    backend.load_dialects(context)
    module = source.make_ir(TARGET, opts, backend.get_codegen_implementation(opts), backend.get_module_map(), context)
    stages, out, metadata = {}, {}, {}
    backend.add_stages(stages, opts, source.language)
    for stage, run in stages.items():
        module = run(module, metadata)
        out[stage] = len(module) if isinstance(module, bytes) else str(module)  # the cubin: its size
        if stage == until:
            break
    return out


def case(label: str, until: str = "ttir", kernel=None) -> dict:
    name, constexprs, options = CASES[label]
    return compiled(kernel or getattr(K, name), name, constexprs, options, until)


def waits(line: str) -> bool:
    """The grid-dependency wait: Triton's op, or (Triton <= 3.6) its inline asm."""
    return "tt.grid_dependency_wait" in line or "griddepcontrol.wait" in line


ACCESS = re.compile(r"\b(tt\.load|tt\.store|tt\.atomic_\w+|tt\.elementwise_inline_asm)\b")


def early_accesses(label: str, ttir: str) -> list[str]:
    """The TTIR ops of CASES[label] that touch memory through a pointer derived from an argument other
    than its constant parameters before the wait (or all of them without a wait in the top-level block),
    and a complaint for a wait nested in a region. Each SSA value's pointer arguments are traced through
    every op's operands, and a loop's or if's results and block arguments through what it yields, to a
    fixed point. (The function's arguments are matched by position: TTIR may name one after a variable
    it is assigned to.)"""
    name, constexprs, _ = CASES[label]
    allowed = set(KERNELS[name][2].split())
    params = [a for a in inspect.signature(getattr(K, name).fn).parameters if a not in constexprs and a != "PDL"]
    body = ttir[ttir.index("tt.func public"):].splitlines()
    opens = next(i for i, line in enumerate(body) if line.rstrip().endswith("{"))  # the header's last line
    header = re.findall(r"%([\w.]+): (\S+)", "\n".join(body[:opens + 1]))
    assert len(header) == len(params), (header, params)
    roots: dict[str, set] = {ssa: {param} for (ssa, ty), param in zip(header, params) if ty.startswith("!tt.ptr")}
    lines = body[opens + 1:]
    found, changed = [], True
    while changed:
        changed, regions = False, []
        for line in lines:
            code = line.split(" loc(")[0]
            results = re.findall(r"%([\w.]+)(?::\d+)?", code.split(" = ")[0]) if " = " in code.split('"')[0] else []
            used = set().union(*(roots.get(u, set()) for u in re.findall(r"%([\w.]+)", code.split(" = ", 1)[-1])))
            if "scf.yield" in code and regions and regions[-1] is not None:
                results = regions[-1]  # the enclosing loop's / if's results and block arguments
            if "scf.for" in code:  # its block arguments: the induction variable and the iter_args
                results = results + re.findall(r"%([\w.]+) = ", code.split(" = ", 1)[1])
            for r in results:
                if not used <= roots.setdefault(r, set()):
                    roots[r] |= used
                    changed = True
            opened, closed = code.count("{"), code.count("}")
            if opened > closed:  # a region opens: an scf op's results receive its yields
                regions.append(results if re.search(r"\bscf\.(for|if|while)\b", code) else None)
            elif closed > opened and regions:
                regions.pop()
    depth, waited = 0, False
    for line in lines:
        code = line.split(" loc(")[0]
        if waits(code):
            if depth:
                found.append(f"a wait inside a region: {code.strip()}")
            waited = True
        elif ACCESS.search(code) and not waited:
            ptr = re.findall(r"%([\w.]+)", code.split(" = ", 1)[-1].split(ACCESS.search(code).group(1), 1)[1])
            touched = roots.get(ptr[0], set()) if ptr else set()
            if touched - allowed:
                found.append(f"{', '.join(sorted(touched - allowed))}: {code.strip()}")
        depth += code.count("{") - code.count("}")
    return found if waited else found + ["no grid-dependency wait in the kernel's top-level block"]


MEMORY = re.compile(r"^(st|ld|atom|red|cp|bra|mbarrier|multimem|tensormap)\b")


def early_ptx(ptx: str) -> list[str]:
    """PTX instructions before the first griddepcontrol.wait that touch memory (but its parameters and
    an L2 prefetch) or branch (the wait would not be in the entry block, run by every program)."""
    body = ptx[ptx.index(".entry"):]
    if "griddepcontrol.wait" not in body:
        return ["no griddepcontrol.wait"]
    found = []
    for line in body[:body.index("griddepcontrol.wait")].splitlines():
        op = re.sub(r"^@!?%p\d+\s+", "", line.strip())
        if MEMORY.match(op) and not op.startswith("ld.param"):
            found.append(op)
    return found


def planted(kernel, *edits: tuple[str, str]):
    """A kernel with its source edited (each old -> new): a JITFunction of the same globals."""
    source = inspect.getsource(kernel.fn)
    for old, new in edits:
        assert old in source, old
        source = source.replace(old, new)
    source = source[source.index("def "):]  # without the decorator
    filename = f"<planted {kernel.__name__}>"
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    scope = dict(kernel.fn.__globals__)
    exec(compile(source, filename, "exec"), scope)
    return triton.jit(scope[kernel.__name__])


WAIT = "    if PDL:\n        tl.extra.cuda.gdc_wait()\n        tl.extra.cuda.gdc_launch_dependents()\n"
ROPE_STORE = "    tl.store(dst[:, None] + d[None, :], _round(y, ty, RNE), mask=inside)\n"


def compile_all() -> dict:
    """What the tests check, compiled natively (run in a process of its own: a process that imported
    Triton under the interpreter has interpreted helpers in triton.language itself): every CASES entry
    to TTIR; linear (split, fused, residual) and rope down to the cubin; planted, the RMSNorm prologue's
    row statistics read before the wait (linear with its norm) and rope's wait moved after its store,
    to PTX."""
    out = {label: case(label) for label in CASES}
    for label in ("linear split fused residual", "rope qk-norm"):
        out[label] = case(label, "cubin")
    stats = "    if NORM:\n        rstd = _rstd(x, rm, sxm, sxk, M, K, eps, BM, NB)\n"
    trigger, prefetch = "        tl.extra.cuda.gdc_launch_dependents()\n", "    if PDL:\n        if PF_LINES"
    early_load = planted(K._linear_kernel, (trigger + stats, trigger), (prefetch, stats + prefetch))  # moved up
    out["planted: linear norm, a load before the wait"] = case("linear norm", "ptx", early_load)
    late_wait = planted(K._rope_kernel, (WAIT, ""), (ROPE_STORE, ROPE_STORE + WAIT))
    out["planted: rope, its store before the wait"] = case("rope qk-norm", "ptx", late_wait)
    return out


@pytest.fixture(scope="module")
def compiled_ir(tmp_path_factory) -> dict:
    """compile_all() in a child process with the interpreter off (6-9 s on a shared 2-core machine at load
    3-4, cold or not: it bypasses Triton's cache)."""
    path = tmp_path_factory.mktemp("pdl") / "ir.json"
    env = dict(os.environ, TRITON_INTERPRET="0")
    done = subprocess.run([sys.executable, __file__, str(path)], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(path.read_text())


def test_no_kernel_touches_what_another_writes_before_its_wait(compiled_ir):
    """Every kernel and the linear variants the runtime launches (split with fused counters, RMSNorm
    prologue, gated prologue, residual epilogue), TTIR."""
    found = {label: early_accesses(label, compiled_ir[label]["ttir"]) for label in CASES}
    assert {label: problems for label, problems in found.items() if problems} == {}


def test_the_linear_kernel_prefetches_its_weights_and_nothing_else_before_the_wait(compiled_ir):
    """Linear (split, fused counters, residual) and rope, down to the cubin (ptxas, sm_90): before the
    wait, nothing but the weight's L2 prefetches and the kernel's parameters; after it, the trigger."""
    for label in ("linear split fused residual", "rope qk-norm"):
        out = compiled_ir[label]
        assert early_ptx(out["ptx"]) == [] and out["cubin"] > 0, label
        assert "griddepcontrol.launch_dependents" in out["ptx"], label
    ptx = compiled_ir["linear split fused residual"]["ptx"]
    before = ptx[ptx.index(".entry"):ptx.index("griddepcontrol.wait")]
    # BN = 64 rows x PF_LINES = 4 lines, spread over 4 warps' 128 threads: 2 a thread
    assert before.count("prefetch.global.L2") == 64 * 4 // 128


def test_a_load_or_a_store_before_the_wait_is_flagged(compiled_ir):
    """Planted: an activation load before the wait (linear's RMSNorm statistics), and a store before it
    (rope's wait moved after its store): both flagged in the TTIR and in the PTX."""
    out = compiled_ir["planted: linear norm, a load before the wait"]
    assert any(problem.startswith("x:") and "tt.load" in problem for problem in early_accesses("linear norm", out["ttir"]))
    assert any(op.startswith("ld.global") for op in early_ptx(out["ptx"]))
    out = compiled_ir["planted: rope, its store before the wait"]
    problems = early_accesses("rope qk-norm", out["ttir"])
    assert any("tt.store" in problem for problem in problems) and any("tt.load" in problem for problem in problems)
    assert any(op.startswith("st.global") for op in early_ptx(out["ptx"]))


def test_pdl_is_on_natively_on_a_card_of_compute_capability_9_and_off_by_its_switch(monkeypatch):
    """_pdl's options: on for a CUDA device of capability >= 9.0 (cached per device), off on a CPU,
    under the interpreter, on an older card, and with _PDL off (EAGLE_EXPORT_NO_PDL=1)."""
    import torch

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index: {0: (9, 0), 1: (8, 0), 2: (10, 0)}[index])
    K._pdl_card.cache_clear()
    try:
        monkeypatch.setattr(K, "INTERPRETED", False)
        on = [K._pdl(torch.device(d))["PDL"] for d in ("cuda:0", "cuda:1", "cuda:2", "cpu")]
        assert on == [True, False, True, False] and K._pdl(torch.device("cuda:0")) == {"PDL": True, "launch_pdl": True}
        monkeypatch.setattr(K, "_PDL", False)
        assert not K._pdl(torch.device("cuda:0"))["launch_pdl"]
        monkeypatch.setattr(K, "_PDL", True)
        monkeypatch.setattr(K, "INTERPRETED", True)
        assert K._pdl(torch.device("cuda:0")) == {"PDL": False, "launch_pdl": False}
    finally:
        K._pdl_card.cache_clear()


def test_the_weight_prefetch_is_the_pipelines_first_loads_and_at_most_1_kb_a_row():
    """_prefetch_lines: a power of 2, <= 1 KB a row and <= the (stages - 1) BK steps the pipeline loads
    before its first dot (none where that is less than a line), at linear_config's configurations (and
    fp32's fewer stages); none for a weight whose rows are strided."""
    import torch

    for dtype in (torch.bfloat16, torch.float32):
        weight = torch.empty(8, 8, dtype=dtype)
        for bk, stages in ((256, 3), (128, 6), (128, 4), (128, 1), (32, 2)):
            lines, first = K._prefetch_lines(bk, stages, weight), max(1, stages - 1) * bk * weight.element_size()
            assert lines & (lines - 1) == 0 and 128 * lines <= min(1024, first) and (lines > 0 or first < 128)
    assert K._prefetch_lines(256, 3, torch.empty(8, 8, dtype=torch.bfloat16)) == 8  # the 8B shape's qkv/gate_up: 2 BK steps
    assert K._prefetch_lines(128, 4, torch.empty(8, 8, dtype=torch.bfloat16)) == 4  # its split-K o/down: 2 steps
    assert K._prefetch_lines(128, 6, torch.empty(8, 8).t()) == 0


def test_the_gpu_probes_pdl_ab_reads_its_rounds_as_medians_and_bandwidth():
    """scripts/gpu_probe.py pdl (run only on a GPU): its command line, and its summary of the interleaved
    rounds: each side's median step, spread and achieved bandwidth against the peak and the copy."""
    spec = importlib.util.spec_from_file_location("gpu_probe", Path(__file__).parents[1] / "scripts" / "gpu_probe.py")
    probe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(probe)
    assert probe.parser().parse_args(["pdl", "--budget-s", "35"]).what == "pdl"
    cell = probe.pdl_summary({True: [4.0, 4.8, 4.0], False: [8.0, 8.1, 7.9]}, 19_200_000_000, 4.8e12, 3.84e12)
    assert cell["pdl"]["step_ms"] == 4.0 and cell["pdl"]["spread_ms"] == 0.8 and cell["pdl"]["achieved_gb_s"] == 4800
    assert cell["pdl"]["share_of_peak"] == 1.0 and cell["plain"]["share_of_peak"] == 0.5
    assert cell["plain"]["share_of_copy"] == 0.625
    assert cell["pdl_over_plain"] == 0.5 and cell["rounds"] == 3
    assert "100% of peak" in probe.pdl_line(cell) and "0.500x" in probe.pdl_line(cell)
    assert "of peak" not in probe.pdl_line(probe.pdl_summary({True: [1.0], False: [2.0]}, 10**9, None, 1e12))


if __name__ == "__main__":  # compiled_ir's child process
    Path(sys.argv[1]).write_text(json.dumps(compile_all()))
