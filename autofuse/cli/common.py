"""What the commands share: the click group, the one-line error for a user's mistake, the device
choice, and options several commands take."""

from __future__ import annotations

import logging
import os
import warnings

import click
import torch

from ..errors import AutofuseError
from ..shapes import DTYPES


class _Group(click.Group):
    """Turns AutofuseError (a user's mistake) into a one-line message and exit code 2."""

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
    return click.option("--dtype", type=click.Choice(list(DTYPES)), default=None, help=help_text)
