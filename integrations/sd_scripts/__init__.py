"""kohya sd-scripts: run any of its training scripts with compile_accel, the checkout unchanged.

    compile-accel sd-scripts [--sd-scripts DIR] lumina_train_network.py ARGS...
    python -m compile_accel.integrations.sd_scripts [--sd-scripts DIR] lumina_train_network.py ARGS...
    accelerate launch -m compile_accel.integrations.sd_scripts [--sd-scripts DIR] lumina_train_network.py ARGS...

The script runs as `__main__` (runpy) after these functions are wrapped in memory:

- `library.train_util.add_training_arguments` (and `library.args`' in newer sd-scripts, which
  define it there), which every training script calls to build its parser: that parser's
  `parse_known_args` adds the compile flags at its first call, after the script's own (so
  `--help` lists them, and sd-scripts' own `--compile*` flags, where the script has them, are
  known: see `add_arguments`), and checks them at every call, also when `--config_file`
  re-parses with the file's values.
- `accelerate.Accelerator.prepare`, which every trainer calls on the DiT/U-Net after LoRA's
  `apply_to` and `enable_gradient_checkpointing` and before the first step (it is where
  sd-scripts' own `--torch_compile` compiles): the first sd-scripts model passed to it is
  accelerated in place before the original prepare runs; one that arrives before any parse
  of a parser built so stops the launch (its compile flags were never read).
- `accelerate.Accelerator.backward`, which every trainer calls once per step: after the first
  one the launcher prints what compiling took (and what `auto` chose); the counters again at exit.

Modules, imported in this order: `families` (what the launcher knows of each model), `flags`
(the compile flags and the CompileConfig they make), `launcher` (the hooks and the run).
"""

from .families import FAMILIES, apply, block_swap_ladder, is_sd_scripts_model
from .flags import BUDGET_ENV, SELECTIVE_ENV, LaunchError, add_arguments, config_from_args
from .launcher import DESCRIPTION, KNOWN_TO_WORK, Launch, add_launcher_arguments, launch, main, run

__all__ = [
    "BUDGET_ENV",
    "DESCRIPTION",
    "FAMILIES",
    "KNOWN_TO_WORK",
    "SELECTIVE_ENV",
    "Launch",
    "LaunchError",
    "add_arguments",
    "add_launcher_arguments",
    "apply",
    "block_swap_ladder",
    "config_from_args",
    "is_sd_scripts_model",
    "launch",
    "main",
    "run",
]
