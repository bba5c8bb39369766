"""What the commands share: the click group, the one-line error for a user's mistake, the device
choice, and options several commands take."""

from __future__ import annotations

import importlib
import logging
import os
import warnings

import click

from ..errors import AutofuseError

# The dtypes the command line takes (shapes.DTYPES maps them to torch's; named here so that parsing the
# command line imports no PyTorch).
DTYPE_NAMES = ("float32", "float16", "bfloat16")

# Every command: the module of this package that defines it, and its one-line help for `autofuse --help`
# (tests/test_cli.py checks each against the command's own). A command's module is imported only when the
# command runs or shows its own help: `autofuse --help` imports no PyTorch.
COMMANDS = {
    "bench": ("measure", "Check and time every provider's forward for each shape and M, beside the roofline."),
    "cache": ("cache", "Inspect, export, import or clear tuned configs."),
    "demo": ("measure", "Build fused modules for a shapes file, check them against PyTorch, time them against eager."),
    "kernel": ("show", "Print the generated Triton source that KEY's tuned config runs."),
    "profile": ("measure", "Profile eager, torch.compile and autofuse side by side: kernels, GPU and host time, "
                           "traffic."),
    "show-kernel": ("show", "Print the Triton source autofuse generates for OP (the names `tune --ops` takes, and the "
                            "pointwise passes)."),
    "traffic": ("traffic", "Show traffic traces recorded with AUTOFUSE_TRAFFIC or autofuse.record_traffic."),
    "tune": ("tune", "Tune every key of a shapes file (or a model config's MLP) and store the winners in the cache."),
}


class _Group(click.Group):
    """Loads a command's module when the command is asked for, and turns AutofuseError (a user's
    mistake) into a one-line message and exit code 2."""

    def list_commands(self, ctx):
        return sorted(COMMANDS)

    def get_command(self, ctx, name):
        if name not in COMMANDS:
            return None
        if name not in self.commands:
            importlib.import_module(f"{__package__}.{COMMANDS[name][0]}")  # adds its commands to `main`
        return self.commands.get(name)

    def format_commands(self, ctx, formatter):
        with formatter.section("Commands"):
            formatter.write_dl([(name, help_text) for name, (_, help_text) in sorted(COMMANDS.items())])

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except AutofuseError as e:
            raise click.UsageError(str(e)) from None


class _TerminalHandler(logging.Handler):
    """The library's log records on the command line: one line each on the current stderr."""

    def emit(self, record: logging.LogRecord) -> None:
        click.echo(self.format(record), err=True)


@click.group(cls=_Group)
@click.version_option(package_name="autofuse")
def main():
    """autofuse: tuned, fused Triton kernels for transformer MLP blocks."""
    logger = logging.getLogger("autofuse")
    if not any(isinstance(h, _TerminalHandler) for h in logger.handlers):
        logger.addHandler(_TerminalHandler())
    if logger.getEffectiveLevel() > logging.INFO:  # every invocation: something may have reset the level since
        logger.setLevel(logging.INFO)


def select_device() -> str:
    """'cuda' when a GPU is visible; otherwise switch Triton's interpreter on and say so."""
    import torch

    if torch.cuda.is_available():
        return "cuda"
    os.environ["TRITON_INTERPRET"] = "1"
    # The interpreter computes float16 in NumPy, which warns on every overflow of a test input even
    # where the results check out: noise in a table of checked results.
    warnings.filterwarnings("ignore", category=RuntimeWarning, module=r"triton\.runtime\.interpreter")
    click.echo(
        "No CUDA GPU visible: running autofuse's Triton kernels under Triton's interpreter on the CPU. "
        "Results are checked as usual; timings say nothing about GPU speed.",
        err=True,
    )
    return "cpu"


def parse_tokens(text: str | None) -> tuple[int, ...] | None:
    if text is None:
        return None
    try:
        tokens = tuple(sorted({int(t) for t in text.split(",") if t.strip()}))
    except ValueError:
        raise AutofuseError(f"--tokens must be comma-separated positive integers, got {text!r}") from None
    if not tokens or tokens[0] < 1:
        raise AutofuseError(f"--tokens must be comma-separated positive integers, got {text!r}")
    return tokens


def parse_choices(text: str, choices: tuple[str, ...], what: str, option: str) -> list[str]:
    """A comma-separated selection from `choices`, in the order given; a usage error names the unknown ones."""
    picked = [p.strip() for p in text.split(",") if p.strip()]
    unknown = [p for p in picked if p not in choices]
    if unknown or not picked:
        raise click.BadParameter(f"unknown {what}(s) {', '.join(unknown) or '(none given)'}; choose from "
                                 f"{', '.join(choices)}", param_hint=option)
    return picked


def shapes_file_option(help_text: str):
    return click.option("--shapes", "shapes_path", type=click.Path(dir_okay=False), default=None, help=help_text)


def model_option(help_text: str):
    return click.option("--model", "model_path", type=click.Path(), default=None, help=help_text)


def dtype_option(help_text: str):
    return click.option("--dtype", type=click.Choice(DTYPE_NAMES), default=None, help=help_text)
