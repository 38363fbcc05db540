"""Run sd-scripts' train_network.py with --v2 --v_parameterization (SD 2.x) end to end on a small
random checkpoint: tests/sd_scripts_small_sd15.py's U-Net and workspace with SD 2.x's text
encoder (OpenCLIP-H's layout, small), cross-attention features, head counts and tokenizer.

    python tests/sd_scripts_small_sd2.py [--record DIR] --sd-scripts DIR train_network.py ARGS...
"""

from __future__ import annotations

import sys
from pathlib import Path

import sd_scripts_small_common as common
import sd_scripts_small_sd15 as sd15

SCRIPT = sd15.SCRIPT


def shrink_factories() -> None:
    """Make sd-scripts build the small SD 2.x U-Net and text encoder."""
    common.install(sd15.small_factories(v2=True))


def make_workspace(root: Path) -> dict[str, Path]:
    return sd15.make_workspace(root, v2=True)


def train_args(paths: dict[str, Path]) -> list[str]:
    return [*sd15.train_args(paths), "--v2", "--v_parameterization"]


if __name__ == "__main__":
    sys.exit(common.harness_main(shrink_factories, sys.argv[1:]))
