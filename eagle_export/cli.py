"""The `eagle-export` command line. Errors from bad input print as one clear message, no traceback."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import sys
import tempfile
import traceback
from pathlib import Path

import click

from . import __version__, progress
from .errors import EagleExportError
from .models.contract import MAX_DEPTH

# torch's OpenMP workers spin on the cores for a while after each parallel region (libgomp's default),
# and ONNX Runtime's threads need those cores for every graph call: on a 2-core machine that made
# plain decoding steps and speculative rounds alike slower (see README "Threads on a CPU"). Passive
# waiting has to be chosen before torch loads libgomp, so the command line sets it; a user's own
# OMP_WAIT_POLICY wins, and library users set it themselves.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def _refuse(e: EagleExportError):
    click.echo(f"error: {e.problem}", err=True)
    if e.fix:
        click.echo(f"  fix: {e.fix}", err=True)
    sys.exit(2)


class _Group(click.Group):
    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except EagleExportError as e:
            _refuse(e)
        except KeyboardInterrupt:  # one line and the shell's convention (128 + SIGINT), not click's "Aborted!"
            click.echo("interrupted (Ctrl-C)", err=True)
            sys.exit(130)
        except (click.exceptions.ClickException, click.exceptions.Exit, click.exceptions.Abort):
            raise  # click's own: usage errors, --help, Ctrl-C at a prompt
        except BrokenPipeError:  # `eagle-export inspect BUILD | head`: the reader has all it wanted
            with contextlib.suppress(Exception):  # (no flush of what is left at exit: it would fail again)
                os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            sys.exit(141)  # 128 + SIGPIPE, as a shell reports a writer whose reader left
        except Exception as e:  # the last line only: bad input is caught where it enters, as EagleExportError
            if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):  # the machine's state, not a bug
                from .files import file_error

                _refuse(file_error(e.filename or "the output", e))
            with tempfile.NamedTemporaryFile("w", prefix="eagle-export-error-", suffix=".log", delete=False) as log:
                traceback.print_exc(file=log)
            click.echo(f"error: internal error ({type(e).__name__}: {str(e)[:300]})", err=True)
            click.echo(f"  fix: this is a bug in eagle-export; report it with the traceback in {log.name}", err=True)
            sys.exit(3)


# --exact, one option for every command that runs a build
exact_option = click.option(
    "--exact/--no-exact", default=None,
    help="Torch backend on a CUDA GPU (Triton): the target and drafter bound once to width-invariant kernels, so "
         "speculative output is bit-identical to plain decoding in bf16, fp16 and fp32. Default: on wherever the "
         "kernels hold (one note: line says why not where they do not); --exact insists (refused, before any model "
         "loads, where it cannot hold); --no-exact runs cuBLAS and torch attention, under the tiered contract.")


def utf8(ctx, param, value):
    """An argument that is not valid UTF-8 (the shell passed undecodable bytes) is refused at once."""
    for text in (value if isinstance(value, tuple) else (value,)):
        try:
            text is None or text.encode("utf-8")
        except UnicodeEncodeError:
            raise EagleExportError(f"{param.opts[-1] if param.opts else param.name} is not valid UTF-8 text "
                                   f"({text.encode('utf-8', 'backslashreplace').decode()[:80]})",
                                   "pass UTF-8 text (check the terminal's locale and the file name)") from None
    return value


def output_file(ctx, param, value):
    """A file the command writes (--json, --report, --plot): checked as the command line is read, so
    before any model loads (`output_dir.output_file`); an empty value writes none."""
    utf8(ctx, param, value)
    if value:
        from .output_dir import output_file as check

        check(value)
    return value


def output_directory(ctx, param, value):
    """A directory the command creates (-o): checked as the command line is read (`output_dir.output_directory`)."""
    utf8(ctx, param, value)
    if value is not None:
        from .output_dir import output_directory as check

        check(value)
    return value


ALLOW_CHANGED_SOURCES = click.option(
    "--allow-changed-sources", is_flag=True,
    help="Read a build's source checkpoints even where they changed since the build (said in one line); without "
         "it, a checkpoint whose files differ from the hashes the build recorded is refused.")


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="eagle-export")
@click.option("-q", "--quiet", is_flag=True,
              help="No progress bars, only the plain stage lines (as when stderr is not a terminal).")
def main(quiet):
    """Compile EAGLE-3 / EAGLE-3.1 drafters and their target LLMs to ONNX graphs, and to TensorRT engines
    where TensorRT and an NVIDIA GPU are present (`eagle-export doctor` says which).

    On a terminal, long loops (calibration, evaluation, validation, bench, the sample target's
    conversion) draw a progress bar with ETA on stderr; logs get the stage lines only."""
    progress.QUIET = quiet


@main.command()
@click.argument("path", type=click.Path())
@click.option("--target", type=click.Path(), help="Target directory to check a drafter against.")
@click.option("--check", is_flag=True,
              help="Run the drafter under its config's conventions and each plausible alternative (needs --target).")
@click.option("--strict", is_flag=True, help="With --check: exit 1 when a field is named or no convention matches.")
@click.option("--prompts", default="mt-bench", show_default=True,
              help="With --check: mt-bench (or mtbench), sharegpt (chat-templated), or a text file (one prompt a "
                   "line, as is).")
@click.option("--num-prompts", default=16, show_default=True, type=int, help="With --check: how many prompts.")
@click.option("--new-tokens", default=0, show_default=True, type=int,
              help="With --check: greedy answer tokens to append (0: teacher-force on the prompts alone).")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def inspect(path, target, check, strict, prompts, num_prompts, new_tokens, as_json):
    """Say what a checkpoint directory holds (target or drafter) and what does not fit, or what a build
    directory holds (its pair, how it speculates, its graphs and engines)."""
    from .builder.manifest import MANIFEST, inspect_build  # a build is read from its manifest: no torch imported

    if check and target is None:
        raise click.UsageError("--check runs the drafter against a target: pass --target TARGET_DIR")
    if check and (num_prompts < 1 or new_tokens < 0):  # (0 prompts reported "matches no convention")
        raise EagleExportError(f"--num-prompts {num_prompts} and --new-tokens {new_tokens}: the check needs 1 prompt "
                               "or more and 0 answer tokens or more", "pass e.g. --num-prompts 16 --new-tokens 0")
    is_build = os.path.lexists(Path(path) / MANIFEST)  # (one that cannot be read is named by inspect_build)
    if not is_build and not os.path.lexists(Path(path) / "config.json"):
        what = ("does not exist" if not os.path.lexists(path) else "is not a directory" if not os.path.isdir(path)
                else f"holds neither {MANIFEST} (a build) nor config.json (a checkpoint)")
        raise EagleExportError(f"{path} {what}", "pass a build directory (made by `eagle-export build`) or a "
                               "checkpoint directory (config.json + *.safetensors)")
    if is_build and check:
        raise click.UsageError("--check runs a drafter checkpoint: pass the drafter directory, not a build")
    if is_build:
        report = inspect_build(path)
    else:
        from .models.checkpoint_info import inspect_checkpoint

        report = inspect_checkpoint(path, target)
    if check:
        from .builder.conformance import check_checkpoint, check_prompts
        from .data.prompts import ChatTemplate, prompt_set_name

        prompts = check_prompts(target, prompt_set_name(prompts), num_prompts)
        if ChatTemplate(target).note and not as_json:
            click.echo(f"note: {ChatTemplate(target).note}")
        report["conformance"] = check_checkpoint(path, target, prompts, new_tokens)
    if as_json:
        click.echo(json.dumps(report, indent=2))
    else:
        for key, value in report.items():
            if key not in ("warnings", "conformance"):
                click.echo(f"{key:24} {_plain(value)}")
        for w in report["warnings"]:
            click.echo(f"warning: {w}")
        if check:
            _echo_conformance(report["conformance"])
    if strict and check and not report["conformance"]["ok"]:
        sys.exit(1)


def _plain(value) -> str:
    """A report value as a reader writes it: lists comma-separated, None as '-', no Python reprs."""
    if value is None:
        return "-"
    if isinstance(value, (list, tuple)):
        return ", ".join(_plain(v) for v in value) or "-"
    if isinstance(value, dict):
        return ", ".join(f"{k} {_plain(v)}" for k, v in value.items()) or "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    return str(value)


def _echo_conformance(result: dict) -> None:
    from .builder.conformance import gate_line

    click.echo(f"conformance: teacher-forced acc@1 at steps 0 / 1, and the log-probability of the target's token "
               f"gained over the configured reading (nats per position), over {result['positions']} positions "
               f"of {result['prompts']} prompts (aux ids {result['aux_layer_ids']}, vLLM numbering)")
    for row in result["readings"]:
        gains = " / ".join(f"{g:+.3f} [{lo:+.3f}, {hi:+.3f}]" for g, (lo, hi) in zip(row["gain"], row["interval"]))
        click.echo(f"  {row['reading']:32} {row['acc@1'][0]:.3f} / {row['acc@1'][1]:.3f}   {gains}")
    for finding in result["findings"]:
        click.echo(f"finding: {finding['message']}")
    if not result["matched"]:
        click.echo(f"finding: this drafter matches no convention: acc@1 below {result['min_acc']} under every "
                   "reading (is it trained for this target, and is this config.json its own?)")
    elif gate_line(result):
        click.echo(f"finding: {gate_line(result)[2:]}")
    if result["matched"] and result["ok"]:
        click.echo(f"conformance ok: no alternative reading gives the target's tokens more than {result['min_gain']} "
                   f"nats per position over the config with its {result['level']:.0%} interval above 0")


@main.command("sample-target")
def sample_target():
    """Print the sample target's directory (SmolLM2-135M-Instruct), converting it on first use."""
    from .data.sample import sample_target_dir

    click.echo(str(sample_target_dir()))


@main.command()
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def doctor(as_json):
    """Report torch, CUDA, TensorRT, ONNX Runtime and ModelOpt, the GPU, and what can be built here."""
    from .tools.doctor import doctor_report

    report = doctor_report()
    if as_json:
        click.echo(json.dumps(report, indent=2))
        return
    gpu = report["gpu"]
    click.echo(f"python        {report['python']}")
    cuda = (f"CUDA {report['cuda'] or 'none'}, available: {'yes' if report['cuda_available'] else 'no'}"
            if report["nvidia_driver"] else "no NVIDIA driver, so no CUDA")
    click.echo(f"torch         {report['torch']} ({cuda})")
    click.echo(f"gpu           {gpu['name'] + ' (compute capability ' + gpu['compute_capability'] + ')' if gpu else 'none'}")
    click.echo(f"tensorrt      {report['tensorrt'] or 'not installed'}")
    click.echo(f"onnxruntime   {report['onnxruntime']} ({', '.join(report['onnxruntime_providers'])})")
    click.echo(f"onnx          {report['onnx']}")
    click.echo(f"modelopt      {report['modelopt'] or 'not installed'}")
    click.echo("can build:")
    for precision, verdict in report["can_build"].items():
        click.echo(f"  {precision:6} {verdict}")
    for line in report["advice"]:
        click.echo(f"advice: {line}")


@main.command()
@click.option("--recipe", type=click.Path(), callback=utf8, help="Recipe YAML (default: the sample, SmolLM2-135M + EAGLE-3.1).")
@click.option("-o", "--out", "out_dir", default="builds/sample", show_default=True, type=click.Path(),
              callback=output_directory,
              help="Build directory to create.")
@click.option("--force", is_flag=True, help="Replace an existing build directory (only once the new one is complete).")
@click.option("--target", help="Override the recipe's target directory ('sample' for the sample target).", callback=utf8)
@click.option("--drafter", help="Override the recipe's drafter directory.", callback=utf8)
@click.option("--depth", type=int, help=f"Override the speculation depth K (1..{MAX_DEPTH}).")
@click.option("--set", "sets", multiple=True, metavar="KEY=VALUE", callback=utf8,
              help="Override any recipe key, e.g. --set precision.target=fp8 (repeatable).")
@click.option("--skip-conformance", is_flag=True,
              help="Build even when the drafter matches no convention (an untrained drafter, for a pipeline smoke "
                   "test): the check still runs and says so; the manifest records it and `inspect` prints it.")
def build(recipe, out_dir, force, target, drafter, depth, sets, skip_conformance):
    """Build ONNX graphs (and TensorRT engines where TensorRT and a GPU are present), a manifest, and its
    validation, from a recipe."""
    from .builder.recipe import load_recipe, pair_recipe, parse_override, resolve_sources

    overrides, flags = dict(parse_override(s) for s in sets), {}
    for key, value in (("target", target), ("drafter", drafter), ("depth", depth)):
        if value is not None:
            overrides[key], flags[key] = value, f"--{key} {value}"
    # a bad recipe or a missing checkpoint is refused before torch is imported
    loaded = load_recipe(recipe, overrides, flags)
    if recipe is None and resolve_sources(loaded) != resolve_sources(load_recipe()):  # not the sample's pair
        loaded = pair_recipe(target, drafter, overrides, flags)
        click.echo(f"recipe {loaded['name']}, derived {loaded['derived']} (--recipe FILE to give your own)")
    resolve_sources(loaded)
    from .builder.build import build as run_build

    manifest = run_build(loaded, out_dir, force=force, echo=click.echo, skip_conformance=skip_conformance)
    checks = manifest.validation["checks"]
    passed, skipped = sum(c["ok"] is True for c in checks), sum(c["ok"] is None for c in checks)
    click.echo(f"built {out_dir}: {len(manifest.artifacts)} artifacts, backends "
               f"{', '.join(manifest.backends)}; validation {passed}/{len(checks)} checks passed"
               + (f", {skipped} skipped (`eagle-export validate` says why)" if skipped else ""))


@main.command("train-drafter")
@click.option("--target", required=True, type=click.Path(), callback=utf8, help="The target checkpoint directory.")
@click.option("-o", "--out", "out_dir", required=True, type=click.Path(), callback=output_directory,
              help="The drafter directory to write (vLLM's EAGLE-3 layout, as `build --drafter` reads).")
@click.option("--minutes", default=4.0, show_default=True, type=float,
              help="Wall-clock budget: data, held-out data and training together.")
@click.option("--tokens", type=int, help="Stop training after this many training tokens (if before --minutes).")
@click.option("--version", "eagle_version", type=click.Choice(["3", "3.1"]), default="3", show_default=True,
              help="EAGLE-3, whose first step starts as the target's last layer (a usable drafter in minutes on a "
                   "CPU), or EAGLE-3.1 (fc_norm, post-norm feedback: its normed inputs need longer training).")
@click.option("--force", is_flag=True, help="Replace a drafter an earlier train-drafter wrote.")
def train_drafter(target, out_dir, minutes, tokens, eagle_version, force):
    """Train a small EAGLE drafter for TARGET on this machine (CPU) in minutes, and say how good it is
    (held-out acc@1 and tau). For pipeline work on your own target; a public drafter trained on a GPU
    for days is far better where one exists."""
    if not 0 < minutes < float("inf") or (tokens is not None and tokens <= 0):  # (nan trained without end)
        raise click.UsageError("--minutes and --tokens must be positive (and --minutes finite)")
    from .models.config import read_config_json

    read_config_json(target)  # a directory that is not a checkpoint is refused before the data is read
    from .samples.train_drafter import train_for_target

    train_for_target(target, out_dir, minutes, tokens, eagle_version, force, echo=click.echo)


@main.command()
@click.argument("build_dir", type=click.Path())
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@exact_option
def validate(build_dir, as_json, exact):
    """Re-check a build: artifact hashes, graphs against torch, and the lossless loop. Exit 1 on failure."""
    from .builder.manifest import require_build

    require_build(build_dir)  # a missing or unreadable build is named before torch is imported
    from .builder.validate import validate as run_validate

    label = {True: "ok  ", False: "FAIL", None: "SKIP"}

    def echo_check(name, ok, detail):  # each check printed as it finishes (the slow ones take minutes)
        click.echo(f"{label[ok]}  {name}: {detail}")

    report = run_validate(build_dir, on_check=None if as_json else echo_check, exact=exact)
    if as_json:
        click.echo(json.dumps(report, indent=2))
    if not report["ok"]:
        sys.exit(1)


@main.command()
@click.argument("build_dir", type=click.Path())
@click.option("--prompt", multiple=True, help="Raw text to continue (repeatable: one request each).", callback=utf8)
@click.option("--chat", multiple=True, help="A user message, wrapped in the model's chat template (repeatable).",
              callback=utf8)
@click.option("--max-new-tokens", default=128, show_default=True, type=int,
              help="Stop each request after this many new tokens (or earlier at end of sequence).")
@click.option("--temperature", default=0.0, show_default=True, type=float, help="0 decodes greedily (lossless).")
@click.option("--top-p", default=1.0, show_default=True, type=float,
              help="With --temperature > 0: sample from the smallest set of tokens holding this probability.")
@click.option("--backend", default="auto", show_default=True, help="auto, tensorrt, onnxruntime or torch.")
@click.option("--cuda-graphs/--no-cuda-graphs", default=None,
              help="Torch backend on a GPU: static caches and one CUDA graph per call width (verify T=1..K+1, "
                   "the drafter's K+1 rows), as vLLM and gpt-fast do. Default: on when torch runs on CUDA.")
@click.option("--verify-policy", "--depth-policy", "verify_policy", default="goodput", show_default=True,
              type=click.Choice(["goodput", "fixed"]),
              help="How much of each round's drafted tree to verify. goodput: the subtree (0..all its nodes, or no "
                   "drafter call) with the most expected tokens per second on the measured costs; fixed: all of it. "
                   "(--depth-policy: its former name.)")
@click.option("--json", "as_json", is_flag=True,
              help="Print one JSON object per request, a line each (tokens, text, finish reason, stats), not text.")
@ALLOW_CHANGED_SOURCES
@exact_option
def run(build_dir, prompt, chat, max_new_tokens, temperature, top_p, backend, cuda_graphs, verify_policy, as_json,
        allow_changed_sources, exact):
    """Generate from a build, streaming the text, then per request one summary line (tau, tokens/s) and
    one saying why it did or did not speculate (acceptance seen against this machine's break-even).

    Requests run one after another, so each one's time split is its own."""
    if bool(prompt) == bool(chat):  # before the heavy imports: a usage error answers at once
        raise click.UsageError("pass --prompt TEXT or --chat TEXT (either, as often as you like)" if not prompt
                               else "pass --prompt or --chat, not both")
    from dataclasses import replace

    from .builder.manifest import require_build
    from .runtime.generation import GenerationConfig

    config = GenerationConfig(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p)
    require_build(build_dir)  # bad settings and a missing build are said before torch is imported
    from .builder.build_dir import open_build
    from .builder.manifest import old_format_note
    from .runtime.runtime import request_record
    from .runtime.verify_policy import explain

    opened = open_build(build_dir, backend=backend, verify_policy=verify_policy, cuda_graphs=cuda_graphs,
                        allow_changed_sources=allow_changed_sources, exact=exact)
    old = old_format_note(opened.manifest, build_dir)
    if old:
        click.echo(f"note: {old}", err=True)
    requests = [opened.chat_prompt(c) for c in chat] or [opened.encode(p) for p in prompt]
    if chat and opened.chat_template().note:
        click.echo(f"note: {opened.chat_template().note}", err=True)
    config = replace(config, eos_ids=opened.eos_ids)
    runtime = opened.runtime
    for ids in requests:  # a refused run writes nothing (not even the cost cache)
        runtime.check_requests([ids], config)
    if verify_policy == "goodput":  # costs are measured once per machine (cached in the build), before the clock
        _measure_costs(runtime)
    for i, ids in enumerate(requests):
        if as_json:
            [result] = runtime.generate([ids], config)
            click.echo(json.dumps({"request": i, "backend": runtime.backend.name,
                                   **request_record(result, runtime.depth, runtime.timings),
                                   "speculation": explain(verify_policy, result.stats, runtime.costs, runtime.depth)}))
            continue
        tokens, shown = [], ""
        for event in runtime.stream([ids], config):
            tokens.extend(event.tokens)
            text = opened.tokenizer.decode(tokens) if opened.tokenizer else " ".join(map(str, tokens))
            if not text.endswith("\ufffd"):  # wait for the rest of a multi-byte character
                click.echo(text[len(shown):], nl=False)
                shown = text
        stats, seconds = event.stats, runtime.timings.total  # the sequence's last event carries its stats
        click.echo(f"\n[{runtime.backend.name}] {stats.new_tokens} tokens in {seconds:.2f} s "
                   f"({stats.new_tokens / seconds:.1f} tokens/s), tau {stats.tau:.2f} over {stats.rounds} rounds "
                   f"({stats.draft_calls} with a drafter call)")
        click.echo(explain(verify_policy, stats, runtime.costs, runtime.depth))


def _measure_costs(runtime) -> None:
    """The goodput policy's cost curves at batch 1, measured on first use and said so on stderr (once:
    they are cached per backend and machine)."""
    import time

    if runtime.costs.has(1):
        return
    where = runtime.cost_cache.path if runtime.cost_cache is not None else None
    click.echo(f"measuring what a drafter call and a verify call of each width cost on this machine, for the "
               f"goodput verify policy (once{f'; cached in {where}' if where else ''}) ...", err=True)
    start = time.perf_counter()
    runtime.cost_curves(1)
    click.echo(f"measured in {time.perf_counter() - start:.1f} s", err=True)


# gpu-kit's steps by the names --steps takes (tools/gpu_kit.step_key names each step of the report so)
KIT_STEPS = ("lossless", "eager", "fp32", "cost", "costs", "sweep", "export")


@main.command("gpu-kit")
@click.option("--shapes", default="llama-3.2-1b,llama-3.1-8b,qwen3-8b", show_default=True,
              help="Real configs to make with random weights (llama-3.2-1b, llama-3.1-8b, qwen3-8b), or tiny (a CPU run).")
@click.option("--report", default="gpu-kit.json", show_default=True, type=click.Path(), callback=output_file,
              help="The JSON report.")
@click.option("--plot", "plot_file", default="gpu-kit.png", show_default=True, type=click.Path(), callback=output_file,
              help="Speedup against synthetic acceptance per shape and batch (needs eagle-export[plot]).")
@click.option("--budget-s", default=480.0, show_default=True, type=float,
              help="Stop starting steps after this many seconds; the report keeps what was measured.")
@click.option("--export/--no-export", "export", default=True, show_default=True,
              help="Export the first shape's real-width graphs (2 decoder layers) to ONNX and check them.")
@click.option("--prompts", "num_prompts", type=click.IntRange(1), default=None,
              help="Prompts a sweep cell  [default: 16; tiny: 2]")
@click.option("--new-tokens", type=click.IntRange(1), default=None, help="Tokens a prompt  [default: 128; tiny: 8]")
@click.option("--repeats", type=click.IntRange(1), default=2, show_default=True,
              help="Passes a sweep cell, taking turns; a cell whose passes disagree by more than 5% is flagged.")
@click.option("--exact", is_flag=True,
              help="Run exact mode's steps instead (width-invariant Triton kernels): bf16 speculative == plain on every "
                   "prompt at batch 1, 4, 16 (synthetic 0.7 and 0.9 and the random drafter, chain and dynamic tree, "
                   "eager and CUDA graphs), the exact plain step's cost beside cuBLAS's at batch 1 and 16, and the "
                   "cost curves and sweep through the kernels, in bf16.")
@click.option("--steps", default="all", show_default=True,
              help="The steps to run, comma-separated, of " + ", ".join(KIT_STEPS) + " (lossless: with CUDA graphs; eager: "
              "lossless eagerly; fp32: the first shape's fp32 lossless row; cost: exact mode's plain step beside "
              "cuBLAS's): a GPU sitting picks what its minutes allow.")
@click.option("--sweep", "sweep_values", help="Uniform synthetic acceptances of the sweep, comma-separated (vLLM CI's "
              "per-depth 0.73/0.52/0.35/0.25 is always added)  [default: 0,0.2,0.4,0.6,0.8,0.9; tiny: 0,0.9]")
def gpu_kit(shapes, report, plot_file, budget_s, export, num_prompts, new_tokens, repeats, exact, steps, sweep_values):
    """Real-size shapes on a GPU with nothing but this package and torch: random-weight Llama-3.2-1B,
    Llama-3.1-8B and Qwen3-8B targets with EAGLE-3 drafters of the real shape, made on the machine;
    lossless at batch 1 and 4 (eager and CUDA graphs), cost curves at batch 1, 4, 16, the synthetic
    acceptance sweep, and the real-width graphs exported to ONNX. One JSON, one PNG."""
    import torch

    from .tools.gpu_kit import check_acceptances, check_shapes, check_steps, run_kit

    if not budget_s >= 0:  # (nan ignored the budget; below 0 skipped every step)
        raise EagleExportError(f"--budget-s {budget_s} is not a time budget", "pass seconds, 0 or more (e.g. 480)")
    if not report:  # (an empty name reached the first step's write, after the work)
        raise EagleExportError("--report '' names no file, and the kit's results go nowhere else",
                               "pass a file name, e.g. --report gpu-kit.json")
    chosen = check_shapes(shapes)
    chosen_steps = check_steps(steps, KIT_STEPS)
    values = check_acceptances(sweep_values) if sweep_values else None
    if chosen != ["tiny"] and not torch.cuda.is_available():
        click.echo("gpu-kit: no CUDA GPU here, so nothing was run (the real-size shapes need one); "
                   "--shapes tiny runs every step on this CPU")
        return
    plot = None
    if plot_file:
        from .tools.bench import pyplot

        pyplot(plot_file)  # a missing matplotlib or an unknown format fails now, not after the kit
        plot = Path(plot_file)
    run_kit(chosen, Path(report), plot, budget_s, echo=click.echo, export=export, num_prompts=num_prompts,
            new_tokens=new_tokens, repeat=repeats, exact=exact, steps=chosen_steps, values=values)
    click.echo(f"wrote {report}" + (f" and {plot_file}" if plot else ""))


@main.command()
@click.argument("build_dirs", nargs=-1, required=True, type=click.Path())
@click.option("--dataset", default="mt-bench", show_default=True, callback=utf8,
              help="mt-bench (or mtbench), humaneval, sharegpt, long (MT-bench after 1.5-3k tokens of "
                   "conversation), or a text file (one prompt a line).")
@click.option("--batch", default="1", show_default=True, help="Batch size, or several: 1,4,16.")
@click.option("--backend", default="auto", show_default=True, help="auto, tensorrt, onnxruntime or torch.")
@click.option("--cuda-graphs/--no-cuda-graphs", default=None,
              help="Torch backend on a GPU: static caches and one CUDA graph per call width (verify T=1..K+1, "
                   "the drafter's K+1 rows), as vLLM and gpt-fast do. Default: on when torch runs on CUDA.")
@click.option("--num-prompts", default=16, show_default=True, type=int, help="How many prompts of the dataset.")
@click.option("--max-new-tokens", default=128, show_default=True, type=int, help="New tokens per prompt.")
@click.option("--threads", type=int, help="ONNX Runtime intra-op threads.")
@click.option("--repeat", default=1, show_default=True, type=int,
              help="Pass over the prompts this many times, the runs still taking turns batch by batch: more batches "
                   "for the medians on a noisy machine.")
@click.option("--remeasure/--reuse-costs", default=True, show_default=True,
              help="Measure the cost curves the verify policy uses in this run, at this run's load, replacing those "
                   "cached in each build; --reuse-costs reads the cached ones (refused where two builds' curves of "
                   "the same target disagree).")
@click.option("--acceptance", help="Synthetic acceptance (a measurement, not generation): each round the real drafter "
              "runs and its drafts are replaced, draft k right with this probability given drafts 1..k-1 were; one "
              "value for every depth or one per depth (0.73,0.52,0.35).")
@click.option("--acceptance-sweep", is_flag=True,
              help="Synthetic acceptance 0, 0.1, ..., 0.9, 0.95: speedup per policy beside the cost model's, and the "
                   "break-even acceptance of this machine.")
@click.option("--json", "json_file", type=click.Path(), callback=output_file, help="Write the results as JSON.")
@click.option("--plot", "plot_file", type=click.Path(), callback=output_file,
              help="Write acceptance by depth, the cost curves, the chosen depths and the speedups as a PNG "
                   "(with --acceptance-sweep: speedup against acceptance; needs eagle-export[plot]).")
@ALLOW_CHANGED_SOURCES
@exact_option
def bench(build_dirs, dataset, batch, backend, cuda_graphs, num_prompts, max_new_tokens, threads, repeat, remeasure,
          acceptance, acceptance_sweep, json_file, plot_file, allow_changed_sources, exact):
    """Speculative decoding (goodput and fixed-K depth policies) vs autoregressive decoding on the same
    backend and prompts, side by side: tau, chosen depths, verify widths, cost curves, speedup, time split.

    BUILD_DIRS: one build, or several builds of one target to compare (a chain and a tree, say), run in
    turns on the same prompts."""
    from dataclasses import replace

    from .builder.manifest import require_build
    from .data.prompts import prompt_set
    from .output_dir import write_output
    from .runtime.generation import GenerationConfig

    dataset = prompt_set(dataset)  # every argument is checked before torch is imported
    config = GenerationConfig(max_new_tokens=max_new_tokens)
    sizes = [int(b) for b in batch.split(",") if b.strip().isdigit()]
    if len(sizes) != len(batch.split(",")) or min(sizes) < 1:
        raise EagleExportError(f"--batch {batch!r} is not a list of batch sizes",
                               "pass whole numbers of 1 or more, comma-separated, e.g. --batch 1,4,16")
    if num_prompts < 1:
        raise EagleExportError(f"--num-prompts {num_prompts} leaves nothing to measure", "pass 1 or more")
    if repeat < 1:
        raise EagleExportError(f"--repeat {repeat} leaves nothing to measure", "pass 1 or more")
    if threads is not None and threads < 0:
        raise EagleExportError(f"--threads {threads} is not a thread count",
                               "pass 1 or more, or leave it out for ONNX Runtime's default")
    if acceptance is not None and acceptance_sweep:
        raise EagleExportError("--acceptance and --acceptance-sweep both given", "pass one of them")
    if plot_file:  # a missing matplotlib or an unknown format fails now, not after the bench (this imports torch)
        from .tools.bench import pyplot

        pyplot(plot_file)
    for build_dir in build_dirs:
        require_build(build_dir)
    from .builder.build_dir import open_build
    from .data.prompts import chat_prompts
    from .runtime.costs import CostCurves
    from .speculation.synthetic import parse_acceptance
    from .tools.bench import SWEEP, cost_disagreements, plot, plot_sweep, pyplot
    from .tools.bench import bench as run_bench

    opened = {}
    for build_dir in build_dirs:
        name = build_dir if build_dir not in opened else f"{build_dir} ({len(opened) + 1})"
        opened[name] = open_build(build_dir, backend=backend, threads=threads, cuda_graphs=cuda_graphs,
                                  allow_changed_sources=allow_changed_sources, exact=exact)
    if remeasure:  # what is measured next replaces the cache's entry
        for o in opened.values():
            o.runtime.costs = CostCurves()
    first = next(iter(opened.values()))
    for name, other in opened.items():
        if other.manifest.target_identity != first.manifest.target_identity:
            raise EagleExportError(f"{name} and {first.path} are builds of different targets (checkpoint files or "
                                   "precision differ): bench compares speculation on one target",
                                   "pass builds made from the same target checkpoint at the same target precision")
    acceptances = None
    if acceptance is not None:  # checked against every build's depth before anything is measured
        acceptances = [parse_acceptance(acceptance, min(o.runtime.depth for o in opened.values()))]
    elif acceptance_sweep:
        acceptances = [(a,) * min(o.runtime.depth for o in opened.values()) for a in SWEEP]
    stale = [w for size in sizes for w in cost_disagreements({n: o.runtime for n, o in opened.items()}, size)]
    if stale:  # only cached curves can be here: fresh ones are measured inside the bench
        raise EagleExportError(f"the cached cost curves disagree: {stale[0]}",
                               "drop --reuse-costs: bench then measures every build's curves in this run")
    prompts = list(chat_prompts(first.chat_template(), dataset, num_prompts))
    if max(sizes) > len(prompts):  # the batch would be the prompts' count, yet reported (and costed) as asked
        raise EagleExportError(f"--batch {batch} asks for more prompts a batch than --num-prompts {num_prompts} of "
                               f"{dataset} gives ({len(prompts)})",
                               f"pass --num-prompts {max(sizes)} or more (of a prompt set or file that holds as many), "
                               "or a smaller --batch")
    config = replace(config, eos_ids=first.eos_ids)
    results = []
    for size in sizes:
        result = run_bench({name: o.runtime for name, o in opened.items()}, prompts, size, config,
                           acceptances=acceptances, repeat=repeat, progress=progress.say)
        result["dataset"] = dataset
        results.append(result)
        click.echo(f"batch {size}: autoregressive {result['ar_tokens_per_s']:.1f} tokens/s"
                   + (f"; SYNTHETIC acceptance {', '.join(result['synthetic']['acceptance'])} (the real drafter "
                      "runs, its drafts are replaced)" if acceptances else ""))
        for warning in result["cost_warnings"]:
            click.echo(f"warning: {warning}; the speedups below may mislead (run bench again on a quieter machine)")
        if acceptance_sweep:
            _echo_sweep(result)
            continue
        for build_name, build in result["builds"].items():
            verify = build["costs"]["verify_ms"]
            click.echo(f"{build_name} ({build['speculation']}): verify of T=1..{len(verify)} tokens "
                       f"{', '.join(f'{ms:.1f}' for ms in verify.values())} ms, drafter "
                       f"{max(build['costs']['draft_ms'].values()):.1f} ms")
            for name, p in build["policies"].items():
                hist = " ".join(f"{k}:{n}" for k, n in p["depth_histogram"].items())
                click.echo(f"  {name:8} {p['spec_tokens_per_s']:.1f} tokens/s, speedup {p['speedup']:.2f}x (whole run); "
                           f"median over {p['batches']} batches {p['speedup_median_over_batches']:.2f}x; tau "
                           f"{p['tau']:.2f}, efficiency {p['efficiency']:.2f}, verify width {p['verify_width_mean']:.1f}, "
                           f"round cost {p['round_cost_in_steps']:.2f} steps"
                           + (f", a round without drafts {p['plain_round_vs_step']:.3f}x a plain step"
                              if p["plain_round_vs_step"] is not None else "")
                           + f"; depth verified per round {hist} "
                           f"(drafter called in {p['draft_calls']} of {p['rounds']} rounds); outputs identical to "
                           f"plain decoding: {'yes' if p['identical_to_autoregressive'] else 'NO, OUTPUT DIFFERS'}")
    if json_file:
        write_output(json_file, json.dumps(results[0] if len(results) == 1 else results, indent=2) + "\n")
    if plot_file:
        (plot_sweep if acceptance_sweep else plot)(results, plot_file)


def _echo_sweep(result: dict) -> None:
    """The sweep as a table per build: acceptance -> measured decode speedup and the model's, per policy."""
    for name, build in result["builds"].items():
        even = build["break_even_acceptance"]
        click.echo(f"{name} ({build['speculation']}), synthetic acceptance sweep; break-even acceptance "
                   + (f"{even:.2f}" if even is not None else "none (drafting never pays on these costs)"))
        click.echo("  acceptance  goodput (model)   fixed (model)   tau fixed  identical")
        for rec in build["sweep"]:
            g, f = rec["policies"]["goodput"], rec["policies"]["fixed"]
            same = g["identical_to_autoregressive"] and f["identical_to_autoregressive"]
            click.echo(f"  {rec['acceptance']:>10}  {g['decode_speedup']:.2f}x ({g['model_speedup']:.2f}x)  "
                       f"{f['decode_speedup']:.2f}x ({f['model_speedup']:.2f}x)  {f['tau']:9.2f}  "
                       + ("yes" if same else "NO: OUTPUT DIFFERS"))


@main.command()
@click.argument("sources", nargs=-1, required=True, type=click.Path())
@click.option("--target", type=click.Path(), help="The target directory, for SOURCES that are drafter directories.")
@click.option("--dataset", multiple=True, callback=utf8,
              help="mt-bench (or mtbench), humaneval, sharegpt, long (MT-bench after 1.5-3k tokens of "
                   "conversation), or a text file (one prompt a line); repeatable.  [default: mt-bench]")
@click.option("--num-prompts", default=8, show_default=True, type=int, help="How many prompts of each dataset.")
@click.option("--max-new-tokens", default=64, show_default=True, type=int, help="Greedy answer tokens per prompt.")
@click.option("--depth", default=6, show_default=True, type=int, help="Chain depth K to diagnose.")
@click.option("--quantize", multiple=True, type=click.Choice(["fp8", "fp8_weight_only", "nvfp4", "nvfp4_weight_only"]),
              help="Also diagnose each drafter quantized with ModelOpt to this precision, beside itself (repeatable).")
@click.option("--calib-prompts", default=16, show_default=True, type=int,
              help="With --quantize: ShareGPT conversations to calibrate on.")
@click.option("--json", "json_file", type=click.Path(), callback=output_file, help="Write the figures as JSON.")
@click.option("--plot", "plot_file", type=click.Path(), callback=output_file,
              help="Write hidden-state RMS, sink mass and acceptance against depth as a PNG (needs eagle-export[plot]).")
@ALLOW_CHANGED_SOURCES
def diagnose(sources, target, dataset, num_prompts, max_new_tokens, depth, quantize, calib_prompts, json_file,
             plot_file, allow_changed_sources):
    """Why acceptance falls with depth: per draft depth, teacher-forced and live acceptance, the RMS of the
    fed-back state, attention mass on the sink, the prefix and the chain's own keys, entropy and calibration.

    SOURCES are builds or drafter directories (with --target), run side by side in fp32 on the target's
    greedy answers to the same prompts."""

    from .data.prompts import prompt_set
    from .output_dir import write_output

    datasets = tuple(prompt_set(d) for d in dataset) or ("mt-bench",)  # checked before torch is imported
    from .tools.bench import pyplot
    from .tools.diagnose import diagnose_sources, plot, table

    if plot_file:
        pyplot(plot_file)  # a missing matplotlib or an unknown format fails now, not after the run
    report = diagnose_sources(sources, target, datasets, num_prompts, depth, max_new_tokens,
                              quantize, calib_prompts, echo=click.echo, progress=progress.say,
                              allow_changed_sources=allow_changed_sources)
    click.echo(table(report))
    if json_file:
        write_output(json_file, json.dumps(report, indent=2) + "\n")
    if plot_file:
        plot(report, plot_file)


@main.command()
@click.option("--gpu", is_flag=True, help="The GPU suite: what only a GPU can settle (the only suite so far, and "
                                          "the default).")
@click.option("--build", "build_dir", type=click.Path(), callback=utf8,
              help="A build made on this machine, with engines (default: build the sample here first).")
@click.option("--report", "report_path", default="selftest-gpu.json", show_default=True, type=click.Path(),
              callback=output_file, help="Where to write the JSON report.")
def selftest(gpu, build_dir, report_path):
    """The first command to run on a GPU machine: environment, engines built and bound as computed,
    TensorRT against ONNX Runtime CPU, the lossless loop 50x, clean errors, FP8/NVFP4 gating, ONNX
    Runtime CUDA, and a batch 1/4 bench on each backend; each step one line, all in one JSON report.
    Exit 1 when a step fails; exit 0 with one line on a machine without a GPU."""
    from .environment import cuda_available
    from .tools.doctor import NO_GPU_SELFTEST

    if not report_path:
        raise EagleExportError("--report '' names no file, and the suite's results go nowhere else",
                               "pass a file name, e.g. --report selftest-gpu.json")
    if build_dir is not None:  # a build given is checked as every reader checks it, GPU or not
        from .builder.manifest import check_build

        check_build(build_dir)
    if not cuda_available():  # answered before the suite's imports (torch, onnx: seconds)
        click.echo(NO_GPU_SELFTEST)
        return
    from .tools.selftest import selftest as run_selftest

    report = run_selftest(build_dir, report_path, echo=click.echo)
    if report is not None and not report["ok"]:
        sys.exit(1)


# Commands of later stages are added below this line, one function each.


@main.command("export")
@click.option("--target", "target_dir", required=True, type=click.Path(), help="Target LLM directory (Hugging Face).")
@click.option("--draft", "drafter_dir", required=True, type=click.Path(), help="EAGLE-3 / 3.1 drafter directory.")
@click.option("--depth", default=4, show_default=True, type=int,
              help=f"Speculation depth K (1..{MAX_DEPTH}) of the unrolled drafter.")
@click.option("--dtype", default="fp16", show_default=True, help="Export precision: fp32, fp16 or bf16.")
@click.option("--sampling", is_flag=True, help="Export the sampling drafter and a target that also returns logits.")
@click.option("-o", "--out", "out_dir", required=True, type=click.Path(), callback=output_directory,
              help="Output directory.")
@click.option("--force", is_flag=True, help="Overwrite files in a non-empty output directory.")
def export(target_dir, drafter_dir, depth, dtype, sampling, out_dir, force):
    """Export target.onnx and the depth-K unrolled drafter.onnx, cleaned and linted.

    The pair goes through the model passes `build` applies (`eagle-export passes` lists them: q/k/v and
    gate/up fused, norm gains folded, EAGLE-3.1's fc norm moved into the target), so the graphs are
    the ones a build exports at this depth and dtype."""
    from .export.export import export_models

    export_models(target_dir, drafter_dir, depth, dtype, out_dir, sampling=sampling, force=force,
                  progress=click.echo)
    click.echo(f"wrote {out_dir}/target.onnx, drafter.onnx, {'drafter_sampling.onnx, ' if sampling else ''}"
               "export_summary.json")


@main.command("passes")
def list_passes():
    """List every graph pass, model level (torch) and ONNX level, with a one-line summary each."""
    from .passes.model_pipeline import all_passes

    infos = all_passes()
    width = max(len(p.name) for p in infos)
    for p in infos:
        click.echo(f"{p.level:6} {p.name:{width}}  {p.summary}")


@main.command("quantize")
@click.option("--target", "target_dir", required=True, type=click.Path(), help="Target LLM directory (Hugging Face).")
@click.option("--draft", "drafter_dir", default=None, type=click.Path(), help="EAGLE-3 / 3.1 drafter directory (optional).")
@click.option("--precision", required=True, type=click.Choice(["fp8", "fp8_weight_only", "nvfp4", "nvfp4_weight_only"]),
              help="What to quantize to (weight_only: weights only, activations stay in the float dtype).")
@click.option("--keep", default="lm_head,fc", show_default=True, help="Modules kept in high precision (comma-separated names).")
@click.option("--calib-prompts", default=16, show_default=True, type=click.IntRange(1),
              help="ShareGPT conversations to calibrate on.")
@click.option("--eval-prompts", default=8, show_default=True, type=click.IntRange(1), help="MT-bench prompts for the metrics.")
@click.option("--tau-prompts", default=0, show_default=True, type=click.IntRange(0),
              help="MT-bench prompts to measure tau on (needs --draft).")
@click.option("--continuation-prompts", default=0, show_default=True, type=click.IntRange(0),
              help="MT-bench prompts whose greedy continuations (--max-new-tokens) the quantized target must follow.")
@click.option("--max-new-tokens", default=64, show_default=True, type=click.IntRange(1),
              help="Continuation length for tau and agreement.")
@click.option("--depth", default=4, show_default=True, type=int, help="Speculation depth K for tau and the drafter graph.")
@click.option("-o", "--out", "out_dir", default=None, type=click.Path(), callback=output_directory,
              help="Export and check the quantized graphs here.")
@click.option("--json", "json_file", default=None, type=click.Path(), callback=output_file,
              help="Write the metrics to this file.")
def quantize_command(target_dir, drafter_dir, precision, keep, calib_prompts, eval_prompts, tau_prompts,
                     continuation_prompts, max_new_tokens, depth, out_dir, json_file):
    """Quantize with ModelOpt (FP8 / NVFP4), measure against the unquantized models, export the graphs.

    The models go through the model passes `build` applies before quantizing (q/k/v and gate/up
    fused: one weight scale each, as in a build), so the metrics describe the model a build makes.
    Without --draft, the passes that need the drafter (sharing embeddings, moving EAGLE-3.1's fc
    norm into the target) have nothing to act on and are skipped."""

    from .output_dir import write_output
    from .quantize.quantize import quantize_models
    from .tools.quantized_graphs import export_and_check

    report, qtarget, qdrafter = quantize_models(
        target_dir, drafter_dir, precision, depth, exclude=tuple(k for k in keep.split(",") if k),
        calib_prompts=calib_prompts, eval_prompts=eval_prompts, tau_prompts=tau_prompts,
        continuation_prompts=continuation_prompts, max_new_tokens=max_new_tokens, progress=click.echo)
    if out_dir is not None:
        click.echo(f"exporting and checking the {precision} graphs in {out_dir}")
        report["graphs"] = export_and_check(qtarget, qdrafter, depth, Path(out_dir))
    text = json.dumps(report, indent=2)
    click.echo(text)
    if json_file:
        write_output(json_file, text + "\n")


@main.command("export-checkpoint")
@click.argument("source", type=click.Path())
@click.option("-o", "--out", "out_dir", required=True, type=click.Path(), callback=output_directory,
              help="Checkpoint directory to create.")
@click.option("--format", "fmt", default="vllm", show_default=True, type=click.Choice(["vllm", "sglang", "speculators"]),
              help="vllm / sglang: LlamaForCausalLMEagle3 layout, aux ids in that engine's numbering; speculators.")
@click.option("--target", type=click.Path(), help="The target directory, when SOURCE is a drafter directory.")
@click.option("--precision", type=click.Choice(["fp32", "fp16", "bf16", "fp8", "nvfp4"]),
              help="Default: fp8 or nvfp4 where the build quantized its drafter so; else the drafter's own dtype "
                   "(its config's torch_dtype, or fp32; a build's fp16/bf16 is its graphs', not the checkpoint's).")
@click.option("--embeddings", type=click.Choice(["store", "share"]),
              help="Store the embedding table or leave it to the target (default: store for speculators).")
@click.option("--verifier", help="The target's name to record for speculators (e.g. a Hub id; default: its path).")
@click.option("--calib-prompts", type=click.IntRange(1),
              help="FP8/NVFP4: ShareGPT conversations to calibrate on, each cut to the calibration's token limit "
                   "(the build's, else 512) (default: the build's calibration set).")
@click.option("--force", is_flag=True, help="Replace an existing output directory (only once the new one is complete).")
@ALLOW_CHANGED_SOURCES
def export_checkpoint_command(source, out_dir, fmt, target, precision, embeddings, verifier, calib_prompts, force,
                              allow_changed_sources):
    """Write the drafter of a build (or of --target + drafter) as a checkpoint vLLM, SGLang or speculators loads."""
    from .tools.checkpoint_export import export_checkpoint

    summary = export_checkpoint(source, out_dir, fmt, target=target, precision=precision, embeddings=embeddings,
                                verifier=verifier, calib_prompts=calib_prompts, force=force, progress=click.echo,
                                allow_changed_sources=allow_changed_sources)
    trip = summary["round_trip"]
    click.echo(f"wrote {out_dir} ({fmt}, {summary['precision']}, aux ids {summary['aux_layer_ids']} in "
               f"{ENGINE_NAMES[summary['aux_layer_numbering']]} numbering, embeddings {summary['embeddings']}d); "
               f"loaded back: max abs logit diff {trip['max_abs_logit_diff']:.3g} (tolerance {trip['tolerance']})")
    readers = summary["readers"]
    click.echo("measured to serve it exactly: " + ("; ".join(readers["exact"]) or
               f"none of the readers run here ({readers['measured']}); vLLM and SGLang were not run here"))
    for line in readers["mis_serve"]:
        click.echo(f"warning: known to mis-serve it: {line}")
    for line in readers.get("unmeasured", []):
        click.echo(f"note: not measured: {line}")


ENGINE_NAMES = {"vllm": "vLLM", "sglang": "SGLang"}


if __name__ == "__main__":  # `python -m eagle_export.cli ARGS`, as the `eagle-export` script runs
    main(prog_name="eagle-export")
