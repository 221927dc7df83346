"""The `eagle-export` command line. Errors from bad input print as one clear message, no traceback."""

from __future__ import annotations

import json
import sys

import click

from . import __version__
from .errors import EagleExportError


class _Group(click.Group):
    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except EagleExportError as e:
            click.echo(f"error: {e.problem}", err=True)
            if e.fix:
                click.echo(f"  fix: {e.fix}", err=True)
            sys.exit(2)


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="eagle-export")
def main():
    """Compile EAGLE-3 / EAGLE-3.1 drafters and their target LLMs to TensorRT engines."""


@main.command()
@click.argument("path", type=click.Path())
@click.option("--target", type=click.Path(), help="Target directory to check a drafter against.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def inspect(path, target, as_json):
    """Say what a checkpoint directory holds (target or drafter) and what does not fit."""
    from .inspect import inspect_checkpoint

    report = inspect_checkpoint(path, target)
    if as_json:
        click.echo(json.dumps(report, indent=2))
        return
    for key, value in report.items():
        if key != "warnings":
            click.echo(f"{key:24} {value}")
    for w in report["warnings"]:
        click.echo(f"warning: {w}")


@main.command("sample-target")
def sample_target():
    """Print the sample target's directory (SmolLM2-135M-Instruct), converting it on first use."""
    from .sample import sample_target_dir

    click.echo(str(sample_target_dir()))


@main.command()
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def doctor(as_json):
    """Report torch, CUDA, TensorRT, ONNX Runtime and ModelOpt, the GPU, and what can be built here."""
    from .doctor import doctor_report

    report = doctor_report()
    if as_json:
        click.echo(json.dumps(report, indent=2))
        return
    gpu = report["gpu"]
    click.echo(f"python        {report['python']}")
    click.echo(f"torch         {report['torch']} (CUDA {report['cuda'] or 'none'}, available: {report['cuda_available']})")
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


# Commands of later stages are added below this line, one function each.
